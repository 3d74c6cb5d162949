package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.ClientOptions;
import io.lettuce.core.RedisClient;
import io.lettuce.core.RedisURI;
import io.lettuce.core.api.StatefulRedisConnection;
import io.lettuce.core.protocol.ProtocolVersion;
import io.lettuce.core.resource.ClientResources;
import io.lettuce.core.resource.Delay;
import io.lettuce.core.resource.DefaultClientResources;

import java.time.Duration;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;

import org.junit.jupiter.api.Test;

/** What a worker takes over, and when (docs/protocol.md sections 5 and 9), against a real redis-server. */
class TakeoverTest {
    static final Duration LEASE = Duration.ofMillis(1500);

    /** A client of its own that reconnects {@code every} after losing its server (buffering commands meanwhile). */
    record OwnClient(ClientResources resources, RedisClient client) implements AutoCloseable {
        static OwnClient reconnectingEvery(String uri, Duration every) {
            ClientResources r = DefaultClientResources.builder().reconnectDelay(Delay.constant(every)).build();
            RedisClient c = RedisClient.create(r, RedisURI.create(uri));
            c.setOptions(ClientOptions.builder().protocolVersion(ProtocolVersion.RESP2).autoReconnect(true).build());
            return new OwnClient(r, c);
        }

        @Override
        public void close() {
            client.shutdown(Duration.ZERO, Duration.ofSeconds(2));
            resources.shutdown(0, 2, TimeUnit.SECONDS);
        }
    }

    static Worker.Builder worker(RedisClient client, AtomicInteger ran, CountDownLatch started, CountDownLatch release) {
        return Worker.builder().client(client).prefix("drill").queue("q").concurrency(1).lease(LEASE)
                .block(Duration.ofMillis(200)).shutdownTimeout(Duration.ofSeconds(5)).runPromoter(false)
                .handler("slow", t -> {
                    ran.incrementAndGet();
                    started.countDown();
                    release.await(20, TimeUnit.SECONDS);
                });
    }

    /**
     * Redis is killed and restarted later than a lease, so every liveness key has expired. The
     * other worker reconnects first and its renewal, queued through the outage, is answered: it
     * must not count, or that worker takes over the entry of the live one before it renews.
     */
    @Test
    void anEntryOfALiveWorkerIsNotTakenOverAfterAnOutage() throws Exception {
        RedisServer server = RedisServer.durable(0, null);
        int port = server.port;
        RedisServer restarted = null;
        AtomicInteger ranA = new AtomicInteger();
        AtomicInteger ranB = new AtomicInteger();
        CountDownLatch startedA = new CountDownLatch(1);
        CountDownLatch release = new CountDownLatch(1);
        try (OwnClient slow = OwnClient.reconnectingEvery(server.uri(), Duration.ofMillis(600));
             OwnClient fast = OwnClient.reconnectingEvery(server.uri(), Duration.ofMillis(30));
             Producer p = Producer.builder().client(fast.client()).prefix("drill").queue("q").build();
             Worker a = worker(slow.client(), ranA, startedA, release).build().start()) {
            p.publish(Envelope.builder("slow").build());
            assertTrue(startedA.await(5, TimeUnit.SECONDS), "worker A never started the task");
            try (Worker b = worker(fast.client(), ranB, new CountDownLatch(1), release).build().start()) {
                Thread.sleep(LEASE.toMillis() / 3 * 2 + 200); // B has renewed twice in a row
                server.kill();
                Thread.sleep(LEASE.toMillis() + 400); // every liveness key expires meanwhile
                restarted = RedisServer.durable(port, server.dir());
                Thread.sleep(1500); // time enough for B to take the entry over, were it allowed to
                release.countDown();
                try (StatefulRedisConnection<String, byte[]> c = fast.client().connect(Redis.CODEC)) {
                    String stream = new Keys("drill").stream("q", "normal");
                    long deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(5);
                    while (c.sync().xpending(stream, Keys.DEFAULT_GROUP).getCount() > 0
                            && System.nanoTime() < deadline) {
                        Thread.sleep(20);
                    }
                    assertEquals(0, c.sync().xpending(stream, Keys.DEFAULT_GROUP).getCount(), "the entry stayed pending");
                }
                Thread.sleep(300);
                assertEquals(0, ranB.get(), "worker B took over the entry of live worker A");
                assertEquals(1, ranA.get(), "the handler ran more than once");
            }
        } finally {
            release.countDown();
            if (restarted != null) {
                restarted.stop();
            } else {
                server.stop();
            }
        }
    }

    /**
     * A busy claim's holder whose liveness key is missing at the first look but set again within
     * one renewal interval (a live holder renewing once Redis answers) keeps its claim; one whose
     * key stays missing loses it.
     */
    @Test
    void aClaimIsTakenOverOnlyWhenItsHolderKeyStaysMissing() throws Exception {
        RedisServer server = RedisServer.startPrivate(0);
        Keys keys = new Keys("claims");
        RedisClient client = Redis.client(server.uri());
        try (StatefulRedisConnection<String, byte[]> c = client.connect(Redis.CODEC);
             Link link = Link.open(client, Link.Durability.NONE);
             Liveness liveness = new Liveness(client, link, keys, "me", "h 1 java".getBytes(), LEASE.toMillis())) {
            assertTrue(liveness.renew() && liveness.renew(), "renewals on an idle server were not answered at once");
            Thread back = new Thread(() -> {
                try {
                    Thread.sleep(liveness.intervalMs() / 3);
                    c.sync().set(keys.consumer("holder"), "h 2 java".getBytes());
                } catch (InterruptedException e) {
                    Thread.currentThread().interrupt();
                }
            });
            long start = System.nanoTime();
            back.start();
            boolean gone = liveness.holderGone("holder");
            back.join();
            assertTrue(System.nanoTime() - start >= TimeUnit.MILLISECONDS.toNanos(liveness.intervalMs()),
                    "the second look came before one renewal interval");
            assertTrue(!gone, "the claim of a holder that renewed within the interval would be taken over");

            c.sync().del(keys.consumer("holder"));
            assertTrue(liveness.holderGone("holder"), "the claim of a holder whose key stays missing is kept");
        } finally {
            client.shutdown();
            server.stop();
        }
    }
}
