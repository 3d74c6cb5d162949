package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.Range;
import io.lettuce.core.StreamMessage;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.stream.Stream;

import org.junit.jupiter.api.Test;

/**
 * Ordering keys (docs/protocol.md section 20) with two workers on one queue, against a real
 * redis-server. The handler records {@code start}, {@code fail} and {@code end} of each attempt
 * in one Redis list, so the order Redis took them in is the order they happened.
 */
class OrderingTest extends RedisFixture {
    static final String QUEUE = "ordered";
    static final String STEP = "ordering.step";
    static final String HALTS = "ordering.halts";

    /** The list of events {@code "<what> <ordering_key> <task_id>"}. */
    String events() {
        return prefix + ":events";
    }

    /**
     * Records its start, sleeps {@code payload.sleep_ms}, fails while its retry_count is below
     * {@code payload.fail_times} (then retried or dead-lettered as its Envelope says), records its end.
     */
    TaskHandler recording() {
        return task -> {
            String who = task.envelope().orderingKey() + " " + task.taskId();
            redis.rpush(events(), Redis.b("start " + who));
            Thread.sleep(task.get("sleep_ms").asLong(0));
            if (task.retryCount() < task.get("fail_times").asLong(0)) {
                redis.rpush(events(), Redis.b("fail " + who));
                throw new IllegalStateException("asked to fail");
            }
            redis.rpush(events(), Redis.b("end " + who));
        };
    }

    Worker.Builder worker() {
        return Worker.builder().client(client).prefix(prefix).queue(QUEUE).concurrency(2)
                .block(Duration.ofMillis(200)).shutdownTimeout(Duration.ofSeconds(5))
                .retryPolicy(new RetryPolicy(0, Duration.ofMillis(300), Duration.ofSeconds(1)))
                .handler(STEP, recording()).handler(HALTS, recording());
    }

    Producer producer() {
        return Producer.builder().client(client).prefix(prefix).queue(QUEUE).build();
    }

    static Envelope.Builder keyed(String taskType, String key, long sleepMs) {
        return Envelope.builder(taskType).orderingKey(key).put("sleep_ms", sleepMs);
    }

    List<String> allEvents() {
        return redis.lrange(events(), 0, -1).stream().map(RoundTripTest::s).toList();
    }

    /** The events of {@code key}, {@code "<what> <task_id>"}. */
    List<String> eventsOf(String key) {
        return allEvents().stream().filter(e -> e.split(" ")[1].equals(key))
                .map(e -> e.split(" ")[0] + " " + e.split(" ")[2]).toList();
    }

    /** The events of tasks that each ran once, one after the other, in this order. */
    static List<String> oneAfterAnother(Envelope... tasks) {
        return Stream.of(tasks).flatMap(t -> Stream.of("start " + t.taskId(), "end " + t.taskId())).toList();
    }

    long ended() {
        return allEvents().stream().filter(e -> e.startsWith("end ")).count();
    }

    /** The most attempts running at once, from the events. */
    int mostAtOnce() {
        int running = 0;
        int most = 0;
        for (String e : allEvents()) {
            running += e.startsWith("start ") ? 1 : -1;
            most = Math.max(most, running);
        }
        return most;
    }

    static void await(String what, java.util.function.BooleanSupplier cond) throws InterruptedException {
        RoundTripTest.await(what, cond);
    }

