package io.kombuenvelope;

import java.io.IOException;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;

/**
 * A Redis Cluster from the redis-server binary, on free loopback ports: three primaries with one
 * replica each (or as many as asked; {@code redis-cli --cluster create ... --cluster-replicas 1}),
 * node timeout 1 s, every replica in sync before it is used and free to take over however long it
 * was cut off from its primary; with certificates, every node speaks only TLS, the cluster bus included.
 */
final class ClusterGroup implements AutoCloseable {
    final List<RedisServer> nodes = new ArrayList<>();
    private final Tls tls;

    private ClusterGroup(Tls tls) {
        this.tls = tls;
    }

    /** Three primaries with one replica each, over plain TCP. */
    static ClusterGroup start() throws IOException, InterruptedException {
        return start(null, 1);
    }

    /** Three primaries with {@code replicas} replicas each, all speaking only TLS when {@code tls} is not null. */
    static ClusterGroup start(Tls tls, int replicas) throws IOException, InterruptedException {
        ClusterGroup g = new ClusterGroup(tls);
        try {
            List<String> args = new ArrayList<>(List.of("--cluster-enabled", "yes", "--cluster-config-file",
                    "nodes.conf", "--cluster-node-timeout", "1000", "--cluster-replica-validity-factor", "0"));
            if (tls != null) {
                args.addAll(List.of("--tls-cluster", "yes"));
            }
            for (int i = 0; i < 3 * (1 + replicas); i++) {
                g.nodes.add(RedisServer.startWith(tls, args.toArray(new String[0])));
            }
            List<String> cmd = new ArrayList<>(List.of(System.getProperty("kombuenvelope.redis.cli", "redis-cli")));
            if (tls != null) {
                cmd.addAll(List.of("--tls", "--cacert", tls.ca.toString()));
            }
            cmd.addAll(List.of("--cluster", "create"));
            g.nodes.forEach(n -> cmd.add("127.0.0.1:" + n.port));
            cmd.addAll(List.of("--cluster-replicas", String.valueOf(replicas), "--cluster-yes"));
            // Its output goes to a file: a cluster that never joins makes it wait forever, and it is stopped.
            java.nio.file.Path log = g.nodes.get(0).dir().resolve("cluster-create.log");
            Process p = new ProcessBuilder(cmd).redirectErrorStream(true).redirectOutput(log.toFile()).start();
            boolean done = p.waitFor(30, TimeUnit.SECONDS);
            if (!done) {
                p.destroyForcibly();
            }
            if (!done || p.exitValue() != 0) {
                throw new IOException("redis-cli --cluster create failed: " + java.nio.file.Files.readString(log));
            }
            for (RedisServer n : g.nodes) {
                SentinelGroup.await("cluster_state:ok on " + n.port,
                        () -> Resp.at(n.port).text("CLUSTER", "INFO").contains("cluster_state:ok"));
            }
            g.awaitReplicasInSync(3 * replicas);
            return g;
        } catch (IOException | InterruptedException | RuntimeException | Error e) {
            g.close();
            throw e;
        }
    }

    /**
     * Waits until {@code count} nodes are replicas whose first sync with their primary is done: a
     * replica that never synced refuses to fail over ("Disconnected from master for longer than
     * allowed"), so a primary killed before that leaves its slots unserved for good.
     */
    private void awaitReplicasInSync(int count) throws InterruptedException {
        SentinelGroup.await(count + " replicas in sync with their primaries", () -> nodes.stream()
                .map(n -> Resp.at(n.port).text("INFO", "replication"))
                .filter(info -> info.contains("role:slave") && info.contains("master_link_status:up"))
                .count() == count);
    }

    /** {@code redis-cluster://...} naming the first three nodes as seeds ({@code rediss-cluster://...?ssl_ca_certs=...}: TLS). */
    String url() {
        return (tls == null ? "redis-cluster" : "rediss-cluster") + "://127.0.0.1:" + nodes.get(0).port
                + ",127.0.0.1:" + nodes.get(1).port + ",127.0.0.1:" + nodes.get(2).port
                + (tls == null ? "" : "?" + tls.caQuery());
    }

    /** The slot of {@code key}, as the cluster computes it ({@code CLUSTER KEYSLOT}). */
    int slot(String key) throws IOException {
        for (RedisServer n : nodes) {
            try {
                return ((Long) Resp.at(n.port).call("CLUSTER", "KEYSLOT", key)).intValue();
            } catch (IOException e) {
                // a node that is down: ask the next
            }
        }
        throw new IOException("no node answers");
    }

