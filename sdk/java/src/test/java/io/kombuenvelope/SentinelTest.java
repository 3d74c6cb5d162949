package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.RedisClient;

import java.time.Duration;
import java.util.List;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.ConcurrentHashMap;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.MethodOrderer;
import org.junit.jupiter.api.Order;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestMethodOrder;

/** The SDK behind Sentinel: a primary, two replicas, three sentinels; the failover drill runs last. */
@TestMethodOrder(MethodOrderer.OrderAnnotation.class)
class SentinelTest {
    static SentinelGroup group;
    static RedisClient client;

    @BeforeAll
    static void startGroup() throws Exception {
        group = SentinelGroup.start();
        client = (RedisClient) RedisUrl.client(group.url());
    }

    @AfterAll
    static void stopGroup() {
        if (client != null) {
            client.shutdown();
        }
        if (group != null) {
            group.close();
        }
    }

    static String prefix() {
        return "s" + UUID.randomUUID().toString().substring(0, 8);
    }

    @Test
    @Order(1)
    void immediateAndDelayedTasksMakeTheRoundTrip() throws Exception {
        String prefix = prefix();
        Set<String> ran = ConcurrentHashMap.newKeySet();
        try (Producer p = Producer.builder().redisUri(group.url()).prefix(prefix).queue("jobs")
                .waitReplicas(2, Duration.ofSeconds(2)).build();
             Worker w = Worker.builder().client(client).prefix(prefix).queue("jobs").block(Duration.ofMillis(200))
                     .waitReplicas(1, Duration.ofSeconds(2))
                     .handler("job.run", t -> ran.add(t.get("k").asText())).build().start()) {
            p.publish(Envelope.builder("job.run").put("k", "now").build());
            assertTrue(p.publishIn(Envelope.builder("job.run").put("k", "later").build(), Duration.ofMillis(300)).delayed());
            SentinelGroup.await("both tasks ran", () -> ran.containsAll(Set.of("now", "later")));
        }
    }

    @Test
    @Order(2)
    void aWaitAnsweringFewerReplicasIsLoggedAndThePublishStands() throws Exception {
        String prefix = prefix();
        try (LogCapture log = new LogCapture();
             Producer p = Producer.builder().client(client).prefix(prefix).queue("jobs")
                     .waitReplicas(3, Duration.ofMillis(100)).build()) {
            PublishResult r = p.publish(Envelope.builder("job.run").build());
            assertEquals(1, log.lines("WAIT answered 2 of 3 replicas").size());
            assertEquals(1L, Long.parseLong(SentinelGroup.node(group.primaryPort()).text("XLEN",
                    new Keys(prefix).stream("jobs", "normal"))));
            assertFalse(r.delayed());
        }
    }

    @Test
    @Order(3)
    void aPrimaryDemotedByAFailoverIsLeftForTheNewOne() throws Exception {
        String prefix = prefix();
        Set<String> ran = ConcurrentHashMap.newKeySet();
        try (Producer p = Producer.builder().client(client).prefix(prefix).queue("jobs").build();
             Worker w = Worker.builder().client(client).prefix(prefix).queue("jobs").block(Duration.ofMillis(200))
                     .handler("job.run", t -> ran.add(t.get("k").asText())).build().start()) {
            p.publish(Envelope.builder("job.run").put("k", "before").build());
            SentinelGroup.await("the first task ran", () -> ran.contains("before"));
            int old = group.primaryPort();
            Resp.at(group.sentinels.get(0).port, SentinelGroup.SENTINEL_PASSWORD).call("SENTINEL", "FAILOVER",
                    SentinelGroup.MASTER);
            group.awaitFailover(old);
            SentinelGroup.await("the old primary serves as a replica",
                    () -> SentinelGroup.info(old, "replication").contains("role:slave"));
            p.publish(Envelope.builder("job.run").put("k", "after").build());
            p.publishIn(Envelope.builder("job.run").put("k", "after-delayed").build(), Duration.ofMillis(200));
            SentinelGroup.await("the tasks published after the failover ran",
                    () -> ran.containsAll(Set.of("after", "after-delayed")));
            assertTrue(w.isReading(), "the worker still reads");
        }
    }

    @Test
    @Order(4)
    void aWorkerAndItsPublishersSurviveTheLossOfThePrimary() throws Exception {
        String prefix = prefix();
        try (FailoverDrill drill = new FailoverDrill();
             Worker w = Worker.builder().redisUri(group.url()).prefix(prefix).queue("drill").concurrency(4)
                     .block(Duration.ofMillis(200)).handler(FailoverDrill.TASK_TYPE, drill.handler()).build().start();
             Producer withWait = Producer.builder().redisUri(group.url()).prefix(prefix).queue("drill")
                     .waitReplicas(1, Duration.ofSeconds(1)).build();
             Producer without = Producer.builder().redisUri(group.url()).prefix(prefix).queue("drill").build()) {
            drill.publish("wait", withWait, List.of("drill"));
            drill.publish("plain", without, List.of("drill"));
            Thread.sleep(1500);
            int old = group.primaryPort();
            group.server(old).kill();
            group.awaitFailover(old);
            int atFailover = drill.published("wait") + drill.published("plain");
            Thread.sleep(1500);
            drill.stopPublishing();
            assertTrue(drill.published("wait") + drill.published("plain") > atFailover,
                    "publishing went on after the failover");
            drill.awaitEffects("wait", Duration.ofSeconds(20));
            drill.awaitEffects("plain", Duration.ofSeconds(3));
            System.out.printf("sentinel failover drill: published with WAIT %d, lost %d; without WAIT %d, lost %d; "
                    + "failed publishes %d; duplicated effects %d%n", drill.published("wait"), drill.lost("wait"),
                    drill.published("plain"), drill.lost("plain"), drill.failedPublishes(), drill.duplicated());
            assertTrue(w.isReading(), "the worker still reads");
            assertEquals(0, drill.duplicated(), "no effect happened twice");
            assertEquals(0, drill.lost("wait"), "no task published with WAIT was lost");
        }
    }
}
