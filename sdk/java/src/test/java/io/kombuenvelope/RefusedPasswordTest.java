package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.Timeout;

/**
 * A refused password is not an outage (protocol section 5): it fails at once with the error that
 * names it, however long the outage tolerance.
 */
@Timeout(value = 60, threadMode = Timeout.ThreadMode.SEPARATE_THREAD)
class RefusedPasswordTest {
    static RedisServer data;

    @BeforeAll
    static void start() throws Exception {
        data = RedisServer.startWith("--requirepass", "right");
    }

    @AfterAll
    static void stop() {
        data.stop();
    }

    @Test
    void aWrongPasswordFailsAtOnce() {
        long started = System.nanoTime();
        RuntimeException e = assertThrows(RuntimeException.class, () -> {
            try (Producer p = Producer.builder().redisUri("redis://:wrong@127.0.0.1:" + data.port)
                    .outageTolerance(Duration.ofSeconds(30)).queue("jobs").build()) {
                p.publish(Envelope.builder("pw.t").build());
            }
        });
        assertFast(started, e);
    }

    private static void assertFast(long started, RuntimeException e) {
        long ms = Duration.ofNanos(System.nanoTime() - started).toMillis();
        assertTrue(ms < 10_000, "took " + ms + " ms, within the 30 s outage tolerance: retried as an outage");
        assertFalse(Redis.isOutage(e), "classified as an outage: " + e);
        StringBuilder all = new StringBuilder();
        for (Throwable t = e; t != null; t = t.getCause()) {
            all.append(t.getMessage()).append(" / ");
        }
        assertTrue(all.toString().contains("WRONGPASS"), "does not name the refusal: " + all);
    }
}
