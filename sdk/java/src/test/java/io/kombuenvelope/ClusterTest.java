package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertTrue;

import io.lettuce.core.Consumer;
import io.lettuce.core.XGroupCreateArgs;
import io.lettuce.core.XReadArgs;
import io.lettuce.core.cluster.RedisClusterClient;
import io.lettuce.core.cluster.api.StatefulRedisClusterConnection;
import io.lettuce.core.cluster.api.sync.RedisAdvancedClusterCommands;

import java.time.Duration;
import java.time.Instant;
import java.util.List;
import java.util.Set;
import java.util.UUID;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.TimeUnit;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.MethodOrderer;
import org.junit.jupiter.api.Order;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestMethodOrder;

/** The SDK on a Redis Cluster of three primaries with a replica each; the failover drill runs last. */
@TestMethodOrder(MethodOrderer.OrderAnnotation.class)
class ClusterTest {
    static ClusterGroup cluster;
    static RedisClusterClient client;
    /** Two queues whose slots are served by different primaries. */
    static String queueA;
    static String queueB;

    @BeforeAll
    static void startCluster() throws Exception {
        cluster = ClusterGroup.start();
        client = (RedisClusterClient) RedisUrl.client(cluster.url());
        queueA = "qa";
        int shardA = cluster.primaryOf(cluster.slot(queueA));
        for (int i = 0; queueB == null; i++) {
            if (cluster.primaryOf(cluster.slot("qb" + i)) != shardA) {
                queueB = "qb" + i;
            }
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

    static String prefix() {
        return "c" + UUID.randomUUID().toString().substring(0, 8);
    }

    Worker.Builder worker(String prefix, String queue) {
        return Worker.builder().client(client).prefix(prefix).queue(queue).block(Duration.ofMillis(200))
                .shutdownTimeout(Duration.ofSeconds(5));
    }

    @Test
    @Order(1)
    void oneWorkerConsumesQueuesOnTwoShards() throws Exception {
        String prefix = prefix();
        Keys keys = new Keys(prefix);
        int shardA = cluster.primaryOf(cluster.slot(keys.stream(queueA, "normal")));
        int shardB = cluster.primaryOf(cluster.slot(keys.stream(queueB, "normal")));
        assertNotEquals(shardA, shardB, "the two queues are on different shards");
        assertEquals(cluster.slot(keys.stream(queueA, "high")), cluster.slot(keys.delayed(queueA)),
                "every key of a queue is in its slot");
        Set<String> ran = ConcurrentHashMap.newKeySet();
        try (Producer p = Producer.builder().redisUri(cluster.url()).prefix(prefix).queue(queueA)
                .waitReplicas(1, Duration.ofSeconds(2)).build();
             Worker w = worker(prefix, queueA).queues(queueA, queueB).waitReplicas(1, Duration.ofSeconds(2))
                     .handler("job.run", t -> ran.add(t.queue() + "/" + t.get("k").asText())).build().start()) {
            for (String q : List.of(queueA, queueB)) {
                p.publish(q, Envelope.builder("job.run").put("k", "now").build());
                p.publishIn(q, Envelope.builder("job.run").put("k", "later").build(), Duration.ofMillis(300));
            }
            SentinelGroup.await("four tasks ran", () -> ran.size() == 4);
            assertEquals(Set.of(queueA + "/now", queueA + "/later", queueB + "/now", queueB + "/later"), ran);
            assertEquals("1", Resp.at(cluster.primaryOf(cluster.slot(keys.queues()))).text("SISMEMBER", keys.queues(),
                    queueA), "the registry lists the queue that had a delayed task");
        }
    }

    @Test
    @Order(2)
    void anUnknownTaskTypeIsDeadLetteredAndADelayedTaskCancelled() throws Exception {
        String prefix = prefix();
        Set<String> ran = ConcurrentHashMap.newKeySet();
        try (Producer p = Producer.builder().client(client).prefix(prefix).queue(queueB).build();
             Worker a = worker(prefix, queueA).handler("job.run", t -> ran.add(t.taskId())).build().start();
             Worker b = worker(prefix, queueB).handler("job.run", t -> ran.add(t.taskId())).build().start();
             DeadLetters dl = DeadLetters.builder().client(client).prefix(prefix).build()) {
            p.publish(queueB, Envelope.builder("job.unknown").build());
            SentinelGroup.await("a dead letter", () -> dl.count(queueB) == 1);
            assertEquals(List.of(queueB), dl.queues());
            assertEquals("unknown_task_type", dl.list(queueB, 10).get(0).failureClass());

            PublishResult later = p.publishIn(queueA, Envelope.builder("job.run").build(), Duration.ofSeconds(2));
            CancelResult r = p.canceller().cancel(later.taskId());
            assertEquals(CancelResult.Outcome.REMOVED, r.outcome());
            assertEquals(queueA, r.queue());
            assertEquals(CancelResult.Outcome.MARKED, p.canceller().cancel("never-published").outcome());
            PublishResult now = p.publish(queueA, Envelope.builder("job.run").taskId(later.taskId()).build());
            PublishResult other = p.publish(queueA, Envelope.builder("job.run").build());
            SentinelGroup.await("the uncancelled task ran", () -> ran.contains(other.taskId()));
            String stream = new Keys(prefix).stream(queueA, "normal");
            int shard = cluster.primaryOf(cluster.slot(stream));
            SentinelGroup.await("the cancelled one was acknowledged", () -> Resp.at(shard).text("XLEN", stream).equals("0"));
            assertTrue(!ran.contains(now.taskId()), "a cancelled task does not run");
        }
    }

    @Test
    @Order(3)
    void aNotYetDueEntryARetryAndADeadConsumersEntryStayInTheirSlot() throws Exception {
        String prefix = prefix();
        Keys keys = new Keys(prefix);
        String stream = keys.stream(queueA, "normal");
        Set<String> ran = ConcurrentHashMap.newKeySet();
        try (StatefulRedisClusterConnection<String, byte[]> c = client.connect(Redis.CODEC)) {
            RedisAdvancedClusterCommands<String, byte[]> redis = c.sync();
            redis.xgroupCreate(XReadArgs.StreamOffset.from(stream, "0"), Keys.DEFAULT_GROUP,
                    XGroupCreateArgs.Builder.mkstream(true));
            Envelope orphan = Envelope.builder("job.run").build();
            redis.xadd(stream, EntryCodec.encodeEntry(orphan, 0, Limits.DEFAULT));
            assertEquals(1, redis.xreadgroup(Consumer.from(Keys.DEFAULT_GROUP, "ghost"),
                    XReadArgs.StreamOffset.lastConsumed(stream)).size(), "a consumer that dies holding an entry");
            Envelope early = Envelope.builder("job.run").scheduleTime(Instant.now().plusMillis(500)).build();
            Envelope retried = Envelope.builder("job.retry").build();
            try (Worker w = worker(prefix, queueA).lease(Duration.ofMillis(600))
                    .handler("job.run", t -> ran.add(t.taskId()))
                    .handler("job.retry", t -> {
                        if (t.retryCount() == 0) {
                            throw t.retry("once more", Duration.ofMillis(300));
                        }
                        ran.add(t.taskId());
                    }).build().start()) {
                redis.xadd(stream, EntryCodec.encodeEntry(early, 0, Limits.DEFAULT));
                redis.xadd(stream, EntryCodec.encodeEntry(retried, 0, Limits.DEFAULT));
                SentinelGroup.await("the three tasks ran", () ->
                        ran.containsAll(Set.of(orphan.taskId(), early.taskId(), retried.taskId())));
            }
        }
    }

    @Test
    @Order(4)
    void workersAndPublishersSurviveTheLossOfAPrimary() throws Exception {
        String prefix = prefix();
        Keys keys = new Keys(prefix);
        List<String> queues = List.of(queueA, queueB);
        try (FailoverDrill drill = new FailoverDrill();
             Worker w = worker(prefix, queueA).queues(queueA, queueB).concurrency(4)
                     .handler(FailoverDrill.TASK_TYPE, drill.handler()).build().start();
             Producer withWait = Producer.builder().redisUri(cluster.url()).prefix(prefix)
                     .waitReplicas(1, Duration.ofMillis(500)).build();
             Producer without = Producer.builder().redisUri(cluster.url()).prefix(prefix).build()) {
            drill.publish("wait", withWait, queues);
            drill.publish("plain", without, queues);
            Thread.sleep(1500);
            int slot = cluster.slot(keys.stream(queueA, "normal"));
            int old = cluster.primaryOf(slot);
            cluster.server(old).kill();
            cluster.awaitFailover(slot, old);
            int atFailover = drill.published("wait") + drill.published("plain");
            Thread.sleep(2000);
            drill.stopPublishing();
            assertTrue(drill.published("wait") + drill.published("plain") > atFailover,
                    "publishing went on after the failover");
            drill.awaitEffects("wait", Duration.ofSeconds(20));
            drill.awaitEffects("plain", Duration.ofSeconds(3));
            System.out.printf("cluster failover drill: published with WAIT %d, lost %d; without WAIT %d, lost %d; "
                    + "failed publishes %d; duplicated effects %d%n", drill.published("wait"), drill.lost("wait"),
                    drill.published("plain"), drill.lost("plain"), drill.failedPublishes(), drill.duplicated());
            assertTrue(w.isReading(), "the worker still reads");
            assertEquals(0, drill.duplicated(), "no effect happened twice");
            assertEquals(0, drill.lost("wait"), "no task published with WAIT was lost");
        }
    }

    @Test
    @Order(5)
    void aWorkerWhoseQueueSlotMovesKeepsConsuming() throws Exception {
        String prefix = prefix();
        Keys keys = new Keys(prefix);
        int slot = cluster.slot(keys.stream(queueB, "normal"));
        int from = cluster.primaryOf(slot);
        int to = cluster.primaries().stream().filter(p -> p != from).findFirst().orElseThrow();
        Set<String> ran = ConcurrentHashMap.newKeySet();
        try (Producer p = Producer.builder().client(client).prefix(prefix).queue(queueB).build();
             Worker w = worker(prefix, queueB).handler("job.run", t -> ran.add(t.get("k").asText())).build().start()) {
            p.publish(Envelope.builder("job.run").put("k", "before").build());
            p.publishIn(Envelope.builder("job.run").put("k", "delayed-across").build(), Duration.ofMillis(1500));
            SentinelGroup.await("the first task ran", () -> ran.contains("before"));
            CompletableFuture<PublishResult> during = new CompletableFuture<>();
            cluster.moveSlot(slot, to, () -> {
                during.completeAsync(() -> p.publish(Envelope.builder("job.run").put("k", "during").build()));
                try {
                    Thread.sleep(300); // the publish meets ASK / TRYAGAIN meanwhile
                } catch (InterruptedException e) {
                    Thread.currentThread().interrupt();
                }
            });
            assertEquals(to, cluster.primaryOf(slot), "the slot moved");
            assertNotNull(during.get(30, TimeUnit.SECONDS).entryId());
            p.publish(Envelope.builder("job.run").put("k", "after").build());
            SentinelGroup.await("the tasks published during and after the move ran",
                    () -> ran.containsAll(Set.of("during", "after", "delayed-across")));
            assertTrue(w.isReading(), "the worker still reads");
        }
    }
}
