package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.cluster.RedisClusterClient;

import java.time.Duration;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.MethodOrderer;
import org.junit.jupiter.api.Order;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestMethodOrder;
import org.junit.jupiter.api.Timeout;
import org.junit.jupiter.api.condition.EnabledIfEnvironmentVariable;

/**
 * A worker starting on a Cluster while a primary is dead or stalled. A long drill, run with
 * {@code KOMBU_ENVELOPE_LONG_DRILLS=1} (the suite's four-language Cluster drill starts Java
 * workers during the same faults in every run): on a loaded machine a start during the stall
 * has been seen to hang, which the timeout turns into a failure.
 */
@TestMethodOrder(MethodOrderer.OrderAnnotation.class)
@EnabledIfEnvironmentVariable(named = "KOMBU_ENVELOPE_LONG_DRILLS", matches = "1")
@Timeout(120)
class ClusterWorkerTest {
    static ClusterGroup cluster;
    static RedisClusterClient client;

    @BeforeAll
    static void startCluster() throws Exception {
        cluster = ClusterGroup.start();
        client = (RedisClusterClient) RedisUrl.client(cluster.url());
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
        cluster.server(dead).kill();
        try (LogCapture log = new LogCapture();
             Worker w = Worker.builder().client(client).prefix("starting").queue("jobs")
                     .block(Duration.ofMillis(200)).lease(Duration.ofMillis(1500))
                     .handler("job.run", t -> ran.add(t.get("k").asText())).build().start()) {
            cluster.awaitFailover(slot, dead);
            try (Producer p = Producer.builder().client(client).prefix("starting").queue("jobs").build()) {
                p.publish(Envelope.builder("job.run").put("k", "after").build());
            }
            SentinelGroup.await("the task ran", () -> ran.contains("after"));
            assertTrue(w.isReading(), "the worker reads");
            assertFalse(log.lines("while starting failed; Redis is unreachable or failing over, retrying for up to "
                    + "30000 ms").isEmpty(), "the wait and its bound are logged");
        }
    }

    @Test
    @Order(2)
    void aWorkerStartsAndRunsWithinSecondsWhileAPrimaryIsStalled() throws Exception {
        Keys keys = new Keys("stalled");
        String queue = "jobs";
        for (int i = 0; cluster.primaryOf(cluster.slot(keys.stream(queue, "normal"))) <= 0
                || cluster.primaryOf(cluster.slot(keys.stream(queue, "normal")))
                == cluster.primaryOf(cluster.slot(new Keys("starting").stream("jobs", "normal"))); i++) {
            queue = "jobs" + i;
        }
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
                assertTrue(ms < 15_000, "starting and running one task took " + ms + " ms");
            }
        } finally {
            stalled.resume();
            fresh.shutdown();
        }
    }
}