    @Test
    void tasksOfOneKeyRunOneAtATimeInPublishOrderWhileAnotherKeyRunsBeside() throws Exception {
        List<Envelope> a = new ArrayList<>();
        List<Envelope> b = new ArrayList<>();
        try (Producer p = producer()) {
            for (int i = 0; i < 5; i++) {
                a.add(keyed(STEP, "A", 100).build());
                b.add(keyed(STEP, "B", 100).build());
                PublishResult ra = p.publish(a.get(i));
                PublishResult rb = p.publish(b.get(i));
                assertEquals(i > 0, ra.waiting(), "publish " + i + " of A answered " + ra.entryId());
                assertEquals(i > 0, rb.waiting(), "publish " + i + " of B answered " + rb.entryId());
            }
            assertTrue(redis.sismember(keys.queues(), Redis.b(QUEUE)), "a keyed publish lists its queue for the promoters");
            assertEquals(2, Stream.of("high", "normal", "low").mapToLong(s -> redis.xlen(keys.stream(QUEUE, s))).sum(),
                    "only the heads went to a stream");
            try (Worker w1 = worker().build().start(); Worker w2 = worker().build().start()) {
                await("10 runs", () -> ended() == 10);
            }
        }
        assertEquals(oneAfterAnother(a.toArray(new Envelope[0])), eventsOf("A"));
        assertEquals(oneAfterAnother(b.toArray(new Envelope[0])), eventsOf("B"));
        assertEquals(2, mostAtOnce(), "the two keys did not run beside each other: " + allEvents());
        assertEquals(0, redis.exists(keys.order(QUEUE, "A"), keys.orderWaiting(QUEUE, "A"),
                keys.order(QUEUE, "B"), keys.orderWaiting(QUEUE, "B")), "a key's order outlived its tasks");
    }

    @Test
    void aRetriedHeadKeepsItsPlace() throws Exception {
        Envelope first = keyed(STEP, "R", 0).put("fail_times", 1).tieredRetries().build();
        Envelope second = keyed(STEP, "R", 0).build();
        try (Producer p = producer(); Worker w1 = worker().build().start(); Worker w2 = worker().build().start()) {
            p.publish(first);
            p.publish(second);
            await("both tasks", () -> ended() == 2);
        }
        assertEquals(List.of("start " + first.taskId(), "fail " + first.taskId(), "start " + first.taskId(),
                "end " + first.taskId(), "start " + second.taskId(), "end " + second.taskId()), eventsOf("R"));
    }

    @Test
    void aDeadLetteredHeadMovesItsKeyOnUnlessItsPolicyHaltsIt() throws Exception {
        redis.hset(keys.orderPolicy(QUEUE), HALTS, Redis.b("halt"));
        Envelope dies = keyed(STEP, "D", 0).put("fail_times", 1).build();
        Envelope afterDies = keyed(STEP, "D", 0).build();
        Envelope halts = keyed(HALTS, "H", 0).put("fail_times", 1).build();
        Envelope afterHalts = keyed(STEP, "H", 0).build();
        try (Producer p = producer(); DeadLetters dl = DeadLetters.builder().client(client).prefix(prefix).build();
             Worker w1 = worker().build().start(); Worker w2 = worker().build().start()) {
            for (Envelope e : List.of(dies, afterDies, halts, afterHalts)) {
                p.publish(e);
            }
            await("the task after the dead-lettered head", () -> ended() == 1);
            await("both dead letters", () -> dl.count(QUEUE) == 2);
            Thread.sleep(300);
            assertEquals(List.of("start " + dies.taskId(), "fail " + dies.taskId(), "start " + afterDies.taskId(),
                    "end " + afterDies.taskId()), eventsOf("D"));
            assertEquals(List.of("start " + halts.taskId(), "fail " + halts.taskId()), eventsOf("H"),
                    "the task after a halted head ran");
            assertEquals(halts.taskId(), RoundTripTest.s(redis.hget(keys.orderHalted(QUEUE), "H")));
            assertTrue(redis.hexists(keys.orderWaiting(QUEUE, "H"), afterHalts.taskId()));

            DeadLetter head = dl.list(QUEUE, 10).stream().filter(d -> d.taskId().equals(halts.taskId())).findFirst()
                    .orElseThrow();
            redis.del(keys.queues()); // a lost registry (section 2): the keyed replay lists its queue again
            String replayed = dl.replay(QUEUE, head.entryId(), r -> r.put("fail_times", 0), "test");
            assertNotEquals(PublishResult.WAITING, replayed, "the replayed head of a halted key waits");
            await("the task after the replayed head", () -> ended() == 3);
        }
        assertEquals(List.of("start " + halts.taskId(), "fail " + halts.taskId(), "start " + halts.taskId(),
                "end " + halts.taskId(), "start " + afterHalts.taskId(), "end " + afterHalts.taskId()), eventsOf("H"));
        assertFalse(redis.hexists(keys.orderHalted(QUEUE), "H"), "the replay left the halt");
    }

