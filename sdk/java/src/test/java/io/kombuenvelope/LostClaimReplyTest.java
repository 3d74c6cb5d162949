package io.kombuenvelope;

import static io.kombuenvelope.RoundTripTest.await;
import static io.kombuenvelope.RoundTripTest.s;
import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;

import org.junit.jupiter.api.Test;

/**
 * An idempotency claim that ran on Redis but whose reply never came back (docs/protocol.md
 * section 9): the worker releases it before handing the entry back, against a real redis-server.
 */
class LostClaimReplyTest extends RedisFixture {
    final String queue = "jobs";

    /**
     * Each idem_begin.lua reply is cut, Lettuce's resends after reconnecting too, until the command
     * times out. The free key's claim landed and is released; the other key, held by a live
     * consumer, was never this worker's: its release answers 0, which is no takeover.
     */
    @Test
    void aClaimWhoseReplyIsLostIsReleasedAndTheTaskRunsOnceLater() throws Exception {
        String free = keys.idempotency("charge", "lost-1");
        String held = keys.idempotency("charge", "lost-2");
        redis.set(keys.consumer("other"), "h 1 go".getBytes());
        redis.set(held, "running other someid".getBytes());
        Scripts.Script begin = Scripts.get("idem_begin");
        redis.scriptLoad(begin.source()); // so that the claim is one EVALSHA, the request the proxy knows
        List<String> ran = new CopyOnWriteArrayList<>();
        try (Producer p = Producer.builder().client(client).prefix(prefix).queue(queue).build()) {
            p.publish(Envelope.builder("charge").idempotencyKey("lost-1").build());
            p.publish(Envelope.builder("charge").idempotencyKey("lost-2").build());
        }
        try (LogCapture log = new LogCapture();
             ReplyCuttingProxy proxy = new ReplyCuttingProxy(RedisServer.shared().port);
             TakeoverTest.OwnClient own = TakeoverTest.OwnClient.reconnectingEvery(proxy.uri(), Duration.ofMillis(100))) {
            proxy.arm(begin.sha());
            try (Worker w = Worker.builder().client(own.client()).prefix(prefix).queue(queue).concurrency(2)
                    .block(Duration.ofMillis(200)).shutdownTimeout(Duration.ofSeconds(5))
                    .deferDelay(Duration.ofSeconds(2))
                    .handler("charge", t -> ran.add(t.envelope().idempotencyKey())).build().start()) {
                await("both claims to fail", () -> log.lines("idempotency claim failed").size() == 2);
                await("both entries handed back", () -> redis.zcard(keys.delayed(queue)) == 2);
                assertTrue(proxy.cuts() >= 1, "no reply of idem_begin.lua was cut");
                assertEquals(0, redis.exists(free), "the claim that landed was not released");
                assertEquals("running other someid", s(redis.get(held)), "another consumer's claim was released");
                assertEquals(List.of(), ran, "ran without a claim");
                proxy.disarm();
                redis.del(held, keys.consumer("other"));
                await("both tasks to run", () -> ran.size() == 2 && redis.zcard(keys.delayed(queue)) == 0
                        && streamLength() == 0);
                Thread.sleep(300);
            }
            assertEquals(List.of("lost-1", "lost-2"), ran.stream().sorted().toList());
            assertEquals(List.of(), log.lines("taken over"), "a release of a claim that never landed was logged as a takeover");
        }
    }

    private long streamLength() {
        long n = 0;
        for (String st : keys.taskStreams(queue)) {
            n += redis.xlen(st);
        }
        return n;
    }
}
