package io.kombuenvelope;

import java.io.IOException;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import java.util.function.BooleanSupplier;

/**
 * A Sentinel group from the redis-server binary, on free loopback ports: a primary, two replicas
 * and three sentinels (quorum 2, down-after 1 s, failover timeout 3 s).
 */
final class SentinelGroup implements AutoCloseable {
    static final String MASTER = "envmaster";

    final List<RedisServer> data = new ArrayList<>();
    final List<RedisServer> sentinels = new ArrayList<>();

    private SentinelGroup() {}

    static SentinelGroup start() throws IOException, InterruptedException {
        SentinelGroup g = new SentinelGroup();
        try {
            RedisServer primary = RedisServer.startWith();
            g.data.add(primary);
            for (int i = 0; i < 2; i++) {
                g.data.add(RedisServer.startWith("--replicaof", "127.0.0.1", String.valueOf(primary.port)));
            }
            for (RedisServer r : g.data.subList(1, 3)) {
                await("replica " + r.port + " in sync", () -> info(r.port, "replication").contains("master_link_status:up"));
            }
            for (int i = 0; i < 3; i++) {
                g.sentinels.add(RedisServer.sentinel(MASTER, primary.port));
            }
            for (RedisServer s : g.sentinels) {
                await("sentinel " + s.port + " knows the group", () -> {
                    Map<String, String> m = sentinelMaster(s.port);
                    return "2".equals(m.get("num-other-sentinels")) && "2".equals(m.get("num-slaves"));
                });
            }
            return g;
        } catch (IOException | InterruptedException | RuntimeException | Error e) {
            g.close();
            throw e;
        }
    }

    /** {@code redis-sentinel://...#envmaster} naming the three sentinels. */
    String url() {
        StringBuilder b = new StringBuilder("redis-sentinel://");
        for (int i = 0; i < sentinels.size(); i++) {
            b.append(i == 0 ? "" : ",").append("127.0.0.1:").append(sentinels.get(i).port);
        }
        return b.append("#").append(MASTER).toString();
    }

    /** The port of the primary the sentinels name now. */
    int primaryPort() {
        for (RedisServer s : sentinels) {
            try {
                if (Resp.call(s.port, "SENTINEL", "get-master-addr-by-name", MASTER) instanceof List<?> a) {
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
        return Resp.pairs(port, "SENTINEL", "MASTER", MASTER);
    }

    /** {@code INFO <section>} of the server on {@code port}, or "" when it does not answer. */
    static String info(int port, String section) {
        return Resp.text(port, "INFO", section);
    }

    static void await(String what, BooleanSupplier cond) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(20);
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
