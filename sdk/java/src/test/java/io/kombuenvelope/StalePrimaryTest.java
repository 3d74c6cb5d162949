package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.List;
import java.util.concurrent.CopyOnWriteArrayList;

import org.junit.jupiter.api.Test;

/**
 * An old primary that comes back after a failover and stays a primary (it cannot be made a
 * replica: its REPLICAOF is renamed away) answers NOREPLICAS, having no replicas left: a worker
 * connected to it leaves it for the primary the sentinels name now.
 */
class StalePrimaryTest {
    @Test
    void aWorkerLeavesAnOldPrimaryThatAnswersNoReplicas() throws Exception {
        List<String> ran = new CopyOnWriteArrayList<>();
        try (SentinelGroup group = SentinelGroup.start("--min-replicas-to-write", "1",
                "--rename-command", "SLAVEOF", "slaveof-disabled", "--rename-command", "REPLICAOF", "replicaof-disabled");
             Worker w = Worker.builder().redisUri(group.url()).prefix("stale").queue("jobs")
                     .block(Duration.ofMillis(200)).lease(Duration.ofMillis(1500))
                     .handler("job.run", t -> ran.add(t.get("k").asText())).build().start()) {
            try (Producer p = Producer.builder().redisUri(group.url()).prefix("stale").queue("jobs").build()) {
                p.publish(Envelope.builder("job.run").put("k", "before").build());
            }
            SentinelGroup.await("the first task ran", () -> ran.contains("before"));
            int old = group.primaryPort();
            RedisServer stale = group.server(old);
            stale.pause();
            try {
                group.awaitFailover(old);
            } finally {
                stale.resume();
            }
            SentinelGroup.await("the old primary answers NOREPLICAS", () -> refusesWrites(old));
            try (Producer p = Producer.builder().redisUri(group.url()).prefix("stale").queue("jobs").build()) {
                p.publish(Envelope.builder("job.run").put("k", "after").build());
            }
            SentinelGroup.await("the task published on the new primary ran", () -> ran.contains("after"));
            assertEquals(List.of("before", "after"), ran);
            assertTrue(w.isReading(), "the worker still reads");
        }
    }

    private static boolean refusesWrites(int port) {
        try {
            SentinelGroup.node(port).call("SET", "probe", "1");
            return false;
        } catch (IllegalStateException e) {
            return e.getMessage().startsWith("NOREPLICAS");
        } catch (java.io.IOException e) {
            return false;
        }
    }
}
