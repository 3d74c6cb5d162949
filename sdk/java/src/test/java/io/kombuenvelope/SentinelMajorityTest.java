package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.time.Duration;
import java.util.List;
import java.util.Map;

import org.junit.jupiter.api.AfterAll;
import org.junit.jupiter.api.BeforeAll;
import org.junit.jupiter.api.MethodOrderer;
import org.junit.jupiter.api.Order;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestMethodOrder;

/**
 * Sentinels that disagree: A names primary X, B and C name primary Y (docs/protocol.md section 5,
 * failover). The client goes where the majority points, whichever sentinel is listed first.
 */
@TestMethodOrder(MethodOrderer.OrderAnnotation.class)
class SentinelMajorityTest {
    static SentinelGroup group;
    static RedisServer x;
    static RedisServer y;
    static RedisServer a;
    static RedisServer b;
    static RedisServer c;

    @BeforeAll
    static void startGroup() throws Exception {
        group = SentinelGroup.split();
        x = group.data.get(0);
        y = group.data.get(1);
        a = group.sentinels.get(0);
        b = group.sentinels.get(1);
        c = group.sentinels.get(2);
    }

    @AfterAll
    static void stopGroup() {
        if (group != null) {
            group.close();
        }
    }

    @Test
    @Order(1)
    void withoutAMajorityConnectingFailsAsAnOutageNamingWhatEachSentinelSaid() {
        RuntimeException e = assertThrows(RuntimeException.class,
                () -> Producer.builder().redisUri(group.url(List.of(a, b))).prefix("nomaj").queue("jobs").build());
        String said = messages(e);
        assertTrue(said.contains("no primary for master_name \"" + SentinelGroup.MASTER
                + "\": 2 of the 2 listed sentinels must name the same one; 127.0.0.1:" + a.port + " named 127.0.0.1:"
                + x.port + ", 127.0.0.1:" + b.port + " named 127.0.0.1:" + y.port), said);
        assertTrue(Redis.isOutage(e), "no majority is an outage, retried like unreachable sentinels");
        try (LogCapture log = new LogCapture()) {
            RuntimeException w = assertThrows(RuntimeException.class, () -> Worker.builder()
                    .redisUri(group.url(List.of(a, b))).prefix("nomaj").queue("jobs")
                    .outageTolerance(Duration.ofMillis(800)).handler("job.run", t -> { }).build());
            assertEquals(1, log.lines("connecting while starting failed; Redis is unreachable or failing over").size(),
                    "a starting worker waited for a majority as for an outage");
            assertTrue(messages(w).contains("2 of the 2 listed sentinels must name the same one"), messages(w));
        }
        assertEquals(List.of(), keys(x, "nomaj*"));
        assertEquals(List.of(), keys(y, "nomaj*"));
    }

    @Test
    @Order(2)
    void theMajorityIsFollowedAndAskedAgainOnReconnection() throws Exception {
        String stream = new Keys("maj").stream("jobs", "normal");
        try (Producer p = Producer.builder().redisUri(group.url()).prefix("maj").queue("jobs").build()) {
            p.publish(Envelope.builder("job.run").build());
            assertEquals("1", SentinelGroup.node(y.port).text("XLEN", stream), "written to Y, which B and C name");
            assertEquals(List.of(), keys(x, "maj*"), "nothing written to X, which only A (listed first) names");

            for (RedisServer s : List.of(b, c)) {
                Resp r = Resp.at(s.port, SentinelGroup.SENTINEL_PASSWORD);
                r.call("SENTINEL", "REMOVE", SentinelGroup.MASTER);
                r.call("SENTINEL", "MONITOR", SentinelGroup.MASTER, "127.0.0.1", String.valueOf(x.port), "1");
                r.call("SENTINEL", "SET", SentinelGroup.MASTER, "auth-pass", SentinelGroup.DATA_PASSWORD);
                SentinelGroup.await("sentinel " + s.port + " names X", () -> {
                    Map<String, String> m = SentinelGroup.sentinelMaster(s.port);
                    return "master".equals(m.get("flags")) && String.valueOf(x.port).equals(m.get("port"));
                });
            }
            SentinelGroup.node(y.port).call("CLIENT", "KILL", "TYPE", "normal");
            p.publish(Envelope.builder("job.run").build());
            assertEquals("1", SentinelGroup.node(x.port).text("XLEN", stream), "the reconnection went to X, named now");
            assertEquals("1", SentinelGroup.node(y.port).text("XLEN", stream));
        }
    }

    @Test
    void aSentinelCountsOnlyWithASaneStateAndTheOutcomeIsKnownEarly() {
        SentinelVotes v = new SentinelVotes("m", List.of("s1:1", "s2:2", "s3:3"));
        v.named("s1:1", Map.of("ip", "10.0.0.1", "port", "6379", "flags", "master,s_down"));
        v.named("s2:2", Map.of("ip", "10.0.0.1", "port", "6379", "flags", "master"));
        assertEquals(null, v.majority());
        assertTrue(!v.decided(), "s3 can still make a majority");
        v.failed("s3:3", new IllegalStateException("ERR No such master with that name"));
        assertTrue(v.decided());
        assertEquals("no primary for master_name \"m\": 2 of the 3 listed sentinels must name the same one; "
                + "s1:1 named 10.0.0.1:6379 with flags master,s_down (not counted), s2:2 named 10.0.0.1:6379, "
                + "s3:3 failed (ERR No such master with that name)", v.noMajority().getMessage());

        SentinelVotes w = new SentinelVotes("m", List.of("s1:1", "s2:2", "s3:3"));
        w.named("s1:1", Map.of("ip", "10.0.0.2", "port", "6380", "flags", "master"));
        w.named("s3:3", Map.of("ip", "10.0.0.2", "port", "6380", "flags", "master"));
        assertTrue(w.decided(), "two of three agree: s2 need not be waited for");
        w.named("s2:2", Map.of("flags", "master"));

        SentinelVotes twice = new SentinelVotes("m", List.of("s1:1", "s1:1", "s2:2"));
        twice.named("s1:1", Map.of("ip", "10.0.0.3", "port", "6379", "flags", "master"));
        twice.named("s1:1", Map.of("ip", "10.0.0.3", "port", "6379", "flags", "master"));
        assertEquals(null, twice.majority(), "a sentinel listed twice votes once, of two");
        assertEquals(new SentinelVotes.Address("10.0.0.2", 6380), w.majority());
    }

    private static List<?> keys(RedisServer server, String pattern) {
        try {
            return (List<?>) SentinelGroup.node(server.port).call("KEYS", pattern);
        } catch (java.io.IOException e) {
            throw new AssertionError(e);
        }
    }

    /** The messages of {@code e}, its causes and their suppressed errors. */
    private static String messages(Throwable e) {
        StringBuilder b = new StringBuilder();
        for (Throwable t = e; t != null; t = t.getCause()) {
            b.append(t.getMessage()).append(" | ");
            for (Throwable s : t.getSuppressed()) {
                b.append(messages(s));
            }
        }
        return b.toString();
    }
}
