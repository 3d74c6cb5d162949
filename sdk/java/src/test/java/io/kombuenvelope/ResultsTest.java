package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.fasterxml.jackson.databind.node.ObjectNode;

import io.lettuce.core.RedisClient;
import io.lettuce.core.StreamMessage;
import io.lettuce.core.api.StatefulRedisConnection;
import io.lettuce.core.api.sync.RedisCommands;
import io.lettuce.core.pubsub.RedisPubSubAdapter;
import io.lettuce.core.pubsub.StatefulRedisPubSubConnection;

import java.nio.charset.StandardCharsets;
import java.time.Duration;
import java.time.Instant;
import java.util.List;
import java.util.Map;
import java.util.concurrent.BlockingQueue;
import java.util.concurrent.LinkedBlockingQueue;
import java.util.concurrent.TimeUnit;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;

/**
 * Results for Celery callers (docs/protocol.md section 12), written to a result backend that is a
 * redis-server of its own, apart from the one holding the queues.
 */
class ResultsTest extends RedisFixture {
    private static final Pattern DATE_DONE = Pattern.compile(
            "\"date_done\":\"([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{6}\\+00:00)\"");
    static RedisServer backendServer;
    static RedisClient backend;
    static StatefulRedisConnection<String, byte[]> backendConn;
    static RedisCommands<String, byte[]> results;
    final String queue = "celery";

    @BeforeAll
    static void startBackend() throws Exception {
        backendServer = RedisServer.startPrivate(0);
        backend = Redis.client(backendServer.uri());
        backendConn = backend.connect(Redis.CODEC);
        results = backendConn.sync();
    }

    @AfterAll
    static void stopBackend() {
        backendConn.close();
        backend.shutdown();
        backendServer.stop();
    }

    Producer producer() {
        return Producer.builder().client(client).prefix(prefix).queue(queue).build();
    }

    Worker.Builder worker() {
        return Worker.builder().client(client).prefix(prefix).queue(queue).block(Duration.ofMillis(200))
                .shutdownTimeout(Duration.ofSeconds(5)).concurrency(2).resultBackend(backend);
    }

    /** An Envelope of {@code type} asking for its result under {@code celery-task-meta-<task_id>}. */
    static Envelope.Builder asking(String type, Long expiresS) {
        Envelope.Builder b = Envelope.builder(type);
        String id = Envelope.newTaskId();
        ObjectNode celery = Json.MAPPER.createObjectNode().put("root_id", id);
        ObjectNode result = celery.putObject("result").put("key", key(id));
        if (expiresS != null) {
            result.put("expires_s", expiresS);
        }
        return b.taskId(id).ext("celery", celery);
    }

    static String key(String taskId) {
        return "celery-task-meta-" + taskId;
    }

    static String s(byte[] b) {
        return b == null ? null : new String(b, StandardCharsets.UTF_8);
    }

    /** The stored result of {@code taskId}, waited for. */
    static String awaitResult(String taskId) throws InterruptedException {
        RoundTripTest.await("the result of " + taskId, () -> results.exists(key(taskId)) == 1);
        return s(results.get(key(taskId)));
    }

    /** The document expected for {@code taskId}, dated as {@code stored} is (whose date must have the protocol's form). */
    static String expected(String stored, String status, String result, String traceback, String taskId) {
        Matcher m = DATE_DONE.matcher(stored);
        assertTrue(m.find(), "date_done is YYYY-MM-DDThh:mm:ss.ffffff+00:00 in " + stored);
        return "{\"status\":\"" + status + "\",\"result\":" + result + ",\"traceback\":" + traceback
                + ",\"children\":[],\"date_done\":\"" + m.group(1) + "\",\"task_id\":\"" + taskId + "\"}";
    }

    long streamLength() {
        long n = 0;
        for (String st : keys.taskStreams(queue)) {
            n += redis.xlen(st);
        }
        return n;
    }

    List<StreamMessage<String, byte[]>> dead() {
        return redis.xrange(keys.dead(queue), io.lettuce.core.Range.create("-", "+"));
    }

