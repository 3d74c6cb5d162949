package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertFalse;
import static org.junit.jupiter.api.Assertions.assertNotEquals;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.fasterxml.jackson.databind.JsonNode;

import java.time.Duration;
import java.time.OffsetDateTime;
import java.time.ZoneOffset;
import java.util.List;
import java.util.Map;

import org.junit.jupiter.api.Test;

class UnitTest {
    static JsonNode json(String s) throws Exception {
        return Json.parse(s);
    }

    @Test
    void idempotencyKeysFollowTheProtocolRule() throws Exception {
        assertEquals("202509110001", IdempotencyKeys.derive(json("{\"order_id\":\"202509110001\"}"), "order_id"));
        assertEquals("202509110001", IdempotencyKeys.derive(json("{\"order_id\":202509110001}"), "order_id"));
        assertEquals("acme:7", IdempotencyKeys.derive(json("{\"order_id\":7,\"tenant\":\"acme\"}"), "tenant", "order_id"));
        assertEquals("{\"a\":\"\\u00e9\",\"b\":[true,null]}",
                IdempotencyKeys.derive(json("{\"x\":{\"b\":[true,null],\"a\":\"é\"}}"), "x"));
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
                () -> IdempotencyKeys.derive(json("{}"), "order_id"));
        assertTrue(e.getMessage().startsWith("payload.order_id"));
    }

    @Test
    void timestampsKeepTheirOffset() {
        Timestamp t = Timestamp.parse("2025-09-11T12:45:00.25+08:00");
        assertEquals("2025-09-11T12:45:00.250000+08:00", t.toString());
        assertEquals("2025-09-11T04:45:00Z", Timestamp.of(OffsetDateTime.of(2025, 9, 11, 4, 45, 0, 0, ZoneOffset.UTC)).toString());
        IllegalArgumentException e = assertThrows(IllegalArgumentException.class, () -> Timestamp.parse("2025-09-11T12:45:00"));
        assertTrue(e.getMessage().contains("[timezone_required]"));
    }

    @Test
    void envelopeWritesCanonicalJsonAndRoundTrips() {
        Envelope e = Envelope.builder("order.close_timeout").put("order_id", "1").maxRetries(null)
                .header("b", "2").header("a", "1").build();
        String text = e.toString();
        assertTrue(text.contains("\"max_retries\":null"), text);
        assertTrue(text.indexOf("\"a\"") < text.indexOf("\"b\""), text);
        assertEquals(e, Envelope.parse(text));
        assertNull(e.scheduleTime());
    }

    @Test
    void expiresIsWrittenAsGivenAndExpiresAtItsInstant() {
        Timestamp at = Timestamp.parse("2025-09-11T12:45:00+08:00");
        Envelope e = Envelope.builder("x").timeoutMs(5L).expires(at).build();
        String text = e.toString();
        assertTrue(text.contains("\"timeout_ms\":5,\"expires\":\"2025-09-11T12:45:00+08:00\",\"max_retries\""), text);
        assertEquals(e, Envelope.parse(text));
        assertTrue(e.isExpired(at.toInstant()), "expired at its instant");
        assertFalse(e.isExpired(at.toInstant().minusNanos(1000)));
        assertFalse(Envelope.builder("x").build().isExpired(java.time.Instant.MAX));
        assertFalse(Envelope.builder("x").build().toString().contains("expires"), "left out when unset");
        java.time.Instant before = java.time.Instant.now();
        Timestamp in = Envelope.builder("x").expiresIn(Duration.ofMinutes(10)).build().expires();
        assertTrue(!in.isAfter(java.time.Instant.now().plus(Duration.ofMinutes(10)))
                && in.isAfter(before.plus(Duration.ofMinutes(10)).minusMillis(1)), in.toString());
    }

    @Test
    void resultRequestsAreReadFromExtCelery() throws Exception {
        assertNull(CeleryResults.requestOf(Envelope.builder("x").build()));
        assertEquals(new CeleryResults.Request("k", 86400L), CeleryResults.requestOf(withResult("{\"key\":\"k\",\"expires_s\":86400}")));
        assertEquals(new CeleryResults.Request("k", 60L), CeleryResults.requestOf(withResult("{\"key\":\"k\",\"expires_s\":60.0}")));
        assertEquals(new CeleryResults.Request("k", 2L), CeleryResults.requestOf(withResult("{\"key\":\"k\",\"expires_s\":1.5}")),
                "a fraction is rounded up");
        assertEquals(new CeleryResults.Request("k", 1L), CeleryResults.requestOf(withResult("{\"key\":\"k\",\"expires_s\":0.001}")));
        for (String noExpiry : List.of("null", "0", "0.0", "-0")) {
            assertEquals(new CeleryResults.Request("k", null),
                    CeleryResults.requestOf(withResult("{\"key\":\"k\",\"expires_s\":" + noExpiry + "}")), noExpiry);
        }
        assertEquals(new CeleryResults.Request("k", null), CeleryResults.requestOf(withResult("{\"key\":\"k\"}")));
        for (String bad : List.of("[]", "{}", "{\"key\":7}", "{\"key\":\"\"}", "{\"key\":\"k\",\"expires_s\":-1}",
                "{\"key\":\"k\",\"expires_s\":-0.5}", "{\"key\":\"k\",\"expires_s\":\"60\"}",
                "{\"key\":\"k\",\"expires_s\":true}", "{\"key\":\"k\",\"expires_s\":1e300}")) {
            IllegalArgumentException e = assertThrows(IllegalArgumentException.class,
                    () -> CeleryResults.requestOf(withResult(bad)), bad);
            assertTrue(e.getMessage().startsWith("ext.celery.result"), e.getMessage());
        }
    }

    static Envelope withResult(String result) throws Exception {
        com.fasterxml.jackson.databind.node.ObjectNode celery = Json.MAPPER.createObjectNode();
        celery.set("result", json(result));
        return Envelope.builder("x").ext("celery", celery).build();
    }

    @Test
    void resultDocumentsHaveTheCeleryShape() {
        String revoked = new String(CeleryResults.revoked("t-1", "expired"), java.nio.charset.StandardCharsets.UTF_8);
        assertTrue(revoked.matches("\\{\"status\":\"REVOKED\",\"result\":\\{\"exc_type\":\"TaskRevokedError\","
                + "\"exc_message\":\\[\"expired\"],\"exc_module\":\"celery.exceptions\"},\"traceback\":null,"
                + "\"children\":\\[],\"date_done\":\"\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\d\\.\\d{6}\\+00:00\","
                + "\"task_id\":\"t-1\"}"), revoked);
    }

    @Test
    void traceIdComesFromTheMdcWhileServingARequest() {
        try (TraceContext.Scope scope = TraceContext.with("req-42")) {
            assertEquals("req-42", Envelope.builder("x").build().traceId());
        }
        assertNotEquals("req-42", Envelope.builder("x").build().traceId());
    }

    @Test
    void gzipBodiesRoundTrip() throws Exception {
        StringBuilder big = new StringBuilder();
        for (int i = 0; i < 2000; i++) {
            big.append("abcdefgh");
        }
        Envelope e = Envelope.builder("x").put("blob", big.toString()).build();
        Map<String, byte[]> fields = EntryCodec.encodeEntry(e, EntryCodec.GZIP_MIN_BYTES, Limits.DEFAULT);
        assertEquals("json+gzip", new String(fields.get("enc")));
        assertEquals(e, EntryCodec.decodeEntry(fields, Limits.DEFAULT));
    }

    @Test
    void anOrderingKeyIsWrittenOnlyWhenSetAndCarriedIntoDerivedEnvelopes() {
        Envelope none = Envelope.builder("x").build();
        assertNull(none.orderingKey());
        assertFalse(none.toString().contains("ordering_key"), none.toString());
        Envelope keyed = Envelope.builder("x").orderingKey("order:42").build();
        assertTrue(keyed.toString().contains("\"ordering_key\":\"order:42\""), keyed.toString());
        assertEquals("order:42", Envelope.parse(keyed.toString()).orderingKey());
        assertEquals("order:42", keyed.toBuilder().retryCount(1).build().orderingKey());
        EnvelopeValidationException e = assertThrows(EnvelopeValidationException.class,
                () -> Envelope.builder("x").orderingKey("order 42").build());
        assertEquals("ordering_key pattern", e.violations().get(0).field() + " " + e.violations().get(0).rule());
    }

    @Test
    void theOrderKeysAreNamedAsInTheProtocol() {
        Keys k = new Keys("envelope");
        assertEquals(List.of("envelope:{q}:order:order:42", "envelope:{q}:order-waiting:order:42",
                "envelope:{q}:order-advanced", "envelope:{q}:order-held", "envelope:{q}:order-policy",
                "envelope:{q}:order-halted"), List.of(k.order("q", "order:42"), k.orderWaiting("q", "order:42"),
                k.orderAdvanced("q"), k.orderHeld("q"), k.orderPolicy("q"), k.orderHalted("q")));
    }

    @Test
    void aKeyedEnvelopeIsNeverCompressed() throws Exception {
        Envelope big = Envelope.builder("x").put("blob", "abcdefgh".repeat(2000)).orderingKey("k").build();
        Map<String, byte[]> fields = EntryCodec.encodeEntry(big, EntryCodec.GZIP_MIN_BYTES, Limits.DEFAULT);
        assertEquals("json", new String(fields.get("enc")));
        assertEquals(big, EntryCodec.decodeEntry(fields, Limits.DEFAULT));
    }

    @Test
    void backoffFollowsTheFormula() {
        RetryPolicy p = new RetryPolicy(2, Duration.ofSeconds(30), Duration.ofHours(1), () -> 1.0);
        assertEquals(List.of(30L, 60L, 120L), List.of(p.backoffDelay(1, 0).toSeconds(), p.backoffDelay(2, 0).toSeconds(),
                p.backoffDelay(3, 0).toSeconds()));
        assertEquals(30L, p.backoffDelay(3, 2).toSeconds());
        assertEquals(3600L, p.backoffDelay(100, 0).toSeconds());
    }

    @Test
    void bucketsFollowPriority() {
        assertEquals("high", Keys.bucketFor(170));
        assertEquals("normal", Keys.bucketFor(85));
        assertEquals("low", Keys.bucketFor(84));
        assertThrows(IllegalArgumentException.class, () -> Keys.checkQueueName("a{b}"));
    }

    @Test
    void failoverErrorsAreOutagesAndRoleChangesAskForANewConnection() {
        for (String reply : List.of("READONLY You can't write against a read only replica.", "MOVED 3999 127.0.0.1:7002",
                "ASK 3999 127.0.0.1:7002", "TRYAGAIN Multiple keys request during rehashing of slot",
                "CLUSTERDOWN The cluster is down", "LOADING Redis is loading the dataset in memory",
                "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
                "UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)",
                "EXECABORT Transaction discarded because of previous errors.")) {
            assertTrue(Redis.isOutage(new io.lettuce.core.RedisCommandExecutionException(reply)), reply);
        }
        assertTrue(Redis.isOutage(new io.lettuce.core.RedisException(new java.io.IOException("Connection reset"))));
        assertFalse(Redis.isOutage(new io.lettuce.core.RedisCommandExecutionException("WRONGTYPE Operation against a key")));
        assertFalse(Redis.isOutage(new io.lettuce.core.RedisCommandExecutionException("ERR unknown command 'ASKING2'")));
        assertTrue(Redis.isRoleChange(new io.lettuce.core.RedisCommandExecutionException(
                "UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)")));
        assertTrue(Redis.isRoleChange(new io.lettuce.core.RedisCommandExecutionException("READONLY You can't write")));
        assertFalse(Redis.isRoleChange(new io.lettuce.core.RedisCommandExecutionException(
                "UNBLOCKED the stream key no longer exists")), "a deleted stream is no failover");
        assertFalse(Redis.isRoleChange(new io.lettuce.core.RedisCommandExecutionException("MOVED 1 127.0.0.1:7000")));
    }
}
