package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.RedisException;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

import org.junit.jupiter.api.Test;

/** Payload schemas at publish and at the worker (docs/protocol.md section 16), against a real redis-server. */
class PayloadSchemaTest extends RedisFixture {
    static final String ORDER = "{\"type\":\"object\",\"required\":[\"order_id\"],\"additionalProperties\":false,"
            + "\"properties\":{\"order_id\":{\"type\":\"integer\"}}}";
    final String queue = "orders";

    Producer producer() {
        return Producer.builder().client(client).prefix(prefix).queue(queue).build();
    }

    Worker.Builder worker(AtomicInteger ran, CountDownLatch done) {
        return Worker.builder().client(client).prefix(prefix).queue(queue).block(Duration.ofMillis(200))
                .lease(Duration.ofMillis(1500)).shutdownTimeout(Duration.ofSeconds(5)).runPromoter(false)
                .handler("order", t -> {
                    ran.incrementAndGet();
                    done.countDown();
                });
    }

    void register(String field, String schema) {
        redis.hset(keys.schemas(), field, Redis.b(schema));
    }

    @Test
    void aPublishBreakingTheSchemaIsRefusedWithEveryViolation() {
        register("order@1", ORDER);
        try (Producer p = producer()) {
            EnvelopeValidationException e = assertThrows(EnvelopeValidationException.class, () -> p.publish(
                    Envelope.builder("order").put("order_id", "7").put("colour", "red").build()));
            assertEquals(List.of("payload.colour schema", "payload.order_id schema"),
                    e.violations().stream().map(v -> v.field() + " " + v.rule()).toList());
            assertEquals("payload.colour", e.field());

            EnvelopeValidationException batch = assertThrows(EnvelopeValidationException.class, () -> p.publishAll(List.of(
                    Envelope.builder("order").taskId("good-1").put("order_id", 1).build(),
                    Envelope.builder("order").build())));
            assertEquals("payload.order_id", batch.field());
            assertEquals("unknown", p.getTask(queue, "good-1").state(), "a refused batch stores nothing");

            assertTrue(p.publish(Envelope.builder("order").put("order_id", 1).build()).entryId() != null);
            assertTrue(p.publish(Envelope.builder("order").payloadVersion(2).put("any", true).build()).entryId() != null,
                    "another version has no schema");
        }
    }

    @Test
    void aSchemaThatCannotBeCompiledIsLoggedAndIgnored() {
        register("order@1", "{\"properties\":{\"code\":{\"pattern\":\"(\"}}}");
        register("other@1", "{\"$ref\":\"https://example.com/remote.json\"}");
        try (LogCapture log = new LogCapture(); Producer p = producer()) {
            assertTrue(p.publish(Envelope.builder("order").put("code", "x").build()).entryId() != null);
            assertTrue(p.publish(Envelope.builder("other").build()).entryId() != null);
            assertFalse(log.lines("payload schema order@1 is ignored").isEmpty());
            assertFalse(log.lines("payload schema other@1 is ignored").isEmpty());
        }
    }

    @Test
    void theWorkerDeadLettersAPayloadBreakingItsSchemaWithoutRunningIt() throws Exception {
        AtomicInteger ran = new AtomicInteger();
        try (Producer p = producer();
             DeadLetters dl = DeadLetters.builder().client(client).prefix(prefix).build()) {
            String id = p.publish(Envelope.builder("order").put("order_id", "7").build()).taskId();
            register("order@1", ORDER); // registered after the publish: the worker still checks it
            try (Worker w = worker(ran, new CountDownLatch(1)).build().start()) {
                TaskRecordsTest.await("the dead letter", () -> dl.count(queue) == 1);
            }
            DeadLetter d = dl.list(queue, 1).get(0);
            assertEquals("invalid_payload", d.failure().get("failure_class"));
            assertTrue(d.failure().get("reason").startsWith("schema: payload.order_id: "), d.failure().get("reason"));
            assertEquals(0, ran.get(), "the handler ran");
            assertEquals("dead", p.getTask(queue, id).state());
            assertEquals(0, redis.zcard(keys.delayed(queue)), "it was retried");
        }
    }

    @Test
    void theWorkerRunsUncheckedWhenTheSchemasCannotBeRead() throws Exception {
        AtomicInteger ran = new AtomicInteger();
        CountDownLatch done = new CountDownLatch(1);
        try (Producer p = producer()) {
            p.publish(Envelope.builder("order").put("order_id", "7").build());
            redis.set(keys.schemas(), Redis.b("not a hash")); // every HGETALL now fails
            try (Producer fresh = producer()) {
                assertThrows(RedisException.class, () -> fresh.publish(Envelope.builder("order").build()),
                        "a producer that cannot read the schemas refuses the publish");
            }
            p.publish(Envelope.builder("order").put("order_id", "8").build()); // schemas read 0 s ago: cached
            try (LogCapture log = new LogCapture(); Worker w = worker(ran, done).build().start()) {
                assertTrue(done.await(10, TimeUnit.SECONDS), "the task did not run");
                assertFalse(log.lines("reading the payload schemas failed; the task runs unchecked").isEmpty());
            }
        }
    }

    @Test
    void theDeadLetterReasonJoinsViolationsAndIsCutTo1000Characters() {
        List<SchemaViolation> many = new ArrayList<>();
        for (int i = 0; i < 100; i++) {
            many.add(new SchemaViolation("payload.f" + i, "type", "string found, integer expected"));
        }
        String reason = PayloadSchemas.deadLetterReason(many);
        assertEquals(1000, reason.length());
        assertTrue(reason.startsWith("schema: payload.f0: string found, integer expected; payload.f1: "), reason);
        assertEquals("schema: payload: must have at least 1 properties",
                PayloadSchemas.deadLetterReason(List.of(new SchemaViolation("payload", "minProperties",
                        "must have at least 1 properties"))));
    }
}
