package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertNotNull;
import static org.junit.jupiter.api.Assertions.assertNull;
import static org.junit.jupiter.api.Assertions.assertThrows;
import static org.junit.jupiter.api.Assertions.assertTrue;

import com.fasterxml.jackson.databind.JsonNode;

import java.time.Duration;
import java.util.List;
import java.util.Map;
import java.util.Set;

import org.junit.jupiter.api.Test;

/** Worker announcements and the producer's served check (docs/protocol.md section 15). */
class AnnouncementTest extends RedisFixture {
    Worker.Builder worker() {
        return Worker.builder().client(client).prefix(prefix).queues("billing", "mail").concurrency(3)
                .block(Duration.ofMillis(200)).lease(Duration.ofMillis(1500)).runPromoter(false)
                .shutdownTimeout(Duration.ofSeconds(5))
                .handler("invoice", Set.of(2L, 1L), t -> { })
                .handler("receipt", t -> { });
    }

    JsonNode announcement(String consumer) throws Exception {
        byte[] v = redis.get(keys.worker(consumer));
        assertNotNull(v, "no announcement of " + consumer);
        return Json.parse(v);
    }

    @Test
    void aWorkerAnnouncesWhatItServesAndWhenItStopped() throws Exception {
        Worker w = worker().consumer("w-1").build().start();
        JsonNode a = announcement("w-1");
        assertEquals("w-1", a.get("consumer").asText());
        assertEquals("java", a.get("language").asText());
        assertEquals(ProcessHandle.current().pid(), a.get("pid").asLong());
        assertTrue(a.get("host").asText().length() > 0);
        assertEquals("[\"billing\",\"mail\"]", a.get("queues").toString());
        assertEquals("{\"invoice\":[1,2],\"receipt\":[1]}", a.get("serves").toString());
        assertEquals(3, a.get("concurrency").asInt());
        assertEquals(500, a.get("heartbeat_ms").asLong(), "the renewal period, lease_ms / 3");
        assertEquals(500, Announcement.parse(a.toString()).heartbeatMs());
        assertEquals(Announcement.DEFAULT_HEARTBEAT_MS,
                Announcement.parse("{\"consumer\":\"old\",\"queues\":[],\"serves\":{}}").heartbeatMs(),
                "a reader takes 10000 when it is absent");
        assertNotNull(Timestamp.parse(a.get("started_at").asText()));
        String firstSeen = a.get("seen_at").asText();
        assertNull(a.get("stopped_at"));
        assertNotNull(redis.zscore(keys.workers(), Redis.b("w-1")), "not in <prefix>:workers");
        long pttl = redis.pttl(keys.worker("w-1"));
        assertTrue(pttl > 3_590_000 && pttl <= 3_600_000, "kept an hour: " + pttl);

        Thread.sleep(700); // one renewal (lease / 3) later, the announcement is written again
        assertTrue(announcement("w-1").get("seen_at").asText().compareTo(firstSeen) > 0, "seen_at was not renewed");

        w.close();
        JsonNode stopped = announcement("w-1");
        assertNotNull(Timestamp.parse(stopped.get("stopped_at").asText()));
        assertTrue(redis.pttl(keys.worker("w-1")) > 3_590_000, "a stopped worker's announcement is kept");
        assertEquals(0, redis.exists(keys.consumer("w-1")), "its liveness key is deleted");
    }

    @Test
    void requireServedRefusesWhatNoWorkerOfTheQueueServes() throws Exception {
        try (Producer p = Producer.builder().client(client).prefix(prefix).queue("billing").requireServed(true).build()) {
            NotServedException none = assertThrows(NotServedException.class,
                    () -> p.publish(Envelope.builder("invoice").build()));
            assertTrue(none.getMessage().contains("no worker of this queue"), none.getMessage());
            try (Worker w = worker().build().start()) {
                assertNotNull(p.publish(Envelope.builder("invoice").payloadVersion(2).build()).entryId());
                NotServedException version = assertThrows(NotServedException.class,
                        () -> p.publish(Envelope.builder("invoice").payloadVersion(3).build()));
                assertEquals(Map.of("invoice", List.of(1L, 2L), "receipt", List.of(1L)), version.serves());
                assertTrue(version.getMessage().contains("{\"invoice\":[1,2],\"receipt\":[1]}"), version.getMessage());
                NotServedException type = assertThrows(NotServedException.class,
                        () -> p.publishAll(List.of(Envelope.builder("receipt").taskId("batch-1").build(),
                                Envelope.builder("refund").build())));
                assertEquals("refund", type.taskType());
                assertEquals("unknown", p.getTask("billing", "batch-1").state(), "a refused batch stores nothing");
                assertThrows(NotServedException.class, () -> p.publish("other", Envelope.builder("invoice").build()));
            }
            // A stopped worker is still recently seen: its tasks are accepted.
            assertNotNull(p.publish(Envelope.builder("receipt").build()).entryId());
        }
    }
}
