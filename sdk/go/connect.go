package envelope

import (
	"crypto/tls"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// URLError is a connection URL that cannot be used; Part names what is wrong
// (scheme, userinfo, host, port, db, master_name, query, or a TLS parameter
// such as ssl_ca_certs).
type URLError struct {
	URL, Part, Reason string
}

func (e *URLError) Error() string {
	return fmt.Sprintf("redis URL %q: %s: %s", redactURL(e.URL), e.Part, e.Reason)
}

// redactURL hides the password of a URL in error messages.
func redactURL(raw string) string {
	rest, ok := strings.CutPrefix(raw, schemeOf(raw)+"://")
	if !ok {
		return raw
	}
	at := strings.LastIndexByte(rest, '@')
	if at < 0 {
		return raw
	}
	user, _, hasPassword := strings.Cut(rest[:at], ":")
	if !hasPassword {
		return raw
	}
	return schemeOf(raw) + "://" + user + ":***" + rest[at:]
}

func schemeOf(raw string) string {
	scheme, _, _ := strings.Cut(raw, "://")
	return scheme
}

// NewClient connects to a redis:// or rediss:// URL with the settings this
// peer relies on: RESP2 (Lua false reads as nil, as in every other language)
// and no connection-time commands that older servers refuse. A rediss:// URL
// takes the TLS parameters ssl_ca_certs, ssl_certfile, ssl_keyfile and
// ssl_cert_reqs (see tlsParamNames) besides go-redis' own.
func NewClient(rawURL string) (*redis.Client, error) {
	switch schemeOf(rawURL) {
	case "redis", "rediss", "unix":
	default:
		return nil, &URLError{rawURL, "scheme", "NewClient takes redis://, rediss:// or unix://; use NewUniversalClient for Sentinel and Cluster"}
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		return nil, &URLError{rawURL, "url", err.Error()}
	}
	query := u.Query()
	tlsConfig, err := takeTLSParams(rawURL, query, u.Scheme == "rediss")
	if err != nil {
		return nil, err
	}
	u.RawQuery = query.Encode()
	opts, err := redis.ParseURL(u.String())
	if err != nil {
		return nil, &URLError{rawURL, "url", err.Error()}
	}
	if tlsConfig != nil { // go-redis set the server name and its own skip_verify parameter
		opts.TLSConfig.RootCAs, opts.TLSConfig.Certificates = tlsConfig.RootCAs, tlsConfig.Certificates
		opts.TLSConfig.InsecureSkipVerify = opts.TLSConfig.InsecureSkipVerify || tlsConfig.InsecureSkipVerify
	}
	opts.Protocol = 2
	opts.DisableIdentity = true
	opts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	return redis.NewClient(opts), nil
}

// NewUniversalClient connects to one Redis, a Sentinel-managed primary or a
// Redis Cluster, as the URL says:
//
//	redis://[[user]:password@]host[:6379][/db]     (rediss:// with TLS)
//	redis-sentinel://[[user]:password@]h1[:26379][,h2[:port]...][/db]#<master_name>
//	    [?sentinel_username=...&sentinel_password=...]   (rediss-sentinel:// with TLS to
//	    the data nodes and the sentinels)
//	redis-cluster://[[user]:password@]h1[:6379][,h2[:port]...]   (rediss-cluster:// with TLS)
//
// The TLS schemes take the query parameters ssl_ca_certs, ssl_certfile,
// ssl_keyfile and ssl_cert_reqs (see tlsParamNames); a Sentinel client uses
// them with the sentinels and with the data nodes. The user and password are
// the data nodes'. A Sentinel client connects only to the primary more than
// half of the listed sentinels name, asked again on every new connection
// (else the connection fails with a *SentinelMajorityError). The clients use
// RESP2, as NewClient does. An invalid URL fails at once with a *URLError
// naming the wrong part.
func NewUniversalClient(rawURL string) (redis.UniversalClient, error) {
	scheme := schemeOf(rawURL)
	switch scheme {
	case "redis", "rediss", "unix":
		return NewClient(rawURL)
	case "redis-sentinel", "rediss-sentinel":
		u, err := parseMultiHost(rawURL, 26379)
		if err != nil {
			return nil, err
		}
		client := redis.NewFailoverClient(u.failoverOptions())
		client.AddHook(newMajorityPrimary(u))
		return client, nil
	case "redis-cluster", "rediss-cluster":
		u, err := parseMultiHost(rawURL, 6379)
		if err != nil {
			return nil, err
		}
		return redis.NewClusterClient(u.clusterOptions()), nil
	}
	return nil, &URLError{rawURL, "scheme", fmt.Sprintf("%q is not one of redis, rediss, unix, redis-sentinel, "+
		"rediss-sentinel, redis-cluster, rediss-cluster", scheme)}
}

// multiHostURL is a parsed redis-sentinel:// or redis-cluster:// URL.
type multiHostURL struct {
	tlsConfig                          *tls.Config // nil without TLS
	username, password                 string
	addrs                              []string
	db                                 int
	masterName                         string
	sentinelUsername, sentinelPassword string
}

// parseMultiHost parses the Sentinel and Cluster forms; Go's url package
// refuses their comma-separated host lists.
func parseMultiHost(raw string, defaultPort int) (*multiHostURL, error) {
	scheme := schemeOf(raw)
	sentinel := strings.HasSuffix(scheme, "-sentinel")
	fail := func(part, reason string) (*multiHostURL, error) { return nil, &URLError{raw, part, reason} }
	u := &multiHostURL{}
	rest := strings.TrimPrefix(raw, scheme+"://")
	rest, fragment, hasFragment := strings.Cut(rest, "#")
	rest, query, hasQuery := strings.Cut(rest, "?")
	if !hasQuery { // the query may also follow the master name: ...#<master_name>?sentinel_password=...
		fragment, query, _ = strings.Cut(fragment, "?")
	}
	rest, path, hasPath := strings.Cut(rest, "/")
	if at := strings.LastIndexByte(rest, '@'); at >= 0 {
		user, password, _ := strings.Cut(rest[:at], ":")
		var err1, err2 error
		u.username, err1 = url.PathUnescape(user)
		u.password, err2 = url.PathUnescape(password)
		if err1 != nil || err2 != nil {
			return fail("userinfo", "invalid percent-encoding")
		}
		rest = rest[at+1:]
	}
	if rest == "" {
		return fail("host", "at least one host is required")
	}
	for _, hostPort := range strings.Split(rest, ",") {
		addr, err := hostAddr(hostPort, defaultPort)
		if err != nil {
			return fail("host", err.Error())
		}
		u.addrs = append(u.addrs, addr)
	}
	if hasPath && path != "" {
		if !sentinel {
			return fail("db", "Redis Cluster has only database 0; remove the path")
		}
		db, err := strconv.Atoi(path)
		if err != nil || db < 0 {
			return fail("db", fmt.Sprintf("%q is not a database number", path))
		}
		u.db = db
	}
	if sentinel {
		name, err := url.PathUnescape(fragment)
		if !hasFragment || err != nil || name == "" {
			return fail("master_name", "the URL must end with #<master_name>")
		}
		u.masterName = name
	} else if hasFragment {
		return fail("master_name", "a cluster URL takes no #fragment")
	}
	values, err := url.ParseQuery(query)
	if err != nil {
		return fail("query", err.Error())
	}
	if u.tlsConfig, err = takeTLSParams(raw, values, strings.HasPrefix(scheme, "rediss")); err != nil {
		return nil, err
	}
	for key, v := range values {
		switch {
		case sentinel && key == "sentinel_username":
			u.sentinelUsername = v[0]
		case sentinel && key == "sentinel_password":
			u.sentinelPassword = v[0]
		default:
			return fail("query", fmt.Sprintf("unknown parameter %q (allowed: sentinel_username and "+
				"sentinel_password with redis-sentinel:// only, %s with TLS)", key, strings.Join(tlsParamNames, ", ")))
		}
	}
	return u, nil
}

// hostAddr checks one host[:port] of a host list and adds the default port.
func hostAddr(hostPort string, defaultPort int) (string, error) {
	if hostPort == "" {
		return "", fmt.Errorf("empty entry in the host list")
	}
	host, port := hostPort, strconv.Itoa(defaultPort)
	if h, p, err := net.SplitHostPort(hostPort); err == nil {
		host, port = h, p
	} else if strings.Contains(strings.Trim(hostPort, "[]"), ":") && !strings.HasPrefix(hostPort, "[") {
		return "", fmt.Errorf("%q: write IPv6 addresses in brackets", hostPort)
	}
	host = strings.Trim(host, "[]")
	if host == "" {
		return "", fmt.Errorf("%q has no host name", hostPort)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return "", fmt.Errorf("%q: port must be a number from 1 to 65535", hostPort)
	}
	return net.JoinHostPort(host, port), nil
}

func (u *multiHostURL) failoverOptions() *redis.FailoverOptions {
	return &redis.FailoverOptions{
		MasterName: u.masterName, SentinelAddrs: u.addrs,
		SentinelUsername: u.sentinelUsername, SentinelPassword: u.sentinelPassword,
		Username: u.username, Password: u.password, DB: u.db,
		TLSConfig: u.tlsConfig, Protocol: 2, DisableIdentity: true,
	}
}

func (u *multiHostURL) clusterOptions() *redis.ClusterOptions {
	return &redis.ClusterOptions{
		Addrs: u.addrs, Username: u.username, Password: u.password,
		TLSConfig: u.tlsConfig, Protocol: 2, DisableIdentity: true,
		MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled},
	}
}
