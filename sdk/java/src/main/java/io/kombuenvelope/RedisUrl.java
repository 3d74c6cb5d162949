package io.kombuenvelope;

import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisURI;
import io.lettuce.core.cluster.ClusterClientOptions;
import io.lettuce.core.cluster.ClusterTopologyRefreshOptions;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.protocol.ProtocolVersion;

import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * Builds the Lettuce client a URL names, for every topology the SDK runs on:
 * <ul>
 * <li>{@code redis://...} / {@code rediss://...}: one server (Lettuce's own URI syntax; TLS with
 * {@code rediss});</li>
 * <li>{@code redis-sentinel://[[user]:password@]h1[:26379][,h2[:port]...][/db]#<master_name>}
 * with optional query {@code sentinel_username=} and {@code sentinel_password=}: the primary that
 * a majority of the listed sentinels name, asked again on every (re)connection ({@code rediss-sentinel}: TLS to the data nodes
 * and the sentinels);</li>
 * <li>{@code redis-cluster://[[user]:password@]h1[:6379][,h2[:port]...]}: a Redis Cluster from its
 * seed nodes ({@code rediss-cluster}: TLS).</li>
 * </ul>
 * A {@code rediss} URL of any kind takes the TLS options {@code ssl_ca_certs}, {@code ssl_certfile},
 * {@code ssl_keyfile} and {@code ssl_cert_reqs} in its query (see {@link TlsOptions}); the server's
 * certificate is checked by default.
 * An invalid URL fails at once with an {@link IllegalArgumentException} naming the part that is
 * wrong. The client is the caller's to shut down.
 */
public final class RedisUrl {
    /** Which client a URL asks for. */
    public enum Kind { SINGLE, SENTINEL, CLUSTER }

    private final Kind kind;
    private final List<RedisURI> uris;
    private final TlsOptions tls;

    private RedisUrl(Kind kind, List<RedisURI> uris, TlsOptions tls) {
        this.kind = kind;
        this.uris = List.copyOf(uris);
        this.tls = tls;
    }

    /** The topology the URL names. */
    public Kind kind() { return kind; }

    /** The Lettuce URIs: one (a server, or a Sentinel URI with its sentinels), or the Cluster's seed nodes. */
    public List<RedisURI> uris() { return uris; }

    /** A {@link RedisClient} (one server, Sentinel) or a {@link RedisClusterClient} for {@code url}. */
    public static AbstractRedisClient client(String url) {
        return parse(url).client();
    }

    /** The client this URL names, with the options the SDK needs (RESP2, reconnecting, cluster topology refresh). */
    public AbstractRedisClient client() {
        if (kind == Kind.CLUSTER) {
            RedisClusterClient c = RedisClusterClient.create(uris);
            c.setOptions(tls.applyTo(ClusterClientOptions.builder()).protocolVersion(ProtocolVersion.RESP2)
                    .autoReconnect(true)
                    .topologyRefreshOptions(ClusterTopologyRefreshOptions.builder()
                            .enableAllAdaptiveRefreshTriggers()
                            .adaptiveRefreshTriggersTimeout(Duration.ofMillis(500))
                            .enablePeriodicRefresh(Duration.ofSeconds(5))
                            .build())
                    .build());
            return c;
        }
        return Redis.client(uris.get(0), tls);
    }

    /**
     * Parses {@code url}.
     *
     * @throws IllegalArgumentException naming the wrong part (scheme, userinfo, host, port, database,
     *                                  master_name, query) or TLS option
     */
    public static RedisUrl parse(String url) {
        if (url == null || url.isEmpty()) {
            throw new IllegalArgumentException("Redis URL must be non-empty");
        }
        int sep = url.indexOf("://");
        if (sep <= 0) {
            throw new IllegalArgumentException("Redis URL " + redact(url) + ": scheme missing (redis://, rediss://, "
                    + "redis-sentinel://, rediss-sentinel://, redis-cluster://, rediss-cluster://)");
        }
        String scheme = url.substring(0, sep);
        switch (scheme) {
            case "redis", "rediss" -> {
                return single(url, scheme.equals("rediss"));
            }
            case "redis-sentinel", "rediss-sentinel" -> {
                return sentinel(url, scheme.startsWith("rediss"), url.substring(sep + 3));
            }
            case "redis-cluster", "rediss-cluster" -> {
                return cluster(url, scheme.startsWith("rediss"), url.substring(sep + 3));
            }
            default -> throw new IllegalArgumentException("Redis URL " + redact(url) + ": scheme \"" + scheme
                    + "\" is not one of redis, rediss, redis-sentinel, rediss-sentinel, redis-cluster, rediss-cluster");
        }
    }

    /** Lettuce reads a one-server URL; the TLS options are taken out of its query first. */
    private static RedisUrl single(String url, boolean tls) {
        checkHostAndPort(url);
        String lettuceUrl = url;
        Map<String, String> query = Map.of();
        int q = url.indexOf('?');
        if (q >= 0) {
            int hash = url.indexOf('#', q);
            String rawQuery = hash < 0 ? url.substring(q + 1) : url.substring(q + 1, hash);
            query = query(url, rawQuery);
            StringBuilder kept = new StringBuilder();
            for (String pair : rawQuery.split("&")) { // each is name=value: query(...) checked it
                if (!pair.isEmpty()
                        && !TlsOptions.NAMES.contains(decode(url, "query", pair.substring(0, pair.indexOf('='))))) {
                    kept.append(kept.length() == 0 ? "?" : "&").append(pair);
                }
            }
            lettuceUrl = url.substring(0, q) + kept + (hash < 0 ? "" : url.substring(hash));
        }
        TlsOptions options = tlsOptions(url, query, tls);
        RedisURI uri;
        try {
            uri = RedisURI.create(lettuceUrl);
        } catch (RuntimeException e) {
            throw new IllegalArgumentException("Redis URL " + redact(url) + ": " + e.getMessage(), e);
        }
        if (query.containsKey("ssl_cert_reqs")) {
            uri.setVerifyPeer(options.verifyMode());
        }
        return new RedisUrl(Kind.SINGLE, List.of(uri), options);
    }

    private static TlsOptions tlsOptions(String url, Map<String, String> query, boolean tls) {
        return TlsOptions.of(query, tls, (part, why) -> bad(url, part, why));
    }

    /** A one-server URL must name a host and, if any, a numeric port (Lettuce alone would accept {@code h:x}). */
    private static void checkHostAndPort(String url) {
        java.net.URI u;
        try {
            u = new java.net.URI(url);
        } catch (java.net.URISyntaxException e) {
            throw bad(url, "syntax", e.getReason());
        }
        if (u.getHost() == null) {
            String authority = u.getRawAuthority() == null ? "" : u.getRawAuthority();
            String hostPort = authority.substring(authority.lastIndexOf('@') + 1);
            if (hostPort.contains(":") && !hostPort.startsWith("[")) {
                throw bad(url, "port", "\"" + hostPort.substring(hostPort.lastIndexOf(':') + 1)
                        + "\" is not a port (1-65535)");
            }
            throw bad(url, "host", "missing or invalid");
        }
    }

    /** The parts of {@code [userinfo@]hosts[/db][?query][#fragment]}. */
    private record Parts(String user, String password, List<String[]> hosts, String db, Map<String, String> query,
                         String fragment) {}

    private static RedisUrl sentinel(String url, boolean tls, String rest) {
        Parts p = split(url, rest, 26379);
        if (p.fragment() == null || p.fragment().isEmpty()) {
            throw bad(url, "master_name", "missing: name the monitored primary after '#'");
        }
        if (p.fragment().contains("?")) {
            throw bad(url, "master_name", "\"" + p.fragment() + "\" contains '?': the query goes before '#'");
        }
        TlsOptions options = tlsOptions(url, p.query(), tls);
        String sentinelUser = null;
        String sentinelPassword = null;
        for (Map.Entry<String, String> q : p.query().entrySet()) {
            switch (q.getKey()) {
                case "sentinel_username" -> sentinelUser = q.getValue();
                case "sentinel_password" -> sentinelPassword = q.getValue();
                default -> {
                    if (!TlsOptions.NAMES.contains(q.getKey())) {
                        throw bad(url, "query", "unknown option \"" + q.getKey()
                                + "\" (sentinel_username, sentinel_password, " + tlsNames() + ")");
                    }
                }
            }
        }
        if (sentinelUser != null && sentinelPassword == null) {
            throw bad(url, "query", "sentinel_username needs sentinel_password");
        }
        RedisURI.Builder b = tls(RedisURI.builder().withSentinelMasterId(p.fragment()), tls, options);
        for (String[] h : p.hosts()) {
            // The timeout of the primary lookups: a stalled sentinel must not hold one up for a minute.
            RedisURI.Builder s = tls(RedisURI.Builder.redis(h[0], Integer.parseInt(h[1])), tls, options)
                    .withTimeout(Link.COMMAND_TIMEOUT);
            if (sentinelPassword != null) {
                credentials(s, sentinelUser == null ? "" : sentinelUser, sentinelPassword);
            }
            b.withSentinel(s.build());
        }
        auth(b, p);
        if (p.db() != null) {
            b.withDatabase(database(url, p.db()));
        }
        return new RedisUrl(Kind.SENTINEL, List.of(b.build()), options);
    }

    private static RedisUrl cluster(String url, boolean tls, String rest) {
        Parts p = split(url, rest, 6379);
        if (p.fragment() != null) {
            throw bad(url, "fragment", "a cluster URL names no master (remove '#" + p.fragment() + "')");
        }
        TlsOptions options = tlsOptions(url, p.query(), tls);
        List<String> unknown = p.query().keySet().stream().filter(k -> !TlsOptions.NAMES.contains(k)).toList();
        if (!unknown.isEmpty()) {
            throw bad(url, "query", "a cluster URL takes only TLS options (" + tlsNames() + "), not "
                    + String.join(", ", unknown));
        }
        if (p.db() != null && database(url, p.db()) != 0) {
            throw bad(url, "database", "Redis Cluster has only database 0");
        }
        List<RedisURI> seeds = new ArrayList<>();
        for (String[] h : p.hosts()) {
            // The timeout of the slot map reads too: a stalled node must not hold one up for a minute.
            RedisURI.Builder b = tls(RedisURI.Builder.redis(h[0], Integer.parseInt(h[1])), tls, options)
                    .withTimeout(Link.COMMAND_TIMEOUT);
            auth(b, p);
            seeds.add(b.build());
        }
        return new RedisUrl(Kind.CLUSTER, seeds, options);
    }

    /** TLS (or not) with the verification {@code options} ask for. */
    private static RedisURI.Builder tls(RedisURI.Builder b, boolean tls, TlsOptions options) {
        return tls ? b.withSsl(true).withVerifyPeer(options.verifyMode()) : b.withSsl(false);
    }

    private static String tlsNames() {
        return String.join(", ", new java.util.TreeSet<>(TlsOptions.NAMES));
    }

    private static void auth(RedisURI.Builder b, Parts p) {
        if (p.password() != null) {
            credentials(b, p.user(), p.password());
        }
    }

    /** A password alone (empty user) is sent as {@code AUTH <password>}, which every server version accepts. */
    private static void credentials(RedisURI.Builder b, String user, String password) {
        if (user.isEmpty()) {
            b.withPassword((CharSequence) password);
        } else {
            b.withAuthentication(user, password);
        }
    }

    private static Parts split(String url, String rest, int defaultPort) {
        String fragment = null;
        int hash = rest.indexOf('#');
        if (hash >= 0) {
            fragment = decode(url, "master_name", rest.substring(hash + 1));
            rest = rest.substring(0, hash);
        }
        Map<String, String> query = Map.of();
        int q = rest.indexOf('?');
        if (q >= 0) {
            query = query(url, rest.substring(q + 1));
            rest = rest.substring(0, q);
        }
        String user = null;
        String password = null;
        int at = rest.lastIndexOf('@');
        if (at >= 0) {
            String info = rest.substring(0, at);
            rest = rest.substring(at + 1);
            int colon = info.indexOf(':');
            if (colon < 0) {
                throw bad(url, "userinfo", "must be [user]:password (a password alone is written :password)");
            }
            user = decode(url, "userinfo", info.substring(0, colon));
            password = decode(url, "userinfo", info.substring(colon + 1));
        }
        String db = null;
        int slash = rest.indexOf('/');
        if (slash >= 0) {
            db = rest.substring(slash + 1);
            rest = rest.substring(0, slash);
            if (db.isEmpty()) {
                db = null;
            }
        }
        if (rest.isEmpty()) {
            throw bad(url, "host", "at least one host is required");
        }
        List<String[]> hosts = new ArrayList<>();
        for (String h : rest.split(",", -1)) {
            hosts.add(hostPort(url, h, defaultPort));
        }
        return new Parts(user, password, hosts, db, query, fragment);
    }

    /** The decoded {@code name=value} pairs of a raw query, in order. */
    private static Map<String, String> query(String url, String rawQuery) {
        Map<String, String> query = new LinkedHashMap<>();
        for (String pair : rawQuery.split("&")) {
            if (pair.isEmpty()) {
                continue;
            }
            int eq = pair.indexOf('=');
            if (eq <= 0) {
                throw bad(url, "query", "\"" + pair + "\" is not name=value");
            }
            query.put(decode(url, "query", pair.substring(0, eq)), decode(url, "query", pair.substring(eq + 1)));
        }
        return query;
    }

    private static String[] hostPort(String url, String h, int defaultPort) {
        String host;
        String port = null;
        if (h.startsWith("[")) {
            int end = h.indexOf(']');
            if (end < 0) {
                throw bad(url, "host", "\"" + h + "\": unclosed '['");
            }
            host = h.substring(1, end);
            String after = h.substring(end + 1);
            if (!after.isEmpty()) {
                if (!after.startsWith(":")) {
                    throw bad(url, "host", "\"" + h + "\": expected ':' after ']'");
                }
                port = after.substring(1);
            }
        } else {
            int colon = h.lastIndexOf(':');
            host = colon >= 0 ? h.substring(0, colon) : h;
            port = colon >= 0 ? h.substring(colon + 1) : null;
        }
        if (host.isEmpty()) {
            throw bad(url, "host", "empty host in the host list");
        }
        int p = defaultPort;
        if (port != null) {
            try {
                p = Integer.parseInt(port);
            } catch (NumberFormatException e) {
                p = -1;
            }
            if (p < 1 || p > 65535) {
                throw bad(url, "port", "\"" + port + "\" of host " + host + " is not a port (1-65535)");
            }
        }
        return new String[] {host, String.valueOf(p)};
    }

    private static int database(String url, String db) {
        try {
            int n = Integer.parseInt(db);
            if (n >= 0) {
                return n;
            }
        } catch (NumberFormatException ignored) {
            // reported below
        }
        throw bad(url, "database", "\"" + db + "\" is not a database number (an integer >= 0)");
    }

    private static String decode(String url, String part, String s) {
        try {
            return URLDecoder.decode(s.replace("+", "%2B"), StandardCharsets.UTF_8);
        } catch (IllegalArgumentException e) {
            throw bad(url, part, "bad percent-encoding: " + e.getMessage());
        }
    }

    private static IllegalArgumentException bad(String url, String part, String why) {
        return new IllegalArgumentException("Redis URL " + redact(url) + ": " + part + " " + why);
    }

    /** The URL without its password, fit for an error message. */
    private static String redact(String url) {
        return url.replaceAll("(://[^:@/]*:)[^@/]*@", "$1***@").replaceAll("(sentinel_password=)[^&#]*", "$1***");
    }
}
