package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.TreeMap;

import org.junit.jupiter.api.Test;

/** Worker statistics (docs/protocol.md section 17) and heartbeat_ms in the announcement (section 15). */
class WorkerStatsTest extends RedisFixture {
    /** The stats hash of {@code queue} as text. */
    Map<String, Long> hash(String queue) {
        Map<String, Long> out = new TreeMap<>();
        redis.hgetall(keys.stats(queue)).forEach((k, v) -> out.put(k, Long.parseLong(Redis.s(v))));
        return out;
    }

    /** The fields of {@code h} whose name starts with {@code start}, summed. */
    static long sum(Map<String, Long> h, String start) {
        return h.entrySet().stream().filter(e -> e.getKey().startsWith(start)).mapToLong(Map.Entry::getValue).sum();
    }

    @Test
    void aKnownWorkloadGivesExactlyTheseCounters() throws Exception {
        String q = "billing";
        Worker w = Worker.builder().client(client).prefix(prefix).queue(q).consumer("stats-1").concurrency(2)
                .block(Duration.ofMillis(200)).lease(Duration.ofMillis(1500)).runPromoter(false)
                .shutdownTimeout(Duration.ofSeconds(5))
                .handler("ok", t -> { })
                .handler("flaky", t -> {
                    if (t.retryCount() == 0) {
                        throw t.retry("not yet", Duration.ZERO);
                    }
                })
                .handler("bad", t -> {
                    throw new TaskFailure.Rejected("never");
                })
                .handler("idem", t -> { })
                .build().start();
        try (Producer p = Producer.builder().client(client).prefix(prefix).queue(q).build()) {
            p.publish(Envelope.builder("ok").build());
            p.publish(Envelope.builder("ok").build());
            p.publish(Envelope.builder("flaky").build());
            p.publish(Envelope.builder("bad").build());
            p.publish(Envelope.builder("nobody").build());
            String first = p.publish(Envelope.builder("idem").idempotencyKey("k1").build()).taskId();
            long until = System.nanoTime() + Duration.ofSeconds(10).toNanos();
            while (!"succeeded".equals(p.getTask(q, first).state()) && System.nanoTime() < until) {
                Thread.sleep(20);
            }
            p.publish(Envelope.builder("idem").idempotencyKey("k1").build());
            Map<String, byte[]> junk = new LinkedHashMap<>();
            junk.put("v", "1".getBytes());
            junk.put("enc", "json".getBytes());
            junk.put("body", "{not json".getBytes());
            redis.xadd(keys.stream(q, "normal"), junk);

            // Written with the renewals (every 500 ms): wait for the last outcomes to be there.
            while (System.nanoTime() < until && (hash(q).getOrDefault("idem java duplicate", 0L) != 1
                    || hash(q).getOrDefault("- java dead", 0L) != 1 || hash(q).getOrDefault("ok java succeeded", 0L) != 2
                    || hash(q).getOrDefault("flaky java succeeded", 0L) != 1)) {
                Thread.sleep(50);
            }
        } finally {
            w.close();
        }
        Map<String, Long> h = hash(q);
        Map<String, Long> outcomes = new TreeMap<>();
        Map<String, Long> runs = new HashMap<>();
        Map<String, Long> waits = new HashMap<>();
        h.forEach((field, n) -> {
            String[] parts = field.split(" ");
            assertEquals(3, parts.length, "field " + field);
            assertEquals("java", parts[1], "field " + field);
            String name = parts[2];
            if (name.startsWith("run_le_")) {
                assertTrue(WorkerStats.BOUNDS.contains(name.substring(7)), "bucket " + field);
                runs.merge(parts[0], n, Long::sum);
            } else if (name.startsWith("wait_le_")) {
                assertTrue(WorkerStats.BOUNDS.contains(name.substring(8)), "bucket " + field);
                waits.merge(parts[0], n, Long::sum);
            } else if (name.endsWith("_sum_us")) {
                assertTrue(n >= 0 && n < 10_000_000, field + " = " + n);
            } else {
                outcomes.put(field, n);
            }
        });
        assertEquals(new TreeMap<>(Map.of(
                "ok java succeeded", 2L,
                "flaky java failed", 1L, "flaky java retried", 1L, "flaky java succeeded", 1L,
                "bad java failed", 1L, "bad java dead", 1L,
                "nobody java dead", 1L,
                "idem java succeeded", 1L, "idem java duplicate", 1L,
                "- java dead", 1L)), outcomes);
        Map<String, Long> attempts = Map.of("ok", 2L, "flaky", 2L, "bad", 1L, "idem", 1L);
        assertEquals(attempts, runs, "run buckets count every attempt that ran");
        assertEquals(attempts, waits, "wait buckets count every attempt that ran");
        for (String type : attempts.keySet()) {
            assertTrue(h.containsKey(type + " java run_sum_us") && h.containsKey(type + " java wait_sum_us"), type);
        }
        long ttl = redis.pttl(keys.stats(q));
        assertTrue(ttl > 2_592_000_000L - 60_000 && ttl <= 2_592_000_000L, "kept 30 days: " + ttl);
    }

    @Test
    void observationsGoToTheFirstBucketAtLeastAsLargeWithTheirSumInMicroseconds() {
        WorkerStats s = new WorkerStats(keys, "java");
        s.ran("q", "t", 5_000_000);          // exactly 0.005 s
        s.ran("q", "t", 5_000_001);          // just above: 0.01
        s.ran("q", "t", 4_000_000_000_000L); // 4000 s: inf
        s.waited("q", "t", -3_000_000);      // negative: 0
        s.count("q", "t", WorkerStats.Outcome.DUPLICATE);
        assertEquals(Map.of("q", Map.of(
                "t java run_le_0.005", 1L, "t java run_le_0.01", 1L, "t java run_le_inf", 1L,
                "t java run_sum_us", 5_000L + 5_000L + 4_000_000_000L,
                "t java wait_le_0.005", 1L, "t java wait_sum_us", 0L,
                "t java duplicate", 1L)), s.pending());
    }

    @Test
    void aFailedWriteKeepsItsCountsForTheNextOne() {
        WorkerStats s = new WorkerStats(keys, "java");
        s.count("q", "t", WorkerStats.Outcome.SUCCEEDED);
        redis.set(keys.stats("q"), Redis.b("not a hash")); // HINCRBY fails: WRONGTYPE
        Link link = Link.open(client, Link.Durability.NONE);
        try {
            s.flush(link);
            assertEquals(Map.of("q", Map.of("t java succeeded", 1L)), s.pending(), "kept after a failed write");
            s.count("q", "t", WorkerStats.Outcome.SUCCEEDED);
            redis.del(keys.stats("q"));
            s.flush(link);
            assertEquals(Map.of(), s.pending(), "taken off once written");
            assertEquals(Map.of("t java succeeded", 2L), hash("q"));
        } finally {
            link.close();
        }
    }
}
