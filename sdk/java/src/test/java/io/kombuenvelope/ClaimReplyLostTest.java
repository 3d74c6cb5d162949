package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.RedisClient;

import java.time.Duration;
import java.util.List;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

import org.junit.jupiter.api.Test;

/**
 * An idempotency claim that lands in Redis but whose reply is lost (docs/protocol.md section 9):
 * the entry is handed back and the claim released, so another consumer runs the task at once.
 */
class ClaimReplyLostTest extends RedisFixture {
    private static final String QUEUE = "q";

    /** Whether {@code command} runs idem_begin.lua. */
    private static boolean claims(List<String> command) {
        Scripts.Script s = Scripts.get("idem_begin");
        String name = command.get(0);
        return command.size() > 1 && (name.equalsIgnoreCase("EVALSHA") && command.get(1).equals(s.sha())
                || name.equalsIgnoreCase("EVAL") && command.get(1).equals(s.source()));
    }

    private Worker.Builder worker(RedisClient c, String consumer, AtomicInteger effects) {
        return Worker.builder().client(c).prefix(prefix).queue(QUEUE).consumer(consumer).concurrency(1)
                .lease(Duration.ofMillis(1500)).block(Duration.ofMillis(200)).deferDelay(Duration.ofMillis(200))
                .shutdownTimeout(Duration.ofSeconds(2))
                .handler("effect", t -> effects.incrementAndGet());
    }

    @Test
    void aClaimWhoseReplyWasLostIsReleasedWithTheHandBack() throws Exception {
        AtomicInteger effects = new AtomicInteger();
        String claimKey = keys.idempotency("effect", "o-1");
        try (ReplyLosingProxy proxy = new ReplyLosingProxy(RedisServer.shared().port, ClaimReplyLostTest::claims)) {
            RedisClient viaProxy = Redis.client(proxy.uri());
            try (Producer p = Producer.builder().client(client).prefix(prefix).queue(QUEUE).build();
                 Worker a = worker(viaProxy, "a", effects).runPromoter(false).build().start()) {
                p.publish(Envelope.builder("effect").idempotencyKey("o-1").build());
                assertTrue(proxy.lost().await(5, TimeUnit.SECONDS), "the claim of worker a was never made");
                RoundTripTest.await("the entry handed back", () -> redis.zcard(keys.delayed(QUEUE)) == 1
                        && redis.xpending(keys.stream(QUEUE, "normal"), Keys.DEFAULT_GROUP).getCount() == 0);
                assertEquals(0, redis.exists(claimKey), "the claim was left behind");
            } finally {
                viaProxy.shutdown();
            }
        }
        // Worker a lives on as far as others can tell (a consumer that reads other queues now):
        // a claim it left behind would defer the task on b until the claim expired.
        redis.psetex(keys.consumer("a"), 10_000, Redis.b("h 1 java"));
        assertEquals(0, effects.get(), "the task ran although its claim failed");
        assertEquals(0, redis.xlen(keys.dead(QUEUE)), "the task was dead-lettered");

        try (Worker b = worker(client, "b", effects).build().start()) {
            RoundTripTest.await("the task run by worker b", () -> effects.get() == 1
                    && redis.xpending(keys.stream(QUEUE, "normal"), Keys.DEFAULT_GROUP).getCount() == 0);
        }
        assertEquals(1, effects.get(), "the effect happened more than once");
        assertEquals(0, redis.zcard(keys.delayed(QUEUE)), "the task is still delayed");
        assertEquals(0, redis.xlen(keys.dead(QUEUE)), "the task was dead-lettered");
        assertTrue(Redis.s(redis.get(claimKey)).startsWith("done "), "the key is not marked done");
    }
}