    /** The port of the primary serving {@code slot}, from the {@code CLUSTER NODES} of a live node that is ok; -1: none. */
    int primaryOf(int slot) {
        for (RedisServer n : nodes) {
            if (!Resp.at(n.port).text("CLUSTER", "INFO").contains("cluster_state:ok")) {
                continue;
            }
            for (String line : Resp.at(n.port).text("CLUSTER", "NODES").split("\n")) {
                String[] f = line.trim().split(" ");
                if (f.length < 9 || !f[2].contains("master") || f[2].contains("fail")) {
                    continue;
                }
                for (int i = 8; i < f.length; i++) {
                    String[] range = f[i].split("-");
                    if (range[0].startsWith("[")) {
                        continue;
                    }
                    int lo = Integer.parseInt(range[0]);
                    int hi = range.length > 1 ? Integer.parseInt(range[1]) : lo;
                    if (slot >= lo && slot <= hi) {
                        return Integer.parseInt(f[1].substring(f[1].indexOf(':') + 1, f[1].indexOf('@')));
                    }
                }
            }
        }
        return -1;
    }

    /** The ports of the primaries that are up and serve slots. */
    List<Integer> primaries() {
        List<Integer> out = new ArrayList<>();
        for (RedisServer n : nodes) {
            String info = Resp.at(n.port).text("INFO", "replication");
            if (info.contains("role:master") && !Resp.at(n.port).text("CLUSTER", "NODES").lines()
                    .filter(l -> l.contains("myself")).findFirst().orElse("").trim().endsWith("-")) {
                out.add(n.port);
            }
        }
        return out;
    }

    /**
     * Moves {@code slot} from its primary to the primary on {@code toPort} as resharding does:
     * IMPORTING / MIGRATING, MIGRATE of its keys, then {@code between} runs (clients meet ASK and
     * TRYAGAIN there), then CLUSTER SETSLOT ... NODE on every primary.
     */
    void moveSlot(int slot, int toPort, Runnable between) throws IOException {
        int fromPort = primaryOf(slot);
        String from = (String) Resp.at(fromPort).call("CLUSTER", "MYID");
        String to = (String) Resp.at(toPort).call("CLUSTER", "MYID");
        String s = String.valueOf(slot);
        Resp.at(toPort).call("CLUSTER", "SETSLOT", s, "IMPORTING", from);
        Resp.at(fromPort).call("CLUSTER", "SETSLOT", s, "MIGRATING", to);
        while (true) {
            List<?> keys = (List<?>) Resp.at(fromPort).call("CLUSTER", "GETKEYSINSLOT", s, "100");
            if (keys.isEmpty()) {
                break;
            }
            List<String> cmd = new ArrayList<>(List.of("MIGRATE", "127.0.0.1", String.valueOf(toPort), "", "0", "5000",
                    "KEYS"));
            keys.forEach(k -> cmd.add(String.valueOf(k)));
            Resp.at(fromPort).call(cmd.toArray(new String[0]));
        }
        between.run();
        Resp.at(toPort).call("CLUSTER", "SETSLOT", s, "NODE", to);
        Resp.at(fromPort).call("CLUSTER", "SETSLOT", s, "NODE", to);
        for (int p : primaries()) {
            Resp.at(p).call("CLUSTER", "SETSLOT", s, "NODE", to);
        }
    }

    /**
     * Whether replicas may take over a failed primary ({@code cluster-replica-no-failover} on every
     * node that answers): held, a dead primary's slots stay unserved until released.
     */
    void holdFailovers(boolean hold) {
        for (RedisServer n : nodes) {
            try {
                Resp.at(n.port).call("CONFIG", "SET", "cluster-replica-no-failover", hold ? "yes" : "no");
            } catch (IOException e) {
                // a node that is down
            }
        }
    }

    RedisServer server(int port) {
        return nodes.stream().filter(s -> s.port == port).findFirst().orElseThrow();
    }

    /** Waits until a live node other than {@code oldPort} serves {@code slot} and every live node is ok. */
    void awaitFailover(int slot, int oldPort) throws InterruptedException {
        SentinelGroup.await("a failover of slot " + slot + " away from " + oldPort, () -> {
            int p = primaryOf(slot);
            return p > 0 && p != oldPort && nodes.stream().filter(n -> n.port != oldPort)
                    .allMatch(n -> Resp.at(n.port).text("CLUSTER", "INFO").contains("cluster_state:ok"));
        });
    }

    @Override
    public void close() {
        nodes.forEach(RedisServer::stop);
    }
}
