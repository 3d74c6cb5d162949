package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotNull;

import io.lettuce.core.RedisClient;
import io.lettuce.core.api.StatefulRedisConnection;

import java.time.Duration;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.TimeUnit;

import org.junit.jupiter.api.Test;

/** A publish made while Redis is down is retried with its token and stored once it is back. */
class OutageTest {
    @Test
    void aPublishWaitsOutAShortOutage() throws Exception {
        RedisServer server = RedisServer.startPrivate(0);
        int port = server.port;
        RedisServer restarted = null;
        RedisClient client = Redis.client("redis://127.0.0.1:" + port);
        try (Producer p = Producer.builder().client(client).prefix("outage").queue("q")
                .outageTolerance(Duration.ofSeconds(20)).build()) {
            p.publish(Envelope.builder("warmup").build());
            server.stop();
            CompletableFuture<PublishResult> pending = CompletableFuture.supplyAsync(
                    () -> p.publish(Envelope.builder("during.outage").build()));
            Thread.sleep(700);
            restarted = RedisServer.startPrivate(port);
            PublishResult r = pending.get(30, TimeUnit.SECONDS);
            assertNotNull(r.entryId());
            try (StatefulRedisConnection<String, byte[]> c = client.connect(Redis.CODEC)) {
                assertEquals(1, c.sync().xlen(new Keys("outage").stream("q", "normal")));
            }
        } finally {
            client.shutdown();
            if (restarted != null) {
                restarted.stop();
            }
        }
    }
}
