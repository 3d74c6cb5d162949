package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertArrayEquals;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.StreamMessage;

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.BooleanSupplier;

import org.junit.jupiter.api.Test;

/** Producer → worker round trips against a real redis-server. */
class RoundTripTest extends RedisFixture {
    final String queue = "jobs";

    Producer producer() {
        return Producer.builder().client(client).prefix(prefix).queue(queue).build();
    }

    Worker.Builder worker() {
        return Worker.builder().client(client).prefix(prefix).queue(queue).block(Duration.ofMillis(200))
                .shutdownTimeout(Duration.ofSeconds(5)).concurrency(2);
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

    List<StreamMessage<String, byte[]>> dead() {
        return redis.xrange(keys.dead(queue), io.lettuce.core.Range.create("-", "+"));
    }

    static String s(byte[] b) {
        return b == null ? null : new String(b, StandardCharsets.UTF_8);
    }

    long streamLength() {
        long n = 0;
        for (String st : keys.taskStreams(queue)) {
            n += redis.xlen(st);
        }
        return n;
    }

    @Test
    void publishedTaskRunsOnceAndIsAcknowledged() throws Exception {
        List<Task> seen = new CopyOnWriteArrayList<>();
        List<String> childTraces = new CopyOnWriteArrayList<>();
        try (Producer p = producer();
             Worker w = worker().handler("order.close", t -> {
                 seen.add(t);
                 childTraces.add(Envelope.builder("child").build().traceId());
             }).build().start()) {
            PublishResult r = p.publish(Envelope.builder("order.close").put("order_id", 7).priority(200).build());
            assertNotNull(r.entryId());
            assertFalse(r.delayed());
            await("the task to run", () -> seen.size() == 1);
            assertEquals(7, seen.get(0).get("order_id").asInt());
            assertEquals(keys.stream(queue, "high"), seen.get(0).stream());
            await("the ack", () -> streamLength() == 0);
            assertEquals(0, redis.xpending(keys.stream(queue, "high"), "workers").getCount());
            assertEquals(1, redis.exists(keys.consumer(w.consumer())));
        }
        assertEquals(1, seen.size());
        assertEquals(List.of(seen.get(0).traceId()), childTraces, "a task built in a handler carries its trace id");
        assertTrue(dead().isEmpty());
    }

    @Test
    void theStartLineSaysWhatTheWorkerServes() {
        try (LogCapture log = new LogCapture();
             Worker w = worker().handler("b.second", Set.of(2L, 1L), t -> { }).resultHandler("a.first", t -> 1)
                     .build().start()) {
            assertEquals(Map.of("a.first", List.of(1L), "b.second", List.of(1L, 2L)), w.serves());
            List<String> lines = log.lines("worker started");
            assertEquals(1, lines.size(), lines.toString());
            assertTrue(lines.get(0).contains("queue=" + queue + " "), lines.get(0));
            assertTrue(lines.get(0).contains("task_types={a.first=[1], b.second=[1, 2]}"), lines.get(0));
        }
    }

    @Test
    void closeDeletesTheLivenessKey() throws Exception {
        Worker w = worker().build().start();
        String name = w.consumer();
        String value = s(redis.get(keys.consumer(name)));
        assertTrue(value.endsWith(" java"), value);
        w.close();
        assertEquals(0, redis.exists(keys.consumer(name)));
    }

    @Test
    void delayedTaskIsPromotedWhenDue() throws Exception {
        CountDownLatch ran = new CountDownLatch(1);
        try (Producer p = producer(); Worker w = worker().handler("later", t -> ran.countDown()).build().start()) {
            Envelope e = Envelope.builder("later").build();
            PublishResult r = p.publishIn(e, Duration.ofMillis(700));
            assertTrue(r.delayed());
            assertNotNull(redis.zscore(keys.delayed(queue), e.taskId().getBytes()));
            assertTrue(redis.sismember(keys.queues(), queue.getBytes()));
            assertFalse(ran.await(300, TimeUnit.MILLISECONDS), "ran before it was due");
            assertTrue(ran.await(10, TimeUnit.SECONDS), "never ran");
        }
    }

    @Test
    void publishRefusesTooFarAheadNamingFieldAndRule() {
        try (Producer p = producer()) {
            Envelope e = Envelope.builder("x").scheduleTime(Instant.now().plus(Duration.ofDays(91))).build();
            EnvelopeValidationException ex = assertThrows(EnvelopeValidationException.class, () -> p.publish(e));
            assertEquals("schedule_time", ex.field());
            assertEquals("max_delay", ex.rule());
        }
    }

    @Test
    void builderNamesFieldAndRule() {
        EnvelopeValidationException ex = assertThrows(EnvelopeValidationException.class,
                () -> Envelope.builder("x").priority(256).build());
        assertEquals("priority", ex.field());
        assertEquals("range", ex.rule());
        ex = assertThrows(EnvelopeValidationException.class, () -> Envelope.builder("bad type").build());
        assertEquals("task_type", ex.field());
        assertEquals("pattern", ex.rule());
    }

    @Test
    void retriedPublishWithTheSameTokenIsStoredOnce() {
        Envelope e = Envelope.builder("x").build();
        EntryCodec.Body body = EntryCodec.encodeBody(e, Limits.DEFAULT);
        List<String> k = List.of(keys.stream(queue, "normal"), keys.delayed(queue), keys.delayedData(queue),
                keys.published(queue, e.taskId()));
        byte[] first = Scripts.run(redis, "enqueue", io.lettuce.core.ScriptOutputType.VALUE, k, e.taskId(), body.enc(),
                body.bytes(), "tok1", Producer.PUBLISH_DEDUPE_MS);
        byte[] again = Scripts.run(redis, "enqueue", io.lettuce.core.ScriptOutputType.VALUE, k, e.taskId(), body.enc(),
                body.bytes(), "tok1", Producer.PUBLISH_DEDUPE_MS);
        assertArrayEquals(first, again);
        assertEquals(1, redis.xlen(keys.stream(queue, "normal")));
    }

    @Test
    void malformedEntriesAreDeadLetteredWithTheirRawBytes() throws Exception {
        AtomicInteger ran = new AtomicInteger();
        try (Worker w = worker().handler("ok", t -> ran.incrementAndGet()).build().start()) {
            byte[] garbage = new byte[] {(byte) 0xff, (byte) 0xfe, '{', 0, 1};
            Map<String, byte[]> notJson = new LinkedHashMap<>();
            notJson.put("v", "1".getBytes());
            notJson.put("enc", "json".getBytes());
            notJson.put("body", garbage);
            redis.xadd(keys.stream(queue, "normal"), notJson);
            Map<String, byte[]> badVersion = new LinkedHashMap<>();
            badVersion.put("v", "2".getBytes());
            badVersion.put("enc", "json".getBytes());
            badVersion.put("body", "{}".getBytes());
            badVersion.put("extra", "kept".getBytes());
            redis.xadd(keys.stream(queue, "low"), badVersion);
            Map<String, byte[]> good = EntryCodec.encodeEntry(Envelope.builder("ok").build(), 0, Limits.DEFAULT);
            redis.xadd(keys.stream(queue, "low"), good);
            await("two dead letters and one success", () -> dead().size() == 2 && ran.get() == 1);
            await("streams emptied", () -> streamLength() == 0);
        }
        // The two were read from different streams and handled concurrently: find each by its raw.v.
        List<Map<String, byte[]>> d = new ArrayList<>();
        dead().forEach(m -> d.add(m.getBody()));
        d.sort((a, b) -> s(a.get("raw.v")).compareTo(s(b.get("raw.v"))));
        Map<String, byte[]> first = d.get(0);
        assertEquals("malformed_entry", s(first.get("failure_class")));
        assertEquals("1", s(first.get("dlq")));
        assertEquals("java", s(first.get("language")));
        assertEquals(queue, s(first.get("queue")));
        assertArrayEquals(new byte[] {(byte) 0xff, (byte) 0xfe, '{', 0, 1}, first.get("raw.body"));
        assertEquals("1", s(first.get("raw.v")));
        assertTrue(s(first.get("reason")).contains("envelope"), s(first.get("reason")));
        Map<String, byte[]> second = d.get(1);
        assertEquals("malformed_entry", s(second.get("failure_class")));
        assertEquals("kept", s(second.get("raw.extra")));
        assertTrue(s(second.get("reason")).startsWith("version"), s(second.get("reason")));
        assertTrue(redis.sismember(keys.deadQueues(), queue.getBytes()));
    }

    @Test
    void unknownTaskTypeAndUnsupportedVersionAreDeadLettered() throws Exception {
        try (Producer p = producer(); Worker w = worker().handler("known", t -> { }).build().start()) {
            p.publish(Envelope.builder("nobody.handles.this").build());
            p.publish(Envelope.builder("known").payloadVersion(2).build());
            await("two dead letters", () -> dead().size() == 2);
        }
        List<String> classes = new ArrayList<>();
        for (StreamMessage<String, byte[]> m : dead()) {
            classes.add(s(m.getBody().get("failure_class")));
            assertEquals("1", s(m.getBody().get("attempts")));
            assertNotNull(m.getBody().get("task_id"));
        }
        Collections.sort(classes);
        assertEquals(List.of("unknown_task_type", "unsupported_payload_version"), classes);
    }

    @Test
    void aFailureWithoutRetryPolicyIsFinal() throws Exception {
        AtomicInteger calls = new AtomicInteger();
        try (Producer p = producer(); Worker w = worker().handler("boom", t -> {
            calls.incrementAndGet();
            throw new IllegalStateException("kaput");
        }).build().start()) {
            p.publish(Envelope.builder("boom").build());
            await("a dead letter", () -> dead().size() == 1);
        }
        Map<String, byte[]> d = dead().get(0).getBody();
        assertEquals("task_error", s(d.get("failure_class")));
        assertEquals("java.lang.IllegalStateException", s(d.get("exception_type")));
        assertTrue(s(d.get("traceback")).contains("kaput"));
        assertEquals(1, calls.get());
    }

    @Test
    void aTransientFailureIsRetriedThenSucceeds() throws Exception {
        List<Long> attempts = new CopyOnWriteArrayList<>();
        List<Task> done = new CopyOnWriteArrayList<>();
        try (Producer p = producer(); Worker w = worker().handler("flaky", t -> {
            attempts.add(t.retryCount());
            if (t.retryCount() < 1) {
                throw new TaskFailure.Transient("connection reset");
            }
            done.add(t);
        }).build().start()) {
            p.publish(Envelope.builder("flaky").tieredRetries().build());
            await("success after a retry", () -> done.size() == 1);
        }
        assertEquals(List.of(0L, 1L), attempts);
        Envelope e = done.get(0).envelope();
        assertEquals("1", e.headers().get("x-fast-retries"));
        assertNotNull(e.headers().get("x-first-failure-at"));
        assertTrue(dead().isEmpty());
        assertEquals(0, streamLength());
    }

    @Test
    void backoffRetryGoesThroughTheDelayedSet() throws Exception {
        List<Long> attempts = new CopyOnWriteArrayList<>();
        RetryPolicy fastBackoff = new RetryPolicy(0, Duration.ofMillis(300), Duration.ofSeconds(1), () -> 1.0);
        try (Producer p = producer(); Worker w = worker().retryPolicy(fastBackoff).handler("slowfix", t -> {
            attempts.add(t.retryCount());
            if (t.retryCount() == 0) {
                throw new RuntimeException("not yet");
            }
        }).build().start()) {
            p.publish(Envelope.builder("slowfix").tieredRetries().build());
            await("two attempts", () -> attempts.size() == 2);
        }
        assertEquals(List.of(0L, 1L), attempts);
    }

    @Test
    void exhaustedRetriesAreDeadLettered() throws Exception {
        try (Producer p = producer(); Worker w = worker().handler("always", t -> {
            throw new TaskFailure.Transient("down");
        }).build().start()) {
            p.publish(Envelope.builder("always").tieredRetries().maxRetries(2L).build());
            await("a dead letter", () -> dead().size() == 1);
        }
        Map<String, byte[]> d = dead().get(0).getBody();
        assertEquals("transient_exhausted", s(d.get("failure_class")));
        assertEquals("3", s(d.get("attempts")));
    }

    @Test
    void explicitRetryAndTimeout() throws Exception {
        List<Long> attempts = new CopyOnWriteArrayList<>();
        try (Producer p = producer(); Worker w = worker().handler("explicit", t -> {
            attempts.add(t.retryCount());
            if (t.retryCount() == 0) {
                throw t.retry("try again", Duration.ZERO);
            }
        }).handler("sleepy", t -> Thread.sleep(5000)).build().start()) {
            p.publish(Envelope.builder("explicit").build());
            p.publish(Envelope.builder("sleepy").timeoutMs(200L).build());
            await("explicit retry ran", () -> attempts.size() == 2);
            await("timeout dead letter", () -> dead().size() == 1);
        }
        assertEquals("timeout", s(dead().get(0).getBody().get("failure_class")));
    }

    @Test
    void anAbandonedAttemptKeepsItsIdempotencyClaimUntilItReturns() throws Exception {
        AtomicInteger effects = new AtomicInteger();
        CountDownLatch started = new CountDownLatch(1);
        RetryPolicy quick = new RetryPolicy(2, Duration.ofMillis(100), Duration.ofMillis(400));
        // a claim of timeout_ms + lease = 700 ms: only its renewals keep it through the 1.5 s run
        try (Producer p = producer(); Worker w = worker().lease(Duration.ofMillis(600)).retryPolicy(quick)
                .deferDelay(Duration.ofMillis(200)).handler("overrun", t -> {
                    started.countDown();
                    long end = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(1500);
                    for (long left; (left = end - System.nanoTime()) > 0; ) {
                        try {
                            TimeUnit.NANOSECONDS.sleep(left);
                        } catch (InterruptedException ignored) {
                            // ignores interruption: abandoned at 100 ms, it still has its effect
                        }
                    }
                    effects.incrementAndGet();
                }).build().start()) {
            // the timeout is retried once, 100-400 ms later
            p.publish(Envelope.builder("overrun").tieredRetries().maxRetries(1L).timeoutMs(100L)
                    .idempotencyKey("overrun-1").build());
            String idemKey = keys.idempotency("overrun", "overrun-1");
            assertTrue(started.await(10, TimeUnit.SECONDS));
            Thread.sleep(1200);
            String claim = s(redis.get(idemKey));
            assertTrue(claim != null && claim.startsWith("running "), "the claim was not renewed: " + claim);
            await("the abandoned attempt to mark the key done", () -> {
                String v = s(redis.get(idemKey));
                return v != null && v.startsWith("done ");
            });
            await("the queue to drain", () -> streamLength() == 0 && redis.zcard(keys.delayed(queue)) == 0);
            Thread.sleep(300);
        }
        assertEquals(1, effects.get(), "the retry ran while the abandoned attempt still held the key");
        assertTrue(dead().isEmpty(), "dead-lettered");
    }

    @Test
    void twoEntriesOfOneTaskOnOneConsumerNeverRunAtOnce() throws Exception {
        AtomicInteger running = new AtomicInteger();
        AtomicInteger most = new AtomicInteger();
        AtomicInteger effects = new AtomicInteger();
        List<Envelope> duplicates = new CopyOnWriteArrayList<>();
        Envelope env = Envelope.builder("settle").idempotencyKey("settle-1").build();
        try (Producer p = producer()) {
            // two entries of one task (a failover lost an ack or a promotion): one read takes both
            p.publish(env);
            p.publish(env);
        }
        try (Worker w = worker().deferDelay(Duration.ofMillis(300)).onDuplicate(duplicates::add)
                .handler("settle", t -> {
                    most.accumulateAndGet(running.incrementAndGet(), Math::max);
                    Thread.sleep(500);
                    effects.incrementAndGet();
                    running.decrementAndGet();
                }).build().start()) {
            await("both entries settled", () -> effects.get() + duplicates.size() == 2 && streamLength() == 0
                    && redis.zcard(keys.delayed(queue)) == 0);
        }
        assertEquals(1, most.get(), "two attempts of one idempotency key ran at once");
        assertEquals(1, effects.get());
        assertEquals(1, duplicates.size(), "the deferred entry was not acknowledged as a duplicate");
    }

    @Test
    void idempotencyKeyDoneMeansADuplicateDoesNotRun() throws Exception {
        AtomicInteger ran = new AtomicInteger();
        List<Envelope> duplicates = new CopyOnWriteArrayList<>();
        try (Producer p = producer(); Worker w = worker().concurrency(1).handler("charge", t -> ran.incrementAndGet())
                .onDuplicate(duplicates::add).build().start()) {
            p.publish(Envelope.builder("charge").idempotencyKey("order-1").build());
            await("first run", () -> ran.get() == 1 && streamLength() == 0);
            String marker = s(redis.get(keys.idempotency("charge", "order-1")));
            assertTrue(marker.startsWith("done "), marker);
            p.publish(Envelope.builder("charge").idempotencyKey("order-1").build());
            await("the duplicate acknowledged", () -> duplicates.size() == 1 && streamLength() == 0);
        }
        assertEquals(1, ran.get());
        assertTrue(dead().isEmpty());
    }

    @Test
    void cancelledTaskIsNotRunWhateverItsQueueAndItsMarkStays() throws Exception {
        AtomicInteger ran = new AtomicInteger();
        try (Producer p = producer()) {
            Envelope e = Envelope.builder("c").build();
            p.publish(e);
            assertEquals("marked", p.cancel(e.taskId()));
            assertEquals("already", p.cancel(e.taskId()));
            Envelope elsewhere = Envelope.builder("c").build();
            p.publishIn("other", elsewhere, Duration.ofMinutes(5));
            assertEquals(new CancelResult(CancelResult.Outcome.REMOVED, "other"),
                    p.canceller().cancel(elsewhere.taskId()), "found in a queue the caller did not name");
            assertNull(redis.zscore(keys.delayed("other"), elsewhere.taskId().getBytes()));
            assertFalse(redis.hexists(keys.delayedData("other"), elsewhere.taskId()));
            Envelope later = Envelope.builder("c").build();
            p.publishIn(later, Duration.ofMinutes(5));
            assertEquals("marked", p.cancel("other", later.taskId()), "only the named queue is looked in");
            assertNotNull(redis.zscore(keys.delayed(queue), later.taskId().getBytes()));
            try (Worker w = worker().handler("c", t -> ran.incrementAndGet()).build().start()) {
                await("acknowledged", () -> streamLength() == 0);
                p.publish(e); // the same id again: its mark is still there
                await("acknowledged again", () -> streamLength() == 0);
                Thread.sleep(100);
            }
            assertNotNull(redis.zscore(keys.cancelled(), e.taskId().getBytes()), "the worker removed the mark");
            assertEquals(3, redis.zcard(keys.cancelled()));
        }
        assertEquals(0, ran.get());
        assertTrue(dead().isEmpty());
        assertEquals(0, redis.exists(keys.base(queue) + ":cancelled"), "no per-queue cancel key");
    }

    @Test
    void cancelDropsMarksOlderThanAWeek() {
        long eightDaysAgo = System.currentTimeMillis() - Duration.ofDays(8).toMillis();
        redis.zadd(keys.cancelled(), eightDaysAgo, "stale".getBytes());
        redis.zadd(keys.cancelled(), System.currentTimeMillis(), "fresh".getBytes());
        try (Canceller c = Canceller.builder().client(client).prefix(prefix).build()) {
            assertEquals(new CancelResult(CancelResult.Outcome.MARKED, null), c.cancel("new-one"));
            IllegalArgumentException ex = assertThrows(IllegalArgumentException.class, () -> c.cancel("has space"));
            assertTrue(ex.getMessage().startsWith("task_id"), ex.getMessage());
        }
        assertNull(redis.zscore(keys.cancelled(), "stale".getBytes()));
        assertNotNull(redis.zscore(keys.cancelled(), "fresh".getBytes()));
        assertNotNull(redis.zscore(keys.cancelled(), "new-one".getBytes()));
    }

    @Test
    void anExpiredTaskIsAcknowledgedWithoutRunning() throws Exception {
        List<String> ran = new CopyOnWriteArrayList<>();
        try (Producer p = producer(); Worker w = worker().handler("x", t -> ran.add(t.taskId())).build().start()) {
            Envelope expired = Envelope.builder("x").expires(Instant.now().minusSeconds(1)).build();
            Envelope fresh = Envelope.builder("x").expiresIn(Duration.ofHours(1)).build();
            p.publish(expired);
            p.publish(fresh);
            await("the fresh one ran and both were acknowledged", () -> ran.size() == 1 && streamLength() == 0);
            assertEquals(List.of(fresh.taskId()), ran);
        }
        assertTrue(dead().isEmpty(), "an expired task is not a failure");
    }

    @Test
    void anEntryNotDueYetIsMovedToTheDelayedSet() throws Exception {
        Envelope e = Envelope.builder("future").scheduleTime(Instant.now().plus(Duration.ofHours(1))).build();
        redis.xadd(keys.stream(queue, "normal"), EntryCodec.encodeEntry(e, 0, Limits.DEFAULT));
        try (Worker w = worker().runPromoter(false).handler("future", t -> { }).build().start()) {
            await("moved", () -> streamLength() == 0);
        }
        assertEquals((double) e.scheduleTime().toEpochMilli(), redis.zscore(keys.delayed(queue), e.taskId().getBytes()));
    }

    @Test
    void deadConsumersEntriesAreTakenOver() throws Exception {
        try (Producer p = producer()) {
            p.publish(Envelope.builder("orphan").build());
        }
        String stream = keys.stream(queue, "normal");
        redis.xgroupCreate(io.lettuce.core.XReadArgs.StreamOffset.from(stream, "0"), "workers",
                io.lettuce.core.XGroupCreateArgs.Builder.mkstream(true));
        redis.xreadgroup(io.lettuce.core.Consumer.from("workers", "ghost"),
                io.lettuce.core.XReadArgs.StreamOffset.lastConsumed(stream));
        Thread.sleep(400);
        CountDownLatch ran = new CountDownLatch(1);
        List<Integer> redelivered = new CopyOnWriteArrayList<>();
        try (Worker w = worker().lease(Duration.ofMillis(300)).handler("orphan", t -> {
            redelivered.add(t.redeliveries());
            ran.countDown();
        }).build().start()) {
            assertTrue(ran.await(10, TimeUnit.SECONDS), "the orphaned entry never ran");
        }
        assertEquals(List.of(1), redelivered);
    }

    @Test
    void deadLettersCanBeListedReplayedAndDeleted() throws Exception {
        AtomicInteger runs = new AtomicInteger();
        try (Producer p = producer();
             DeadLetters dl = DeadLetters.builder().client(client).prefix(prefix).build();
             Worker w = worker().handler("fixme", t -> {
                 if (t.get("ok").asBoolean(false)) {
                     runs.incrementAndGet();
                 } else {
                     throw new TaskFailure.InvalidPayload("ok must be true");
                 }
             }).build().start()) {
            Envelope e = Envelope.builder("fixme").put("ok", false).build();
            p.publish(e);
            Map<String, byte[]> junk = new LinkedHashMap<>();
            junk.put("v", "1".getBytes());
            redis.xadd(keys.stream(queue, "normal"), junk);
            await("two dead letters", () -> dead().size() == 2);
            assertEquals(List.of(queue), dl.queues());
            List<DeadLetter> all = dl.list(queue, 10);
            assertEquals(2, all.size());
            DeadLetter invalid = all.stream().filter(d -> "invalid_payload".equals(d.failureClass())).findFirst().get();
            assertEquals(e.taskId(), invalid.taskId());
            assertEquals(e, invalid.envelope());
            DeadLetter broken = all.stream().filter(d -> "malformed_entry".equals(d.failureClass())).findFirst().get();
            assertNull(broken.envelope());
            assertTrue(broken.decodeError().startsWith("missing_field"), broken.decodeError());
            assertThrows(IllegalStateException.class, () -> dl.replay(queue, broken.entryId(), "test"));

            String newId = dl.replay(queue, invalid.entryId(), b -> b.put("ok", true), "test");
            assertNotNull(newId);
            assertNull(dl.replay(queue, invalid.entryId(), "test"), "replayed twice");
            await("the replay ran", () -> runs.get() == 1);
            assertEquals(1, redis.xlen(keys.replayed(queue)));
            assertEquals(1, dl.delete(queue, broken.entryId()));
            assertEquals(0, dl.count(queue));
        }
    }

    @Test
    void deadConsumersThatHoldNothingAreForgotten() throws Exception {
        String stream = keys.stream(queue, "normal");
        redis.xgroupCreate(io.lettuce.core.XReadArgs.StreamOffset.from(stream, "0"), "workers",
                io.lettuce.core.XGroupCreateArgs.Builder.mkstream(true));
        String id = redis.xadd(stream, Map.of("x", "y".getBytes()));
        redis.xreadgroup(io.lettuce.core.Consumer.from("workers", "gone"),
                io.lettuce.core.XReadArgs.StreamOffset.lastConsumed(stream));
        redis.xack(stream, "workers", id);
        redis.xdel(stream, id);
        assertTrue(consumerNames(stream).contains("gone"));
        Thread.sleep(350);
        try (Worker w = worker().lease(Duration.ofMillis(300)).forgetDeadConsumersAfter(Duration.ZERO, Duration.ZERO)
                .build().start()) {
            await("the empty dead consumer forgotten", () -> !consumerNames(stream).contains("gone"));
        }
    }

    static List<String> consumerNames(String stream) {
        List<String> names = new ArrayList<>();
        for (Object c : redis.xinfoConsumers(stream, "workers")) {
            List<?> info = (List<?>) c;
            for (int i = 0; i + 1 < info.size(); i += 2) {
                if ("name".equals(Redis.s(info.get(i)))) {
                    names.add(Redis.s(info.get(i + 1)));
                }
            }
        }
        return names;
    }

    @Test
    void aBusyIdempotencyKeyOfALiveConsumerDefersTheTask() throws Exception {
        redis.set(keys.consumer("other"), "h 1 go".getBytes());
        redis.set(keys.idempotency("pay", "k1"), "running other someid".getBytes());
        AtomicInteger ran = new AtomicInteger();
        try (Producer p = producer();
             Worker w = worker().deferDelay(Duration.ofMillis(300)).lease(Duration.ofMillis(1500))
                     .handler("pay", t -> ran.incrementAndGet()).build().start()) {
            p.publish(Envelope.builder("pay").idempotencyKey("k1").build());
            Thread.sleep(600);
            assertEquals(0, ran.get(), "ran while another live consumer held the key");
            redis.del(keys.consumer("other"));
            await("run after the holder died", () -> ran.get() == 1);
        }
    }

    @Test
    void retriesOfATaskTypeWaitForAFreeSlot() throws Exception {
        String slots = keys.retrying("capped");
        redis.zadd(slots, System.currentTimeMillis() + 60_000, "someone-else".getBytes());
        AtomicInteger ran = new AtomicInteger();
        RetryPolicy quick = new RetryPolicy(0, Duration.ofMillis(200), Duration.ofMillis(200), () -> 1.0);
        try (Producer p = producer();
             Worker w = worker().retryConcurrency(1).retryPolicy(quick).handler("capped", t -> ran.incrementAndGet())
                     .build().start()) {
            p.publish(Envelope.builder("capped").tieredRetries().retryCount(1).build());
            Thread.sleep(700);
            assertEquals(0, ran.get(), "a retry ran although every slot was taken");
            redis.del(slots);
            await("the retry ran once a slot was free", () -> ran.get() == 1);
        }
        assertEquals(0, redis.zcard(slots));
    }

    @Test
    void entriesAConsumerReadButNeverSettledAreDeliveredWhenItStartsAgain() throws Exception {
        try (Producer p = producer()) {
            p.publish(Envelope.builder("resume").build());
        }
        String stream = keys.stream(queue, "normal");
        redis.xgroupCreate(io.lettuce.core.XReadArgs.StreamOffset.from(stream, "0"), "workers",
                io.lettuce.core.XGroupCreateArgs.Builder.mkstream(true));
        redis.xreadgroup(io.lettuce.core.Consumer.from("workers", "same-name"),
                io.lettuce.core.XReadArgs.StreamOffset.lastConsumed(stream));
        CountDownLatch ran = new CountDownLatch(1);
        try (Worker w = worker().consumer("same-name").handler("resume", t -> ran.countDown()).build().start()) {
            assertTrue(ran.await(10, TimeUnit.SECONDS), "the pending entry was never delivered");
            await("acknowledged", () -> streamLength() == 0);
        }
    }

    @Test
    void aTaskStillRunningAtShutdownKeepsItsConsumerAliveUntilItEnds() throws Exception {
        CountDownLatch started = new CountDownLatch(1);
        CountDownLatch release = new CountDownLatch(1);
        Worker w = worker().shutdownTimeout(Duration.ofMillis(200)).lease(Duration.ofMillis(600))
                .handler("long", t -> {
                    started.countDown();
                    release.await();
                }).build().start();
        try (Producer p = producer()) {
            p.publish(Envelope.builder("long").build());
        }
        assertTrue(started.await(10, TimeUnit.SECONDS));
        w.close();
        Thread.sleep(900); // longer than the lease: only renewals keep the key
        assertEquals(1, redis.exists(keys.consumer(w.consumer())), "liveness given up while a task ran");
        release.countDown();
        await("acknowledged and the key deleted",
                () -> streamLength() == 0 && redis.exists(keys.consumer(w.consumer())) == 0);
    }

    @Test
    void maxRetriesZeroIsFinalAndNullIsUnlimited() throws Exception {
        List<Long> unlimited = new CopyOnWriteArrayList<>();
        RetryPolicy quick = new RetryPolicy(0, Duration.ofMillis(20), Duration.ofMillis(50), () -> 1.0);
        try (Producer p = producer(); Worker w = worker().retryPolicy(quick)
                .handler("zero", t -> {
                    throw new TaskFailure.Transient("down");
                })
                .handler("forever", t -> {
                    unlimited.add(t.retryCount());
                    if (t.retryCount() < 5) {
                        throw new RuntimeException("again");
                    }
                }).build().start()) {
            p.publish(Envelope.builder("zero").tieredRetries().maxRetries(0L).build());
            p.publish(Envelope.builder("forever").tieredRetries().maxRetries(null).build());
            await("zero dead-lettered and forever done", () -> dead().size() == 1 && unlimited.size() == 6);
        }
        Map<String, byte[]> d = dead().get(0).getBody();
        assertEquals("transient_exhausted", s(d.get("failure_class")));
        assertEquals("1", s(d.get("attempts")));
        assertEquals(List.of(0L, 1L, 2L, 3L, 4L, 5L), unlimited);
    }

    @Test
    void theWorkerCreatesItsGroupsAgainWhenRedisLostThem() throws Exception {
        AtomicInteger ran = new AtomicInteger();
        try (Producer p = producer(); Worker w = worker().handler("again", t -> ran.incrementAndGet()).build().start()) {
            Thread.sleep(300);
            for (String st : keys.taskStreams(queue)) {
                redis.del(st); // what a restart without persistence looks like
            }
            Thread.sleep(300);
            p.publish(Envelope.builder("again").build());
            await("run after the groups were created again", () -> ran.get() == 1);
        }
    }

    @Test
    void aWorkerOfSeveralQueuesServesThemInOrderAndWakesOnEach() throws Exception {
        List<String> order = new CopyOnWriteArrayList<>();
        try (Producer p = producer()) {
            for (int i = 0; i < 3; i++) {
                p.publish("second", Envelope.builder("step").put("k", "second").build());
                p.publish("first", Envelope.builder("step").put("k", "first").build());
            }
            try (Worker w = worker().queues("first", "second").concurrency(1).block(Duration.ofSeconds(2))
                    .handler("step", t -> order.add(t.queue() + "=" + t.get("k").asText())).build().start()) {
                assertEquals(List.of("first", "second"), w.queues());
                await("six tasks", () -> order.size() == 6);
                assertEquals(List.of("first=first", "first=first", "first=first",
                        "second=second", "second=second", "second=second"), order);
                Thread.sleep(500); // both blocking reads armed, for 2 s
                long t0 = System.nanoTime();
                p.publish("second", Envelope.builder("step").put("k", "second").build());
                await("woken by the second queue", () -> order.size() == 7);
                assertTrue(System.nanoTime() - t0 < TimeUnit.MILLISECONDS.toNanos(1000),
                        "the blocking read of the second queue woke the worker before the first's timed out");
            }
        }
        assertThrows(IllegalArgumentException.class, () -> Worker.builder().queues("a", "a"));
        assertThrows(IllegalArgumentException.class, () -> Worker.builder().queues());
    }
}
