package io.kombuenvelope;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.node.ArrayNode;
import com.fasterxml.jackson.databind.node.ObjectNode;

import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;

/**
 * What one consumer says about itself in {@code <prefix>:worker:<consumer>} (docs/protocol.md
 * section 15): its queues, each task type it serves with the payload versions it accepts (an empty
 * list: every version), how many attempts it runs at once, and when it started, was last seen and,
 * after a clean shutdown, stopped ({@code stoppedAt} null while it runs), and how often it writes
 * the announcement again ({@code heartbeatMs}, the liveness renewal period; 10,000 when a reader
 * finds none).
 */
public record Announcement(String consumer, String language, String host, long pid, List<String> queues,
                           Map<String, List<Long>> serves, int concurrency, String startedAt, String seenAt,
                           String stoppedAt, long heartbeatMs) {
    /** The renewal period a reader takes when an announcement has no {@code heartbeat_ms}. */
    public static final long DEFAULT_HEARTBEAT_MS = 10_000;

    public Announcement {
        queues = List.copyOf(queues);
        serves = java.util.Collections.unmodifiableMap(new TreeMap<>(serves));
    }

    /** Whether it serves {@code taskType} at {@code payloadVersion} on {@code queue}. */
    public boolean accepts(String queue, String taskType, long payloadVersion) {
        List<Long> versions = serves.get(taskType);
        return versions != null && queues.contains(queue) && (versions.isEmpty() || versions.contains(payloadVersion));
    }

    /** The JSON text stored in Redis. */
    String toJson() {
        ObjectNode o = Json.MAPPER.createObjectNode();
        o.put("consumer", consumer).put("language", language).put("host", host).put("pid", pid);
        ArrayNode q = o.putArray("queues");
        queues.forEach(q::add);
        ObjectNode s = o.putObject("serves");
        serves.forEach((type, versions) -> {
            ArrayNode a = s.putArray(type);
            versions.forEach(a::add);
        });
        o.put("concurrency", concurrency).put("started_at", startedAt).put("seen_at", seenAt);
        if (stoppedAt != null) {
            o.put("stopped_at", stoppedAt);
        }
        o.put("heartbeat_ms", heartbeatMs);
        return o.toString();
    }

    /**
     * Reads a stored announcement.
     *
     * @throws IllegalArgumentException when it is not an announcement
     */
    static Announcement parse(String text) {
        JsonNode o;
        try {
            o = Json.parse(text);
        } catch (Json.NotJson e) {
            throw new IllegalArgumentException("not JSON: " + e.getMessage(), e);
        }
        if (!o.isObject() || !o.path("consumer").isTextual() || !o.path("queues").isArray()
                || !o.path("serves").isObject()) {
            throw new IllegalArgumentException("not an announcement: consumer, queues and serves are required");
        }
        List<String> queues = new ArrayList<>();
        o.get("queues").forEach(q -> queues.add(q.asText()));
        Map<String, List<Long>> serves = new TreeMap<>();
        o.get("serves").fields().forEachRemaining(f -> {
            List<Long> versions = new ArrayList<>();
            f.getValue().forEach(v -> versions.add(v.asLong()));
            serves.put(f.getKey(), versions);
        });
        return new Announcement(o.get("consumer").asText(), o.path("language").asText(""), o.path("host").asText(""),
                o.path("pid").asLong(), queues, serves, o.path("concurrency").asInt(),
                o.path("started_at").asText(null), o.path("seen_at").asText(null),
                o.hasNonNull("stopped_at") ? o.get("stopped_at").asText() : null,
                o.path("heartbeat_ms").isIntegralNumber() ? o.get("heartbeat_ms").asLong() : DEFAULT_HEARTBEAT_MS);
    }
}
