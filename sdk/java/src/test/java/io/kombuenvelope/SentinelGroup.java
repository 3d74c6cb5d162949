package io.kombuenvelope;

import java.io.IOException;
import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.function.BooleanSupplier;

/**
 * A Sentinel group from the redis-server binary, on free loopback ports: a primary, two replicas
 * (or as many as asked) and three sentinels (quorum 2, down-after 2 s, failover timeout 3 s). The
 * data nodes and the sentinels ask for passwords of their own; with certificates, every process
 * speaks only TLS, replication and the sentinels' links included.
 */
final class SentinelGroup implements AutoCloseable {
    static final String MASTER = "envmaster";
    static final String DATA_PASSWORD = "data-pw";
    static final String SENTINEL_PASSWORD = "sentinel-pw";

    final List<RedisServer> data = new ArrayList<>();
    final List<RedisServer> sentinels = new ArrayList<>();
    private final Tls tls;

    private SentinelGroup(Tls tls) {
        this.tls = tls;
    }

    /** A primary, two replicas and three sentinels over plain TCP. */
    static SentinelGroup start() throws IOException, InterruptedException {
        return start(null, 2);
    }

    /** A primary, {@code replicas} replicas and three sentinels, all speaking only TLS when {@code tls} is not null. */
    static SentinelGroup start(Tls tls, int replicas) throws IOException, InterruptedException {
        return start(tls, replicas, new String[0]);
    }

    /** A group of two replicas whose first primary also gets {@code primaryArgs} (e.g. {@code --min-replicas-to-write 1}). */
    static SentinelGroup start(String... primaryArgs) throws IOException, InterruptedException {
        return start(null, 2, primaryArgs);
    }

    private static SentinelGroup start(Tls tls, int replicas, String[] primaryArgs) throws IOException, InterruptedException {
        SentinelGroup g = new SentinelGroup(tls);
        try {
            String[] auth = {"--requirepass", DATA_PASSWORD, "--masterauth", DATA_PASSWORD};
            List<String> first = new ArrayList<>(List.of(auth));
            first.addAll(List.of(primaryArgs));
            RedisServer primary = RedisServer.startWith(tls, first.toArray(new String[0]));
            g.data.add(primary);
            for (int i = 0; i < replicas; i++) {
                g.data.add(RedisServer.startWith(tls, auth[0], auth[1], auth[2], auth[3],
                        "--replicaof", "127.0.0.1", String.valueOf(primary.port)));
            }
            for (RedisServer r : g.data.subList(1, g.data.size())) {
                await("replica " + r.port + " in sync", () -> info(r.port, "replication").contains("master_link_status:up"));
            }
            for (int i = 0; i < 3; i++) {
                g.sentinels.add(RedisServer.sentinel(tls, MASTER, primary.port, DATA_PASSWORD, SENTINEL_PASSWORD));
            }
            for (RedisServer s : g.sentinels) {
                await("sentinel " + s.port + " knows the group", () -> {
                    Map<String, String> m = sentinelMaster(s.port);
                    return "2".equals(m.get("num-other-sentinels")) && String.valueOf(replicas).equals(m.get("num-slaves"));
                });
            }
            return g;
        } catch (IOException | InterruptedException | RuntimeException | Error e) {
            g.close();
            throw e;
        }
    }

    /**
     * Two primaries without replicas that the sentinels disagree about: the first sentinel monitors
     * the first primary, the two others the second, each with quorum 1 (they need no peers).
     */
    static SentinelGroup split() throws IOException, InterruptedException {
        SentinelGroup g = new SentinelGroup(null);
        try {
            for (int i = 0; i < 2; i++) {
                g.data.add(RedisServer.startWith("--requirepass", DATA_PASSWORD));
            }
            for (int i = 0; i < 3; i++) {
                g.sentinels.add(RedisServer.sentinel(null, MASTER, g.data.get(i == 0 ? 0 : 1).port, 1, DATA_PASSWORD,
                        SENTINEL_PASSWORD));
            }
            for (RedisServer s : g.sentinels) {
                await("sentinel " + s.port + " sees its primary up", () -> "master".equals(sentinelMaster(s.port).get("flags")));
            }
            return g;
        } catch (IOException | InterruptedException | RuntimeException | Error e) {
            g.close();
            throw e;
        }
    }

    /**
     * {@code redis-sentinel://:<data password>@<the three sentinels>?sentinel_password=...#envmaster};
     * with TLS {@code rediss-sentinel://...&ssl_ca_certs=<the CA>...}.
     */
    String url() {
        return url(sentinels);
    }

    /** {@link #url()} listing only {@code listed}, in that order. */
    String url(List<RedisServer> listed) {
        StringBuilder b = new StringBuilder(tls == null ? "redis-sentinel" : "rediss-sentinel")
                .append("://:").append(DATA_PASSWORD).append("@");
        for (int i = 0; i < listed.size(); i++) {
            b.append(i == 0 ? "" : ",").append("127.0.0.1:").append(listed.get(i).port);
        }
        b.append("?sentinel_password=").append(SENTINEL_PASSWORD);
        if (tls != null) {
            b.append("&").append(tls.caQuery());
        }
        return b.append("#").append(MASTER).toString();
    }

    /** Admin commands to the data node on {@code port}. */
    static Resp node(int port) {
        return Resp.at(port, DATA_PASSWORD);
    }

    /** The port of the primary the sentinels name now. */
    int primaryPort() {
        for (RedisServer s : sentinels) {
            try {
                if (Resp.at(s.port, SENTINEL_PASSWORD).call("SENTINEL", "get-master-addr-by-name", MASTER) instanceof List<?> a) {
                    return Integer.parseInt(String.valueOf(a.get(1)));
                }
            } catch (IOException | RuntimeException e) {
                // this sentinel is not answering: ask the next
            }
        }
        throw new IllegalStateException("no sentinel answers");
    }

    RedisServer server(int port) {
        return data.stream().filter(s -> s.port == port).findFirst().orElseThrow();
    }

    /** Waits until the sentinels name a primary other than {@code oldPort} and it answers as one. */
    void awaitFailover(int oldPort) throws InterruptedException {
        await("a failover away from " + oldPort, () -> {
            int p = primaryPort();
            return p != oldPort && info(p, "replication").contains("role:master");
        });
    }

    static Map<String, String> sentinelMaster(int port) {
        return Resp.at(port, SENTINEL_PASSWORD).pairs("SENTINEL", "MASTER", MASTER);
    }

    /** {@code INFO <section>} of the server on {@code port}, or "" when it does not answer. */
    static String info(int port, String section) {
        return node(port).text("INFO", section);
    }

    /** Waits up to 20 s for {@code cond}, failing with {@code what}. */
    static void await(String what, BooleanSupplier cond) throws InterruptedException {
        await(what, Duration.ofSeconds(20), cond);
    }

    /** Waits up to {@code timeout} for {@code cond}, failing with {@code what}. */
    static void await(String what, Duration timeout, BooleanSupplier cond) throws InterruptedException {
        long deadline = System.nanoTime() + timeout.toNanos();
        while (!cond.getAsBoolean()) {
            if (System.nanoTime() > deadline) {
                throw new AssertionError("timed out waiting for " + what);
            }
            Thread.sleep(50);
        }
    }

    @Override
    public void close() {
        sentinels.forEach(RedisServer::stop);
        data.forEach(RedisServer::stop);
    }
}