    @Test
    void aDelayedKeyedTaskJoinsItsKeyWhenDueAfterTheTasksAlreadyThere() throws Exception {
        Envelope k1 = keyed(STEP, "L", 150).build();
        Envelope later = keyed(STEP, "L", 0).build();
        Envelope k2 = keyed(STEP, "L", 150).build();
        Envelope k3 = keyed(STEP, "L", 150).build();
        Envelope k4 = keyed(STEP, "L", 0).build();
        try (Producer p = producer(); Worker w1 = worker().build().start(); Worker w2 = worker().build().start()) {
            p.publish(k1);
            assertTrue(p.publishIn(later, Duration.ofMillis(300)).delayed());
            p.publish(k2);
            p.publish(k3);
            await("the delayed task to be due", () -> redis.zcard(keys.delayed(QUEUE)) == 0);
            p.publish(k4);
            await("5 runs", () -> ended() == 5);
        }
        assertEquals(oneAfterAnother(k1, k2, k3, later, k4), eventsOf("L"));
    }

    @Test
    void waitingTasksCancelledOrExpiredByTheirTurnAreSkippedAndTheirKeyMovesOn() throws Exception {
        Envelope first = keyed(STEP, "S", 200).build();
        Envelope expires = keyed(STEP, "S", 0).expiresIn(Duration.ofMillis(100)).build();
        Envelope cancelled = keyed(STEP, "S", 0).build();
        Envelope last = keyed(STEP, "S", 0).build();
        try (Producer p = producer(); Worker w1 = worker().build().start(); Worker w2 = worker().build().start()) {
            for (Envelope e : List.of(first, expires, cancelled, last)) {
                p.publish(e);
            }
            assertEquals("marked", p.cancel(cancelled.taskId()));
            await("the last task", () -> ended() == 2);
        }
        assertEquals(oneAfterAnother(first, last), eventsOf("S"));
        assertEquals(0, redis.exists(keys.order(QUEUE, "S"), keys.orderWaiting(QUEUE, "S")));
    }

    @Test
    void aBigKeyedEnvelopeIsWrittenPlainSoTheScriptsSeeItsKey() {
        String blob = "x".repeat(EntryCodec.GZIP_MIN_BYTES);
        Envelope head = keyed(STEP, "G", 0).put("blob", blob).build();
        Envelope next = keyed(STEP, "G", 0).put("blob", blob).build();
        try (Producer p = producer()) {
            assertFalse(p.publish(head).waiting());
            assertEquals(PublishResult.WAITING, p.publish(next).entryId());
        }
        List<StreamMessage<String, byte[]>> entries = redis.xrange(keys.stream(QUEUE, "normal"), Range.create("-", "+"));
        assertEquals(1, entries.size());
        Map<String, byte[]> fields = entries.get(0).getBody();
        assertEquals("json", RoundTripTest.s(fields.get("enc")));
        assertEquals(head, Envelope.parse(fields.get("body")));
        assertTrue(RoundTripTest.s(redis.hget(keys.orderWaiting(QUEUE, "G"), next.taskId())).startsWith("normal\njson\n"));
        assertEquals(List.of(head.taskId(), next.taskId()),
                redis.lrange(keys.order(QUEUE, "G"), 0, -1).stream().map(RoundTripTest::s).toList());
    }
}
