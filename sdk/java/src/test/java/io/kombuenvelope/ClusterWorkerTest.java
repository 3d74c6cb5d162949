package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.cluster.RedisClusterClient;

import java.io.IOException;
import java.time.Duration;
import java.util.Set;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.MethodOrderer;
import org.junit.jupiter.api.Order;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestMethodOrder;
import org.junit.jupiter.api.Timeout;

/**
 * A worker starting on a Cluster while a primary is dead or stalled. Each test runs in a thread
 * of its own, so a step that never returns still fails at the timeout, with that thread's stack.
 */
@TestMethodOrder(MethodOrderer.OrderAnnotation.class)
@Timeout(value = 60, threadMode = Timeout.ThreadMode.SEPARATE_THREAD)
class ClusterWorkerTest {
    static ClusterGroup cluster;
    static RedisClusterClient client;

    @BeforeAll
    static void startCluster() throws Exception {
        cluster = ClusterGroup.start();
        client = (RedisClusterClient) RedisUrl.client(cluster.url());
        try (var c = client.connect()) { // the slot map known, and Lettuce's classes loaded, before a node dies
            c.sync().ping();
        }
    }

    @AfterAll
    static void stopCluster() {
        if (client != null) {
            client.shutdown();
        }
        if (cluster != null) {
            cluster.close();
        }
    }

    @Test
    @Order(1)
    void aWorkerStartingWhileThePrimaryOfItsQueueIsDeadWaitsForTheFailover() throws Exception {
        Keys keys = new Keys("starting");
        int slot = cluster.slot(keys.stream("jobs", "normal"));
        int dead = cluster.primaryOf(slot);
        Set<String> ran = ConcurrentHashMap.newKeySet();
        // No failover until the start has met the dead primary: otherwise one that completes within
        // the first command's timeout leaves nothing to wait for.
        cluster.holdFailovers(true);
        cluster.server(dead).kill();
        try (LogCapture log = new LogCapture()) {
            CompletableFuture<Void> release = CompletableFuture.runAsync(() -> releaseFailoversOnceLogged(log));
            try (Worker w = Worker.builder().client(client).prefix("starting").queue("jobs")
                    .block(Duration.ofMillis(200)).lease(Duration.ofMillis(1500))
                    .handler("job.run", t -> ran.add(t.get("k").asText())).build().start()) {
                release.join();
                cluster.awaitFailover(slot, dead);
                try (Producer p = Producer.builder().client(client).prefix("starting").queue("jobs").build()) {
                    p.publish(Envelope.builder("job.run").put("k", "after").build());
                }
                SentinelGroup.await("the task ran", () -> ran.contains("after"));
                assertTrue(w.isReading(), "the worker reads");
            }
        } finally {
            cluster.holdFailovers(false);
        }
    }

    @Test
    @Order(2)
    void aWorkerStartsAndRunsWithinSecondsWhileAPrimaryIsStalled() throws Exception {
        Keys keys = new Keys("stalled");
        int promoted = cluster.primaryOf(cluster.slot(new Keys("starting").stream("jobs", "normal")));
        assertTrue(promoted > 0, "the cluster serves the slot of the first test's queue");
        String queue = queueServedByAnotherPrimary(keys, promoted);
        RedisServer stalled = cluster.server(cluster.primaryOf(cluster.slot(keys.stream(queue, "normal"))));
        Set<String> ran = ConcurrentHashMap.newKeySet();
        RedisClusterClient fresh = (RedisClusterClient) RedisUrl.client(cluster.url());
        stalled.pause();
        try {
            long started = System.nanoTime();
            try (Worker w = Worker.builder().client(fresh).prefix("stalled").queue(queue)
                    .block(Duration.ofMillis(200)).lease(Duration.ofMillis(1500))
                    .handler("job.run", t -> ran.add(t.get("k").asText())).build().start();
                 Producer p = Producer.builder().client(client).prefix("stalled").queue(queue).build()) {
                p.publish(Envelope.builder("job.run").put("k", "during").build());
                SentinelGroup.await("the task ran", () -> ran.contains("during"));
                long ms = (System.nanoTime() - started) / 1_000_000;
                System.out.printf("start and first task with a stalled primary: %d ms%n", ms);
                // At most three 5 s timeouts: the first slot map read (from the stalled node, if a
                // seed), the first command sent to it as the primary, the slot map read again; one
                // slot map read took 60 s when the seeds had Lettuce's default timeout.
                assertTrue(ms < 25_000, "starting and running one task took " + ms + " ms");
            }
        } finally {
            stalled.resume();
            fresh.shutdown();
        }
    }

    /** Lets replicas take over once the worker has logged that its start waits for Redis, and for how long. */
    private static void releaseFailoversOnceLogged(LogCapture log) {
        try {
            SentinelGroup.await("the start's wait and its bound logged", Duration.ofSeconds(40), () -> !log.lines(
                    "while starting failed; Redis is unreachable or failing over, retrying for up to 30000 ms").isEmpty());
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            throw new IllegalStateException(e);
        } finally {
            cluster.holdFailovers(false);
        }
    }

    /** A queue whose stream a live primary other than {@code avoid} serves (one that still has its replica). */
    private static String queueServedByAnotherPrimary(Keys keys, int avoid) throws IOException {
        for (int i = 0; i < 64; i++) {
            String queue = "jobs" + i;
            int primary = cluster.primaryOf(cluster.slot(keys.stream(queue, "normal")));
            if (primary > 0 && primary != avoid) {
                return queue;
            }
        }
        throw new AssertionError("none of 64 queues is served by a live primary other than " + avoid);
    }
}
