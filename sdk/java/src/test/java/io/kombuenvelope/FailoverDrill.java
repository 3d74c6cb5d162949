package io.kombuenvelope;

import io.lettuce.core.RedisClient;
import io.lettuce.core.api.StatefulRedisConnection;
import io.lettuce.core.api.sync.RedisCommands;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicBoolean;
import java.util.concurrent.atomic.AtomicInteger;

/**
 * Publishers of idempotent tasks (immediate and delayed) whose handler records its effect in a
 * separate private redis-server, the ledger, so that what a failover lost or ran twice can be
 * counted afterwards.
 */
final class FailoverDrill implements AutoCloseable {
    static final String TASK_TYPE = "drill.effect";

    private final RedisServer ledger = RedisServer.startPrivate(0);
    private final RedisClient ledgerClient = Redis.client(ledger.uri());
    private final StatefulRedisConnection<String, byte[]> ledgerConn = ledgerClient.connect(Redis.CODEC);
    private final AtomicBoolean publishing = new AtomicBoolean(true);
    private final List<Thread> publishers = new ArrayList<>();
    /** Task ids whose publish returned success, per publisher label. */
    private final Map<String, List<String>> acknowledged = new ConcurrentHashMap<>();
    private final AtomicInteger failedPublishes = new AtomicInteger();

    FailoverDrill() throws Exception {}

    /** The handler: counts one effect of its task in the ledger. */
    TaskHandler handler() {
        return task -> {
            synchronized (ledgerConn) {
                ledgerConn.sync().incr("effect:" + task.taskId());
            }
        };
    }

    /** Publishes to {@code queues} in turn from a thread of its own, every third task delayed, until {@link #stopPublishing()}. */
    void publish(String label, Producer producer, List<String> queues) {
        List<String> ok = java.util.Collections.synchronizedList(new ArrayList<>());
        acknowledged.put(label, ok);
        Thread t = new Thread(() -> {
            for (int i = 0; publishing.get(); i++) {
                String id = label + "-" + i;
                Envelope e = Envelope.builder(TASK_TYPE).taskId(id).idempotencyKey(id).put("n", i).build();
                try {
                    String q = queues.get(i % queues.size());
                    if (i % 3 == 2) {
                        producer.publishIn(q, e, Duration.ofMillis(400));
                    } else {
                        producer.publish(q, e);
                    }
                    ok.add(id);
                } catch (RuntimeException ex) {
                    failedPublishes.incrementAndGet();
                }
                try {
                    Thread.sleep(15);
                } catch (InterruptedException ex) {
                    return;
                }
            }
        }, "drill-publisher-" + label);
        t.start();
        publishers.add(t);
    }

    void stopPublishing() throws InterruptedException {
        publishing.set(false);
        for (Thread t : publishers) {
            t.join(TimeUnit.SECONDS.toMillis(40));
        }
    }

    int published(String label) {
        return acknowledged.get(label).size();
    }

    int failedPublishes() {
        return failedPublishes.get();
    }

    /** Acknowledged publishes of {@code label} without any effect. */
    int lost(String label) {
        int lost = 0;
        for (String id : acknowledged.get(label)) {
            if (effects(id) == 0) {
                lost++;
            }
        }
        return lost;
    }

    /** Tasks of any label whose effect happened more than once. */
    int duplicated() {
        int n = 0;
        for (List<String> ids : acknowledged.values()) {
            for (String id : ids) {
                if (effects(id) > 1) {
                    n++;
                }
            }
        }
        return n;
    }

    /** Waits (at most {@code max}) until every acknowledged publish of {@code label} had its effect. */
    void awaitEffects(String label, Duration max) throws InterruptedException {
        long deadline = System.nanoTime() + max.toNanos();
        while (lost(label) > 0 && System.nanoTime() < deadline) {
            Thread.sleep(200);
        }
    }

    private long effects(String id) {
        synchronized (ledgerConn) {
            RedisCommands<String, byte[]> r = ledgerConn.sync();
            byte[] v = r.get("effect:" + id);
            return v == null ? 0 : Long.parseLong(Redis.s(v));
        }
    }

    @Override
    public void close() throws InterruptedException {
        publishing.set(false);
        stopPublishing();
        ledgerConn.close();
        ledgerClient.shutdown();
        ledger.stop();
    }
}