    @Test
    void aHandlersValueIsStoredWithItsLifetimeAndPublished() throws Exception {
        BlockingQueue<String> published = new LinkedBlockingQueue<>();
        Envelope e = asking("add", 600L).put("a", 2).put("b", 3).build();
        try (StatefulRedisPubSubConnection<String, String> sub = backend.connectPubSub()) {
            sub.addListener(new RedisPubSubAdapter<>() {
                @Override
                public void message(String channel, String message) {
                    published.add(channel + " " + message);
                }
            });
            sub.sync().subscribe(key(e.taskId()));
            try (Producer p = producer(); Worker w = worker().resultHandler("add",
                    t -> Map.of("sum", t.get("a").asInt() + t.get("b").asInt())).build().start()) {
                p.publish(e);
                String stored = awaitResult(e.taskId());
                assertEquals(expected(stored, "SUCCESS", "{\"sum\":5}", "null", e.taskId()), stored);
                long ttl = results.ttl(key(e.taskId()));
                assertTrue(ttl > 590 && ttl <= 600, "ttl " + ttl);
                assertEquals(key(e.taskId()) + " " + stored, published.poll(5, TimeUnit.SECONDS));
                RoundTripTest.await("the ack", () -> streamLength() == 0);
            }
        }
        assertEquals(0, redis.exists(key(e.taskId())), "the result went to the result backend, not the queues' Redis");
    }

    @Test
    void aPlainTaskHandlerGivesNullAndNoLifetimeMeansNoExpiry() throws Exception {
        Envelope e = asking("plain", null).build();
        try (Producer p = producer(); Worker w = worker().handler("plain", t -> { }).build().start()) {
            p.publish(e);
            String stored = awaitResult(e.taskId());
            assertEquals(expected(stored, "SUCCESS", "null", "null", e.taskId()), stored);
            assertEquals(-1, results.ttl(key(e.taskId())));
        }
    }

    @Test
    void aDeadLetteredTaskGetsAFailureNamingWhatTheDeadLetterNames() throws Exception {
        Envelope boom = asking("boom", 60L).build();
        Envelope unknown = asking("nobody.runs.this", 60L).build();
        try (Producer p = producer(); Worker w = worker().handler("boom", t -> {
            throw new IllegalStateException("kaput \"quoted\"");
        }).build().start()) {
            p.publish(boom);
            p.publish(unknown);
            awaitResult(boom.taskId());
            awaitResult(unknown.taskId());
            RoundTripTest.await("two dead letters", () -> dead().size() == 2);
        }
        Map<String, byte[]> deadBoom = deadLetterOf(boom.taskId());
        String stored = s(results.get(key(boom.taskId())));
        String traceback = s(deadBoom.get("traceback"));
        assertTrue(traceback.contains("kaput"), traceback);
        assertEquals("java.lang.IllegalStateException", s(deadBoom.get("exception_type")));
        assertEquals(expected(stored, "FAILURE", "{\"exc_type\":\"java.lang.IllegalStateException\","
                + "\"exc_message\":[\"kaput \\\"quoted\\\"\"],\"exc_module\":null}",
                s(Json.write(Json.MAPPER.getNodeFactory().textNode(traceback))), boom.taskId()), stored);

        Map<String, byte[]> deadUnknown = deadLetterOf(unknown.taskId());
        stored = s(results.get(key(unknown.taskId())));
        String reason = s(Json.write(Json.MAPPER.getNodeFactory().textNode(s(deadUnknown.get("reason")))));
        assertEquals(expected(stored, "FAILURE", "{\"exc_type\":\"unknown_task_type\",\"exc_message\":[" + reason
                + "],\"exc_module\":null}", "null", unknown.taskId()), stored);
    }

    Map<String, byte[]> deadLetterOf(String taskId) {
        return dead().stream().map(StreamMessage::getBody).filter(b -> taskId.equals(s(b.get("task_id"))))
                .findFirst().orElseThrow();
    }

    @Test
    void cancelledAndExpiredTasksAreRevoked() throws Exception {
        Envelope cancelled = asking("never", 60L).build();
        Envelope expired = asking("never", 60L).expires(Instant.now().minusSeconds(5)).build();
        try (Producer p = producer()) {
            p.publish(cancelled);
            p.publish(expired);
            assertEquals("marked", p.cancel(cancelled.taskId()));
            try (Worker w = worker().handler("never", t -> {
                throw new AssertionError("ran");
            }).build().start()) {
                String stored = awaitResult(cancelled.taskId());
                assertEquals(expected(stored, "REVOKED", "{\"exc_type\":\"TaskRevokedError\",\"exc_message\":"
                        + "[\"revoked\"],\"exc_module\":\"celery.exceptions\"}", "null", cancelled.taskId()), stored);
                stored = awaitResult(expired.taskId());
                assertEquals(expected(stored, "REVOKED", "{\"exc_type\":\"TaskRevokedError\",\"exc_message\":"
                        + "[\"expired\"],\"exc_module\":\"celery.exceptions\"}", "null", expired.taskId()), stored);
                RoundTripTest.await("both acknowledged", () -> streamLength() == 0);
            }
        }
        assertTrue(dead().isEmpty());
    }

