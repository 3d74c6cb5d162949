package io.kombuenvelope;

import io.lettuce.core.AbstractRedisClient;
import io.lettuce.core.RedisClient;
import io.lettuce.core.ScriptOutputType;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.api.sync.RedisClusterCommands;
import io.lettuce.core.pubsub.RedisPubSubAdapter;
import io.lettuce.core.pubsub.StatefulRedisPubSubConnection;

import java.time.Duration;
import java.util.List;
import java.util.Objects;
import java.util.Set;
import java.util.TreeSet;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Moves due delayed tasks to their streams (docs/protocol.md section 6): promote.lua for every
 * queue of {@code <prefix>:queues} with Redis' clock, repeated while a call moved a full batch;
 * sleeps until the earliest due time, a message on {@code <prefix>:wakeup}, or the poll interval.
 * Any number may run at once. On a Cluster each promote.lua call touches one queue's slot; a
 * failover or a moved slot is waited out, never fatal.
 */
public final class Promoter implements AutoCloseable {
    private static final Logger LOG = LoggerFactory.getLogger(Promoter.class);

    private final AbstractRedisClient client;
    private final boolean ownsClient;
    private final Link link;
    private final Keys keys;
    private final int batch;
    private final Duration poll;
    private final Object wake = new Object();
    private volatile boolean woken;
    private volatile boolean stopping;
    private StatefulRedisPubSubConnection<String, byte[]> sub;
    private Thread thread;

    private Promoter(Builder b) {
        this.ownsClient = b.client == null;
        this.client = Redis.clientOr(b.client, b.redisUri);
        this.link = Redis.closingOnFailure(client, ownsClient, () -> Link.open(client, Link.Durability.NONE));
        this.keys = new Keys(b.prefix);
        this.batch = b.batch;
        this.poll = b.poll;
    }

    public static Builder builder() {
        return new Builder();
    }

    /** One pass over every queue; answers how many tasks were moved and the earliest due time (-1: none). */
    public long[] promoteOnce() {
        RedisClusterCommands<String, byte[]> redis = link.sync();
        List<byte[]> time = redis.time();
        long now = Long.parseLong(Redis.s(time.get(0))) * 1000 + Long.parseLong(Redis.s(time.get(1))) / 1000;
        Set<String> queues = new TreeSet<>();
        for (byte[] q : redis.smembers(keys.queues())) {
            queues.add(Redis.s(q));
        }
        long moved = 0;
        long nextDue = -1;
        for (String q : queues) {
            while (true) {
                List<Object> r = Scripts.run(redis, "promote", ScriptOutputType.MULTI,
                        List.of(keys.delayed(q), keys.delayedData(q), keys.stream(q, "high"), keys.stream(q, "normal"),
                                keys.stream(q, "low")), now, batch);
                long n = ((Number) r.get(0)).longValue();
                long due = ((Number) r.get(1)).longValue();
                moved += n;
                if (n < batch) {
                    if (due >= 0 && (nextDue < 0 || due < nextDue)) {
                        nextDue = due;
                    }
                    break;
                }
            }
        }
        if (moved > 0) {
            LOG.debug("promoted {} delayed tasks", moved);
        }
        return new long[] {moved, nextDue, now};
    }

    /** Starts promoting on a daemon thread. */
    public synchronized Promoter start() {
        if (thread != null) {
            return this;
        }
        try {
            sub = link.pubSub();
            sub.addListener(new RedisPubSubAdapter<>() {
                @Override
                public void message(String channel, byte[] message) {
                    synchronized (wake) {
                        woken = true;
                        wake.notifyAll();
                    }
                }
            });
            sub.sync().subscribe(keys.wakeup());
        } catch (RuntimeException e) {
            LOG.warn("subscribing to {} failed; polling only: {}", keys.wakeup(), e.toString());
        }
        thread = new Thread(this::loop, "envelope-promoter");
        thread.setDaemon(true);
        thread.start();
        return this;
    }

    private void loop() {
        while (!stopping) {
            long sleep = poll.toMillis();
            try {
                long[] r = promoteOnce();
                if (r[1] >= 0) {
                    sleep = Math.max(1, Math.min(sleep, r[1] - r[2]));
                }
            } catch (RuntimeException e) {
                if (stopping) {
                    return;
                }
                link.recover(e);
                LOG.warn("promoting failed; retrying: {}", e.toString());
            }
            synchronized (wake) {
                if (!woken && !stopping) {
                    try {
                        wake.wait(sleep);
                    } catch (InterruptedException e) {
                        return;
                    }
                }
                woken = false;
            }
        }
    }

    @Override
    public void close() {
        stopping = true;
        synchronized (wake) {
            wake.notifyAll();
        }
        if (thread != null) {
            try {
                thread.join(5000);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
        }
        if (sub != null) {
            sub.close();
        }
        link.close();
        if (ownsClient) {
            Redis.shutdown(client);
        }
    }

    /** Options of a {@link Promoter}. */
    public static final class Builder {
        private String redisUri = "redis://127.0.0.1:6379";
        private AbstractRedisClient client;
        private String prefix = Keys.DEFAULT_PREFIX;
        private int batch = 100;
        private Duration poll = Duration.ofSeconds(2);

        private Builder() {}

        /** A Redis URL, also Sentinel or Cluster (see {@link RedisUrl}); checked at once. */
        public Builder redisUri(String v) { RedisUrl.parse(v); redisUri = v; return this; }
        /** Share a Lettuce client, direct or Sentinel (the promoter then does not shut it down). */
        public Builder client(RedisClient v) { client = v; return this; }
        /** Share a Lettuce Redis Cluster client (the promoter then does not shut it down). */
        public Builder client(RedisClusterClient v) { client = v; return this; }
        /** Share any Lettuce client the SDK supports (the worker's own promoter). */
        Builder client(AbstractRedisClient v) { client = v; return this; }
        public Builder prefix(String v) { prefix = Objects.requireNonNull(v); return this; }
        public Builder batch(int v) { batch = v; return this; }
        /** Longest sleep between passes (2 s by default), so new queues are seen. */
        public Builder pollInterval(Duration v) { poll = Objects.requireNonNull(v); return this; }

        public Promoter build() {
            return new Promoter(this);
        }
    }
}
