package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.time.Instant;
import java.util.Map;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.TimeUnit;
import java.util.function.BooleanSupplier;

import org.junit.jupiter.api.Test;

/** Task records (docs/protocol.md section 14): what each step writes, how long it stays, how it reads. */
class TaskRecordsTest extends RedisFixture {
    static final long WEEK_S = Duration.ofDays(7).toSeconds();
    final String queue = "jobs";

    Producer.Builder producer() {
        return Producer.builder().client(client).prefix(prefix).queue(queue);
    }

    Worker.Builder worker() {
        return Worker.builder().client(client).prefix(prefix).queue(queue).block(Duration.ofMillis(200))
                .lease(Duration.ofMillis(1500)).shutdownTimeout(Duration.ofSeconds(5)).concurrency(1);
    }

    Map<String, String> record(String taskId) {
        Map<String, String> out = new java.util.TreeMap<>();
        redis.hgetall(keys.task(queue, taskId)).forEach((k, v) -> out.put(k, Redis.s(v)));
        return out;
    }

    long ttl(String taskId) {
        return redis.ttl(keys.task(queue, taskId));
    }

    void awaitState(String taskId, String state) throws InterruptedException {
        await("state " + state + " of " + taskId, () -> state.equals(record(taskId).get("state")));
    }

    static void await(String what, BooleanSupplier cond) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(10);
        while (!cond.getAsBoolean()) {
            if (System.nanoTime() > deadline) {
                throw new AssertionError("timed out waiting for " + what);
            }
            Thread.sleep(20);
        }
    }

    @Test
    void aTaskIsQueuedThenRunningThenSucceeded() throws Exception {
        Map<String, Map<String, String>> seenRunning = new ConcurrentHashMap<>();
        try (Producer p = producer().build()) {
            String id = p.publish(Envelope.builder("add").payloadVersion(1).put("a", 1).build()).taskId();
            Map<String, String> queued = record(id);
            assertEquals("queued", queued.get("state"));
            assertEquals("add", queued.get("task_type"));
            assertEquals("1", queued.get("payload_version"));
            assertEquals(queue, queued.get("queue"));
            assertEquals("0", queued.get("retry_count"));
            assertTrue(queued.get("published_at").matches("\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\d\\.\\d{3}Z"),
                    queued.get("published_at"));
            assertNotNull(queued.get("updated_at"));
            assertTrue(ttl(id) > WEEK_S - 60 && ttl(id) <= WEEK_S, "a queued record is kept 7 days: " + ttl(id));
            assertEquals("queued", p.getTask(queue, id).state());

            try (Worker w = worker().handler("add", t -> seenRunning.put(t.taskId(), record(t.taskId()))).build().start()) {
                awaitState(id, "succeeded");
                Map<String, String> running = seenRunning.get(id);
                assertEquals("running", running.get("state"));
                assertEquals("1", running.get("attempts"));
                assertEquals(w.consumer(), running.get("worker"));
                assertEquals("java", running.get("language"));
                assertNotNull(running.get("started_at"));
                assertNotNull(running.get("pid"));
                assertNotNull(running.get("host"));
            }
            Map<String, String> done = record(id);
            assertNotNull(done.get("finished_at"));
            assertFalse(done.containsKey("reason"));
            assertTrue(ttl(id) > 3500 && ttl(id) <= 3600, "a final record is kept the retention: " + ttl(id));
            TaskInfo info = p.getTask(id);
            assertEquals("succeeded", info.state());
            assertEquals(queue, info.queue(), "found through the announced worker's queues");
        }
    }

    @Test
    void aDelayedTaskIsScheduledThenCancelled() throws Exception {
        try (Producer p = producer().build()) {
            String id = p.publishIn(Envelope.builder("later").build(), Duration.ofHours(1)).taskId();
            Map<String, String> r = record(id);
            assertEquals("scheduled", r.get("state"));
            assertNotNull(r.get("due_at"));
            assertTrue(ttl(id) > WEEK_S + 3500, "kept 7 days after its due time: " + ttl(id));
            assertEquals("scheduled", p.getTask(id).state(), "found through <prefix>:queues");
            assertEquals("removed", p.cancel(id));
            r = record(id);
            assertEquals("cancelled", r.get("state"));
            assertEquals("cancelled", r.get("reason"));
            assertNotNull(r.get("finished_at"));
            assertTrue(ttl(id) <= 3600);
        }
    }

    @Test
    void anEntryNotDueYetIsRecordedScheduledByItsConsumer() throws Exception {
        Envelope later = Envelope.builder("later").scheduleTime(Instant.now().plusSeconds(600)).build();
        redis.xadd(keys.stream(queue, "normal"), EntryCodec.encodeEntry(later, 0, Limits.DEFAULT));
        try (Producer p = producer().build(); Worker w = worker().runPromoter(false).handler("later", t -> { }).build().start()) {
            awaitState(later.taskId(), "scheduled");
            Map<String, String> r = record(later.taskId());
            assertEquals(later.scheduleTime().toEpochMilli(), Timestamp.parse(r.get("due_at")).toEpochMilli());
            assertEquals("later", r.get("task_type"));
            assertTrue(ttl(later.taskId()) > WEEK_S + 500, "kept 7 days after its due time: " + ttl(later.taskId()));
            assertEquals("scheduled", p.getTask(queue, later.taskId()).state());
        }
    }

    @Test
    void skipsAreRecordedWithTheirReason() throws Exception {
        try (Producer p = producer().build()) {
            String expired = p.publish(Envelope.builder("noop").expires(Instant.now().plusMillis(50)).build()).taskId();
            Envelope twice = Envelope.builder("noop").idempotencyKey("k1").build();
            String first = p.publish(twice).taskId();
            Thread.sleep(100);
            try (Worker w = worker().handler("noop", t -> { }).build().start()) {
                awaitState(first, "succeeded");
                String dup = p.publish(Envelope.builder("noop").idempotencyKey("k1").build()).taskId();
                awaitState(dup, "succeeded");
                assertEquals("duplicate", record(dup).get("reason"));
                awaitState(expired, "cancelled");
                assertEquals("expired", record(expired).get("reason"));
            }
        }
    }

    @Test
    void retriesAndDeadLettersAreRecordedThenReplayed() throws Exception {
        try (Producer p = producer().build();
             DeadLetters dl = DeadLetters.builder().client(client).prefix(prefix).build()) {
            String retried = p.publish(Envelope.builder("flaky").build()).taskId();
            String rejected = p.publish(Envelope.builder("bad").build()).taskId();
            try (Worker w = worker().handler("flaky", t -> {
                throw new TaskFailure.Retry("not yet", Duration.ofMinutes(5));
            }).handler("bad", t -> {
                throw new TaskFailure.Rejected("no such order");
            }).build().start()) {
                awaitState(retried, "retrying");
                awaitState(rejected, "dead");
            }
            Map<String, String> r = record(retried);
            assertEquals("1", r.get("retry_count"));
            assertNotNull(r.get("due_at"));
            assertTrue(r.get("error").endsWith("Retry: not yet"), r.get("error"));
            assertEquals("1", r.get("attempts"));

            Map<String, String> d = record(rejected);
            assertTrue(d.get("error").endsWith("Rejected: no such order"), d.get("error"));
            assertNotNull(d.get("finished_at"));
            String deadId = d.get("dead_id");
            assertNotNull(deadId);
            assertEquals("dead", p.getTask(rejected).state());

            assertNotNull(dl.replay(queue, deadId, "ops"));
            assertEquals("queued", record(rejected).get("state"));
            assertEquals("0", record(rejected).get("retry_count"));
        }
    }

    @Test
    void aTakeoverPastTheRedeliveryLimitIsRecordedDead() throws Exception {
        for (String stream : keys.taskStreams(queue)) {
            redis.xgroupCreate(io.lettuce.core.XReadArgs.StreamOffset.from(stream, "0"), Keys.DEFAULT_GROUP,
                    io.lettuce.core.XGroupCreateArgs.Builder.mkstream(true));
        }
        try (Producer p = producer().build()) {
            String id = p.publish(Envelope.builder("lost").build()).taskId();
            // A consumer that read the entry and died: it has no liveness key.
            Scripts.run(redis, "read", io.lettuce.core.ScriptOutputType.MULTI, keys.taskStreams(queue),
                    Keys.DEFAULT_GROUP, "ghost", 1);
            try (Worker w = worker().maxRedeliveries(1).handler("lost", t -> { }).build().start()) {
                awaitState(id, "dead");
            }
            Map<String, String> r = record(id);
            assertNotNull(r.get("dead_id"));
            assertTrue(r.get("error").startsWith("redelivery_limit"), r.get("error"));
            assertNotNull(r.get("finished_at"));
            assertEquals("dead", p.getTask(queue, id).state());
        }
    }

    @Test
    void theReaderCorrectsWhatHappenedSinceTheWrite() throws Exception {
        try (Producer p = producer().build()) {
            String past = TaskRecords.time(Instant.now().minusSeconds(5));
            redis.hset(keys.task(queue, "promoted"), Map.of("state", Redis.b("scheduled"), "due_at", Redis.b(past)));
            redis.hset(keys.task(queue, "waiting"), Map.of("state", Redis.b("retrying"), "due_at", Redis.b(past)));
            redis.zadd(keys.delayed(queue), 1.0, Redis.b("waiting"));
            redis.hset(keys.task(queue, "orphan"), Map.of("state", Redis.b("running"), "worker", Redis.b("gone")));
            redis.hset(keys.task(queue, "alive"), Map.of("state", Redis.b("running"), "worker", Redis.b("here")));
            redis.set(keys.consumer("here"), Redis.b("h 1 java"));
            redis.hset(keys.task(queue, "purged"), Map.of("state", Redis.b("dead"), "dead_id", Redis.b("1-1")));
            redis.zadd(keys.delayed(queue), 1.0, Redis.b("norecord"));
            assertEquals("queued", p.getTask(queue, "promoted").state());
            assertEquals("retrying", p.getTask(queue, "waiting").state());
            assertEquals("queued", p.getTask(queue, "orphan").state());
            assertEquals("running", p.getTask(queue, "alive").state());
            assertEquals("failed", p.getTask(queue, "purged").state());
            assertEquals("scheduled", p.getTask(queue, "norecord").state());
            assertEquals("unknown", p.getTask(queue, "nothing").state());
            assertEquals("unknown", p.getTask("nothing").state());
        }
    }

    @Test
    void recordsExpireAfterTheRetentionAndZeroTurnsThemOff() throws Exception {
        try (Producer p = producer().taskRecordRetention(Duration.ofMillis(800)).build();
             Producer off = producer().taskRecordRetention(Duration.ZERO).build()) {
            String id = p.publishIn(Envelope.builder("x").build(), Duration.ofMinutes(1)).taskId();
            assertEquals("removed", p.cancel(id));
            assertEquals("cancelled", p.getTask(queue, id).state());
            long pttl = redis.pttl(keys.task(queue, id));
            assertTrue(pttl > 0 && pttl <= 800, "expiry " + pttl);
            await("the record to expire", () -> redis.exists(keys.task(queue, id)) == 0);
            assertEquals("unknown", p.getTask(queue, id).state());

            String none = off.publish(Envelope.builder("x").build()).taskId();
            assertEquals(0, redis.exists(keys.task(queue, none)));
        }
    }
}