    @Test
    void aDuplicateGetsSuccessWithNull() throws Exception {
        Envelope first = asking("charge", 60L).idempotencyKey("order-9").build();
        Envelope again = asking("charge", 60L).idempotencyKey("order-9").build();
        try (Producer p = producer(); Worker w = worker().concurrency(1).resultHandler("charge", t -> "charged")
                .build().start()) {
            p.publish(first);
            String stored = awaitResult(first.taskId());
            assertEquals(expected(stored, "SUCCESS", "\"charged\"", "null", first.taskId()), stored);
            p.publish(again);
            stored = awaitResult(again.taskId());
            assertEquals(expected(stored, "SUCCESS", "null", "null", again.taskId()), stored);
        }
    }

    @Test
    void aTaskTakenBackTooOftenGetsAFailure() throws Exception {
        Envelope e = asking("orphan", 60L).build();
        try (Producer p = producer()) {
            p.publish(e);
        }
        String stream = keys.stream(queue, "normal");
        redis.xgroupCreate(io.lettuce.core.XReadArgs.StreamOffset.from(stream, "0"), "workers",
                io.lettuce.core.XGroupCreateArgs.Builder.mkstream(true));
        redis.xreadgroup(io.lettuce.core.Consumer.from("workers", "ghost"),
                io.lettuce.core.XReadArgs.StreamOffset.lastConsumed(stream));
        Thread.sleep(400);
        try (Worker w = worker().lease(Duration.ofMillis(300)).maxRedeliveries(1).handler("orphan", t -> { })
                .build().start()) {
            String stored = awaitResult(e.taskId());
            assertEquals(expected(stored, "FAILURE", "{\"exc_type\":\"redelivery_limit\",\"exc_message\":"
                    + "[\"its consumer died 1 times while holding it\"],\"exc_module\":null}", "null", e.taskId()), stored);
        }
        assertEquals(1, dead().size());
        assertEquals("redelivery_limit", s(dead().get(0).getBody().get("failure_class")));
    }

    @Test
    void aWorkerWithoutBackendSaysOncePerTaskTypeThatResultsAreNotWritten() throws Exception {
        try (LogCapture log = new LogCapture(); Producer p = producer();
             Worker w = Worker.builder().client(client).prefix(prefix).queue(queue).block(Duration.ofMillis(200))
                     .handler("a", t -> { }).handler("b", t -> { }).build().start()) {
            p.publish(asking("a", 60L).build());
            p.publish(asking("a", 60L).build());
            p.publish(asking("b", 60L).build());
            p.publish(Envelope.builder("b").build());
            RoundTripTest.await("all acknowledged", () -> streamLength() == 0 && redis.xpending(
                    keys.stream(queue, "normal"), "workers").getCount() == 0);
            Thread.sleep(100);
            assertEquals(1, log.lines("tasks of type a ask for a result").size());
            assertEquals(1, log.lines("tasks of type b ask for a result").size());
        }
        assertTrue(dead().isEmpty());
    }

