package io.kombuenvelope;

import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisException;
import io.lettuce.core.TransactionResult;
import io.lettuce.core.api.StatefulConnection;
import io.lettuce.core.api.StatefulRedisConnection;
import io.lettuce.core.api.sync.RedisCommands;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.SlotHash;
import io.lettuce.core.cluster.api.StatefulRedisClusterConnection;
import io.lettuce.core.cluster.api.sync.RedisClusterCommands;
import io.lettuce.core.cluster.models.partitions.RedisClusterNode;
import io.lettuce.core.pubsub.StatefulRedisPubSubConnection;

import java.time.Duration;
import java.util.function.Consumer;
import java.util.function.Function;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * One connection to the Redis that holds the queues, whatever its topology: a single server
 * (direct or found through Sentinel) or a Redis Cluster. Commands are routed by their first key;
 * a MULTI and the WAIT that follows a write go to the primary of that key's slot, so no step
 * ever crosses a slot (docs/protocol.md section 2).
 */
abstract class Link implements AutoCloseable {
    private static final Logger LOG = LoggerFactory.getLogger(Link.class);
    /** Least time between two reconnections (Sentinel) or reads of the slot map (Cluster) asked for by errors. */
    private static final long REFRESH_EVERY_NS = 300_000_000L;

    /** Replicas to wait for after a write (0: none) and how long. */
    record Durability(int replicas, Duration timeout) {
        static final Durability NONE = new Durability(0, Duration.ZERO);

        Durability {
            if (replicas < 0) {
                throw new IllegalArgumentException("waitReplicas must be >= 0");
            }
            if (timeout == null || timeout.isNegative()) {
                throw new IllegalArgumentException("waitTimeout must be >= 0");
            }
        }
    }

    /**
     * How long one command may take before it is given up and, if safe, retried: a command sent
     * to a primary that died waits no longer than this, then goes to the new one.
     */
    static final Duration COMMAND_TIMEOUT = Duration.ofSeconds(5);

    private final Durability durability;

    private Link(Durability durability) {
        this.durability = durability;
    }

    /** The command timeout: {@link #COMMAND_TIMEOUT}, plus the WAIT timeout when there is one. */
    Duration commandTimeout() {
        return COMMAND_TIMEOUT.plus(durability.timeout());
    }

    /**
     * A link on {@code client}: a {@link RedisClient} (direct or Sentinel) or a {@link RedisClusterClient};
     * a refused TLS handshake fails at once with an error that says so.
     */
    static Link open(AbstractRedisClient client, Durability durability) {
        try {
            if (client instanceof RedisClusterClient) {
                return new Cluster((RedisClusterClient) client, durability);
            }
            if (client instanceof RedisClient) {
                return new Single((RedisClient) client, durability);
            }
        } catch (RuntimeException e) {
            throw Redis.explainTls(e);
        }
        throw new IllegalArgumentException("client must be a RedisClient or a RedisClusterClient, not "
                + (client == null ? "null" : client.getClass().getName()));
    }

    /** Commands routed by their first key (on a single server: that server). */
    abstract RedisClusterCommands<String, byte[]> sync();

    /** The commands of the primary that holds {@code key}'s slot, on a connection of this link. */
    abstract RedisCommands<String, byte[]> primaryOf(String key);

    /** A pub/sub connection (on a Cluster, messages of every node arrive). */
    abstract StatefulRedisPubSubConnection<String, byte[]> pubSub();

    /** The timeout of each command (blocking reads wait longer than the default). */
    abstract void setTimeout(Duration timeout);

    /** Called with an error a step met: lets the link find the new primary after a failover. */
    abstract void recover(Throwable error);

    /** Whether the connection is up now (a command sent while it is down waits for the reconnection). */
    abstract boolean isOpen();

    /**
     * Runs {@code write} on the primary of {@code key}, then {@code WAIT}s for the replicas asked
     * for on the same connection; fewer replicas than asked is logged, the write stands.
     */
    <T> T write(String key, Function<RedisCommands<String, byte[]>, T> write) {
        RedisCommands<String, byte[]> node = primaryOf(key);
        T result = write.apply(node);
        awaitReplicas(node, key);
        return result;
    }

    /**
     * One MULTI/EXEC on the primary of {@code key} (every command in it must touch {@code key}'s
     * slot only), then the WAIT asked for. The link's connection must serve nothing else meanwhile.
     */
    TransactionResult transaction(String key, Consumer<RedisCommands<String, byte[]>> commands) {
        RedisCommands<String, byte[]> node = primaryOf(key);
        StatefulRedisConnection<String, byte[]> c = node.getStatefulConnection();
        synchronized (c) {
            TransactionResult r = Redis.transaction(c, commands);
            awaitReplicas(node, key);
            return r;
        }
    }

