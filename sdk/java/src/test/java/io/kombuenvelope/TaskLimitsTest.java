package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import java.util.List;
import java.util.Map;
import java.util.Optional;

import org.junit.jupiter.api.Test;

/** The limits API (docs/protocol.md section 19) against a real redis-server; the schema's rules are the conformance vectors'. */
class TaskLimitsTest extends RedisFixture {
    TaskLimits limits() {
        return TaskLimits.builder().client(client).prefix(prefix).build();
    }

    String stored(String queue, String taskType) {
        return RoundTripTest.s(redis.hget(keys.limits(queue), taskType));
    }

    @Test
    void setGetListRemoveRoundTrip() {
        TaskLimit both = TaskLimit.builder().concurrency(2).rate(100.5).burst(10).smooth(false).build();
        TaskLimit rated = TaskLimit.builder().rate(10).build();
        TaskLimit broken = TaskLimit.builder()
                .breaker(TaskLimit.Breaker.builder().failureRatio(0.5).cooldownSeconds(1.5).windowSeconds(60).build())
                .build();
        try (TaskLimits l = limits()) {
            l.set("q", "report.build", both);
            l.set("q", "mail.send", rated);
            assertEquals("{\"burst\":10,\"concurrency\":2,\"rate\":100.5,\"smooth\":false}", stored("q", "report.build"));
            assertEquals("{\"rate\":10}", stored("q", "mail.send"), "only the members given, canonical");
            l.set("q2", "pay.charge", broken);
            assertEquals("{\"breaker\":{\"cooldown_s\":1.5,\"failure_ratio\":0.5,\"window_s\":60}}",
                    stored("q2", "pay.charge"), "a breaker alone, its members given in name order");
            assertEquals(Optional.of(broken), l.get("q2", "pay.charge"));
            assertEquals(Optional.of(both), l.get("q", "report.build"));
            assertEquals(Optional.empty(), l.get("other", "report.build"), "limits are per queue");
            assertEquals(Map.of("mail.send", rated, "report.build", both), l.list("q"));
            assertEquals(List.of("mail.send", "report.build"), List.copyOf(l.list("q").keySet()), "sorted by type");

            assertTrue(l.remove("q", "report.build"));
            assertFalse(l.remove("q", "report.build"), "removed twice");
            assertEquals(Optional.empty(), l.get("q", "report.build"));
            assertEquals(Map.of("mail.send", rated), l.list("q"));
        }
    }

    @Test
    void aStoredValueThatBreaksTheSchemaIsReportedByGetAndLeftOutOfList() {
        redis.hset(keys.limits("q"), "bad", "{\"concurrency\":0}".getBytes());
        redis.hset(keys.limits("q"), "good", "{\"concurrency\":1}".getBytes());
        try (TaskLimits l = limits()) {
            InvalidLimitException e = assertThrows(InvalidLimitException.class, () -> l.get("q", "bad"));
            assertEquals("concurrency minimum", e.field() + " " + e.rule());
            assertEquals(Map.of("good", TaskLimit.builder().concurrency(1).build()), l.list("q"));
        }
    }

    @Test
    void theBuilderAndParseRefuseWhatTheSchemaRefusesNamingFieldAndRule() {
        assertRefused("burst minimum", () -> TaskLimit.builder().rate(1).burst(0).build());
        assertRefused("rate minimum", () -> TaskLimit.builder().rate(Double.NaN).build());
        assertRefused("concurrency required", () -> TaskLimit.builder().burst(3).build());
        assertRefused("concurency unknown_field", () -> TaskLimit.parse("{\"concurency\": 5}"));
        assertRefused("breaker.failure_ratio required", () -> TaskLimit.Breaker.builder().probes(2).build());
        assertRefused("breaker.failure_ratio minimum",
                () -> TaskLimit.Breaker.builder().failureRatio(Double.NaN).build());
        assertRefused("breaker.cooldown unknown_field",
                () -> TaskLimit.parse("{\"breaker\": {\"failure_ratio\": 1, \"cooldown\": 5}}"));
        assertRefused(" json", () -> TaskLimit.parse("{\"concurrency\": "));
        assertEquals(TaskLimit.builder().concurrency(1).build(), TaskLimit.parse("{\"concurrency\": 1.0}"),
                "1.0 is an integer to JSON Schema");
    }

    static void assertRefused(String fieldAndRule, Runnable make) {
        InvalidLimitException e = assertThrows(InvalidLimitException.class, make::run);
        assertEquals(fieldAndRule, e.field() + " " + e.rule(), e.getMessage());
    }
}