    @Test
    void aValueThatIsNotJsonFailsTheAttemptAsAnEncodeError() throws Exception {
        Envelope nan = asking("nan", 60L).idempotencyKey("nan-1").build();
        Envelope function = asking("function", 60L).tieredRetries().maxRetries(1L).build();
        RetryPolicy quick = new RetryPolicy(0, Duration.ofMillis(50), Duration.ofMillis(50));
        try (Producer p = producer(); Worker w = worker().retryPolicy(quick).resultHandler("nan", t -> Double.NaN)
                .resultHandler("function", t -> (Runnable) () -> { }).build().start()) {
            p.publish(nan);
            p.publish(function);
            RoundTripTest.await("two dead letters", () -> dead().size() == 2);
            awaitResult(nan.taskId());
            awaitResult(function.taskId());
        }
        Map<String, byte[]> deadNan = deadLetterOf(nan.taskId());
        assertEquals("task_error", s(deadNan.get("failure_class")));
        assertEquals("EncodeError", s(deadNan.get("exception_type")));
        assertEquals("1", s(deadNan.get("attempts")));
        String stored = s(results.get(key(nan.taskId())));
        assertEquals(expected(stored, "FAILURE", "{\"exc_type\":\"EncodeError\",\"exc_message\":"
                + "[\"the result is not JSON: NaN is not a JSON number\"],\"exc_module\":null}",
                s(Json.write(Json.MAPPER.getNodeFactory().textNode(s(deadNan.get("traceback"))))), nan.taskId()), stored);
        assertEquals(0, redis.exists(keys.idempotency("nan", "nan-1")), "the claim of a failed attempt is released");

        Map<String, byte[]> deadFunction = deadLetterOf(function.taskId());
        assertEquals("EncodeError", s(deadFunction.get("exception_type")));
        assertEquals("2", s(deadFunction.get("attempts")), "retried as a task error");
        stored = s(results.get(key(function.taskId())));
        assertTrue(stored.startsWith("{\"status\":\"FAILURE\",\"result\":{\"exc_type\":\"EncodeError\","
                + "\"exc_message\":[\"the result is not JSON: a function ("), stored);
    }

    @Test
    void zeroMeansNoExpiryAndAFractionIsRoundedUp() throws Exception {
        Envelope none = asking("plain", 0L).build();
        String id = Envelope.newTaskId();
        ObjectNode celery = Json.MAPPER.createObjectNode();
        celery.putObject("result").put("key", key(id)).put("expires_s", new java.math.BigDecimal("1.25"));
        Envelope fraction = Envelope.builder("plain").taskId(id).ext("celery", celery).build();
        try (Producer p = producer(); Worker w = worker().handler("plain", t -> { }).build().start()) {
            p.publish(none);
            p.publish(fraction);
            awaitResult(fraction.taskId());
            long ttl = results.pttl(key(fraction.taskId()));
            assertTrue(ttl > 1000 && ttl <= 2000, "expires_s 1.25 is 2 s: " + ttl);
            awaitResult(none.taskId());
            assertEquals(-1, results.ttl(key(none.taskId())), "expires_s 0: no expiry");
        }
    }

    @Test
    void aMalformedResultRequestIsLoggedAndTheTaskStillSucceeds() throws Exception {
        ObjectNode celery = Json.MAPPER.createObjectNode();
        celery.putObject("result").put("key", "k").put("expires_s", -1);
        Envelope e = Envelope.builder("x").ext("celery", celery).build();
        try (LogCapture log = new LogCapture(); Producer p = producer();
             Worker w = worker().handler("x", t -> { }).build().start()) {
            p.publish(e);
            RoundTripTest.await("acknowledged", () -> streamLength() == 0);
            RoundTripTest.await("logged", () -> !log.lines("ext.celery.result.expires_s").isEmpty());
        }
        assertNull(results.get("k"));
        assertTrue(dead().isEmpty());
    }

    @Test
    void aResultIsWrittenBeforeTheAckOnceTheBackendIsBack() throws Exception {
        RedisServer down = RedisServer.startPrivate(0);
        int port = down.port;
        RedisServer back = null;
        RedisClient flaky = Redis.client(down.uri());
        Envelope e = asking("slow.backend", 60L).build();
        try (Producer p = producer();
             Worker w = worker().resultBackend(flaky).resultHandler("slow.backend", t -> 42).build().start()) {
            down.stop();
            p.publish(e);
            Thread.sleep(700);
            assertEquals(1, streamLength(), "acknowledged before its result was written");
            back = RedisServer.startPrivate(port);
            RoundTripTest.await("the ack", () -> streamLength() == 0);
            try (StatefulRedisConnection<String, byte[]> c = flaky.connect(Redis.CODEC)) {
                String stored = s(c.sync().get(key(e.taskId())));
                assertEquals(expected(stored, "SUCCESS", "42", "null", e.taskId()), stored);
            }
        } finally {
            flaky.shutdown();
            if (back != null) {
                back.stop();
            }
        }
        assertTrue(dead().isEmpty());
    }
}