    private void awaitReplicas(RedisCommands<String, byte[]> node, String key) {
        if (durability.replicas() == 0) {
            return;
        }
        Long got = node.waitForReplication(durability.replicas(), durability.timeout().toMillis());
        if (got == null || got < durability.replicas()) {
            LOG.warn("WAIT answered {} of {} replicas within {} ms for a write to {}; the write stands",
                    got, durability.replicas(), durability.timeout().toMillis(), key);
        }
    }

    @Override
    public abstract void close();

    /** A single server, direct or found through Sentinel. */
    private static final class Single extends Link {
        private final RedisClient client;
        private volatile StatefulRedisConnection<String, byte[]> conn;
        private volatile Duration timeout;
        private long lastReconnect;

        Single(RedisClient client, Durability durability) {
            super(durability);
            this.client = client;
            this.timeout = commandTimeout();
            this.conn = client.connect(Redis.CODEC);
            conn.setTimeout(timeout);
        }

        @Override
        RedisCommands<String, byte[]> sync() {
            return conn.sync();
        }

        @Override
        RedisCommands<String, byte[]> primaryOf(String key) {
            return conn.sync();
        }

        @Override
        StatefulRedisPubSubConnection<String, byte[]> pubSub() {
            return client.connectPubSub(Redis.CODEC);
        }

        @Override
        void setTimeout(Duration t) {
            timeout = t;
            conn.setTimeout(t);
        }

        /**
         * A server that became a replica (READONLY, a read UNBLOCKED by the role change) keeps its
         * connections, and an old primary back after a failover answers NOREPLICAS on them: open a
         * new one, for which the sentinels are asked again and name the current primary.
         */
        @Override
        synchronized void recover(Throwable error) {
            long now = System.nanoTime();
            if (!Redis.isRoleChange(error) || now - lastReconnect < REFRESH_EVERY_NS) {
                return;
            }
            lastReconnect = now;
            StatefulRedisConnection<String, byte[]> old = conn;
            try {
                StatefulRedisConnection<String, byte[]> fresh = client.connect(Redis.CODEC);
                fresh.setTimeout(timeout);
                conn = fresh;
                LOG.warn("the server is not a usable primary ({}); reconnected to the one the sentinels name",
                        error.getMessage());
            } catch (RedisException e) {
                LOG.warn("reconnecting after a role change failed; retrying: {}", e.toString());
                return;
            }
            closeQuietly(old);
        }

        @Override
        boolean isOpen() {
            return conn.isOpen();
        }

        @Override
        public void close() {
            conn.close();
        }
    }

    /** A Redis Cluster: keys go to the primary of their slot, found again when the slot moves. */
    private static final class Cluster extends Link {
        private final RedisClusterClient client;
        private final StatefulRedisClusterConnection<String, byte[]> conn;
        private volatile long lastRefresh;
        private volatile Duration timeout;

        Cluster(RedisClusterClient client, Durability durability) {
            super(durability);
            this.client = client;
            this.timeout = commandTimeout();
            this.conn = client.connect(Redis.CODEC);
            conn.setTimeout(timeout);
        }

        @Override
        RedisClusterCommands<String, byte[]> sync() {
            return conn.sync();
        }

        @Override
        RedisCommands<String, byte[]> primaryOf(String key) {
            RedisClusterNode node = conn.getPartitions().getMasterBySlot(SlotHash.getSlot(key));
            if (node == null) {
                throw new RedisException("CLUSTERDOWN no primary known for the slot of " + key);
            }
            StatefulRedisConnection<String, byte[]> c = conn.getConnection(node.getNodeId());
            c.setTimeout(timeout);
            return c.sync();
        }

        @Override
        StatefulRedisPubSubConnection<String, byte[]> pubSub() {
            return client.connectPubSub(Redis.CODEC);
        }

        @Override
        void setTimeout(Duration t) {
            timeout = t;
            conn.setTimeout(t);
        }

        /**
         * A slot that moved or a primary that failed: read the slot map again, in the background,
         * so the caller (a read loop, a settle) is not held up by a node that does not answer.
         */
        @Override
        void recover(Throwable error) {
            long now = System.nanoTime();
            if (!Redis.isOutage(error) || now - lastRefresh < REFRESH_EVERY_NS) {
                return;
            }
            lastRefresh = now;
            client.refreshPartitionsAsync().whenComplete((ok, e) -> {
                if (e != null) {
                    LOG.debug("refreshing the cluster's slot map failed: {}", e.toString());
                }
            });
        }

        @Override
        boolean isOpen() {
            return conn.isOpen();
        }

        @Override
        public void close() {
            conn.close();
        }
    }

    private static void closeQuietly(StatefulConnection<?, ?> c) {
        try {
            c.close();
        } catch (RuntimeException ignored) {
            // already broken
        }
    }
}
