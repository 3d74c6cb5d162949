package envelope

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
)

func TestSentinelAndClusterURLs(t *testing.T) {
	u, err := parseMultiHost("rediss-sentinel://app:s%40cret@h1,h2:26380,[::1]/2#main"+
		"?sentinel_username=watch&sentinel_password=pw", 26379)
	if err != nil {
		t.Fatal(err)
	}
	o := u.failoverOptions()
	if o.MasterName != "main" || !slices.Equal(o.SentinelAddrs, []string{"h1:26379", "h2:26380", "[::1]:26379"}) ||
		o.Username != "app" || o.Password != "s@cret" || o.DB != 2 || o.SentinelUsername != "watch" ||
		o.SentinelPassword != "pw" || o.TLSConfig == nil || o.Protocol != 2 {
		t.Fatalf("failover options %+v", o)
	}
	u, err = parseMultiHost("redis-sentinel://h1?sentinel_password=pw#main", 26379)
	if err != nil || u.masterName != "main" || u.sentinelPassword != "pw" || u.tlsConfig != nil || u.db != 0 {
		t.Fatalf("query before the master name: %+v %v", u, err)
	}
	u, err = parseMultiHost("redis-cluster://:pw@10.0.0.1:7000,10.0.0.2", 6379)
	if err != nil {
		t.Fatal(err)
	}
	c := u.clusterOptions()
	if !slices.Equal(c.Addrs, []string{"10.0.0.1:7000", "10.0.0.2:6379"}) || c.Password != "pw" || c.Username != "" ||
		c.TLSConfig != nil || c.Protocol != 2 {
		t.Fatalf("cluster options %+v", c)
	}
}

func TestNewUniversalClientPicksTheClientOfTheURL(t *testing.T) {
	for url, want := range map[string]string{
		"redis://127.0.0.1:1/0":              "*redis.Client",
		"rediss://127.0.0.1:1":               "*redis.Client",
		"redis-sentinel://127.0.0.1:1#main":  "*redis.Client",
		"redis-cluster://127.0.0.1:1":        "*redis.ClusterClient",
		"rediss-cluster://127.0.0.1:1,h2:10": "*redis.ClusterClient",
	} {
		c, err := NewUniversalClient(url)
		if err != nil {
			t.Fatalf("%s: %v", url, err)
		}
		if got := typeName(c); got != want {
			t.Errorf("%s: %s, want %s", url, got, want)
		}
		c.Close()
	}
}

func typeName(c redis.UniversalClient) string {
	switch c.(type) {
	case *redis.Client:
		return "*redis.Client"
	case *redis.ClusterClient:
		return "*redis.ClusterClient"
	}
	return "other"
}

func TestInvalidURLsNameTheWrongPart(t *testing.T) {
	for url, part := range map[string]string{
		"h1:6379":                                  "scheme",
		"http://h1":                                "scheme",
		"redis://h1:port":                          "url",
		"redis-sentinel://h1":                      "master_name",
		"redis-sentinel://h1/0#":                   "master_name",
		"redis-sentinel://#main":                   "host",
		"redis-sentinel:///0#main":                 "host",
		"redis-sentinel://h1,,h2#main":             "host",
		"redis-sentinel://h1:0#main":               "host",
		"redis-sentinel://h1:abc#main":             "host",
		"redis-sentinel://::1#main":                "host",
		"redis-sentinel://h1/x#main":               "db",
		"redis-sentinel://h1?master=main":          "master_name",
		"redis-sentinel://h1?timeout=1#main":       "query",
		"redis-sentinel://u:p%zz@h1#main":          "userinfo",
		"redis-cluster://h1/1":                     "db",
		"redis-cluster://h1#main":                  "master_name",
		"redis-cluster://h1?sentinel_password=pw":  "query",
		"rediss-cluster://":                        "host",
		"redis-sentinel://u:topsecret@h1:99999#m":  "host",
		"redis-cluster://u:topsecret@h1:6379,h2:x": "host",
	} {
		_, err := NewUniversalClient(url)
		var ue *URLError
		if !errors.As(err, &ue) || ue.Part != part {
			t.Errorf("%s: %v, want a URLError naming %s", url, err, part)
			continue
		}
		if strings.Contains(err.Error(), "topsecret") || !strings.Contains(err.Error(), part) {
			t.Errorf("%s: message %q must name %s and hide the password", url, err, part)
		}
	}
	if _, err := NewClient("redis-cluster://h1"); err == nil || !strings.Contains(err.Error(), "scheme") {
		t.Errorf("NewClient takes plain URLs only: %v", err)
	}
}
