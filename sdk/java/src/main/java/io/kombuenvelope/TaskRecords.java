package io.kombuenvelope;

import com.fasterxml.jackson.databind.node.ObjectNode;

import io.lettuce.core.api.sync.RedisCommands;

import java.time.Duration;
import java.time.Instant;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * The task records one writer keeps (docs/protocol.md section 14): which fields and expiry each
 * step writes, handed to the scripts as their optional record KEY and spec, or written in the
 * MULTI of a start or an acknowledgement. A retention of zero writes no records.
 */
final class TaskRecords {
    /** The default {@code task_record_retention}: how long a record in a final state is kept. */
    static final Duration DEFAULT_RETENTION = Duration.ofHours(1);
    /** The least time a record in a non-final state is kept after the later of its write and its due time. */
    private static final long ACTIVE_KEEP_MS = Duration.ofDays(7).toMillis();
    /** The longest {@code error} field, in characters. */
    private static final int MAX_ERROR = 1000;
    private static final DateTimeFormatter TIME = DateTimeFormatter.ofPattern("uuuu-MM-dd'T'HH:mm:ss.SSS'Z'")
            .withZone(ZoneOffset.UTC);

    private final Keys keys;
    private final long retentionMs;

    /** Records under {@code keys}, final ones kept {@code retention} (zero: no records). */
    TaskRecords(Keys keys, Duration retention) {
        if (retention.isNegative()) {
            throw new IllegalArgumentException("taskRecordRetention must be >= 0 (0 turns records off)");
        }
        this.keys = keys;
        this.retentionMs = retention.toMillis();
    }

    /** Whether this writer keeps records. */
    boolean enabled() {
        return retentionMs > 0;
    }

    /** A record time: RFC 3339 in UTC with milliseconds. */
    static String time(Instant t) {
        return TIME.format(t);
    }

    /** The record of a step that ends the task (succeeded, dead, cancelled). */
    Step finalStep(String queue, String taskId, Map<String, String> fields) {
        return step(queue, taskId, fields, retentionMs, 0);
    }

    /** The record of a step that leaves the task to run later, due at {@code dueMs} (0: now). */
    Step activeStep(String queue, String taskId, long dueMs, Map<String, String> fields) {
        long keep = Math.max(ACTIVE_KEEP_MS, retentionMs) + Math.max(0, dueMs - System.currentTimeMillis());
        return step(queue, taskId, fields, keep, 0);
    }

    /** The record of requeue.lua, which ends queued or dead. */
    Step requeueStep(String queue, String taskId) {
        return step(queue, taskId, new LinkedHashMap<>(), Math.max(ACTIVE_KEEP_MS, retentionMs), retentionMs);
    }

    private Step step(String queue, String taskId, Map<String, String> fields, long ttlMs, long deadTtlMs) {
        if (!enabled() || taskId == null) {
            return Step.NONE;
        }
        Map<String, String> all = new LinkedHashMap<>(fields);
        all.putIfAbsent("updated_at", time(Instant.now()));
        return new Step(keys.task(queue, taskId), ttlMs, deadTtlMs, all);
    }

    /** The record fields of a publish (or replay) of {@code e} on {@code queue}. */
    static Map<String, String> published(Envelope e, String queue) {
        Map<String, String> f = new LinkedHashMap<>();
        f.put("task_type", e.taskType());
        f.put("payload_version", String.valueOf(e.payloadVersion()));
        f.put("queue", queue);
        f.put("retry_count", String.valueOf(e.retryCount()));
        return f;
    }

    /** The {@code error} field: {@code "<type>: <message>"}, cut to 1,000 characters. */
    static String error(String type, String message) {
        String text = type + ": " + message;
        return text.codePointCount(0, text.length()) <= MAX_ERROR ? text
                : text.substring(0, text.offsetByCodePoints(0, MAX_ERROR));
    }

    /** The record one step writes: its key and spec; {@link #NONE} writes nothing. */
    record Step(String key, long ttlMs, long deadTtlMs, Map<String, String> fields) {
        static final Step NONE = new Step(null, 0, 0, Map.of());

        /** The spec ARGV: {@code {"ttl_ms": ..., "fields": {...}}} (and {@code dead_ttl_ms}). */
        String spec() {
            ObjectNode o = Json.MAPPER.createObjectNode();
            o.put("ttl_ms", ttlMs);
            if (deadTtlMs > 0) {
                o.put("dead_ttl_ms", deadTtlMs);
            }
            ObjectNode f = o.putObject("fields");
            fields.forEach(f::put);
            return o.toString();
        }

        /** A script's KEYS with the record key last. */
        List<String> keys(List<String> scriptKeys) {
            if (key == null) {
                return scriptKeys;
            }
            List<String> out = new ArrayList<>(scriptKeys);
            out.add(key);
            return out;
        }

        /** A script's ARGV with the spec right after its {@code fixed} first arguments. */
        Object[] args(int fixed, Object... args) {
            if (key == null) {
                return args;
            }
            Object[] out = new Object[args.length + 1];
            System.arraycopy(args, 0, out, 0, fixed);
            out[fixed] = spec();
            System.arraycopy(args, fixed, out, fixed + 1, args.length - fixed);
            return out;
        }

        /** Queues the fields, {@code state} and the expiry on a MULTI; {@code attempts + 1} when asked. */
        void write(RedisCommands<String, byte[]> tx, String state, boolean countAttempt) {
            if (key == null) {
                return;
            }
            Map<String, byte[]> values = new LinkedHashMap<>();
            fields.forEach((k, v) -> values.put(k, Redis.b(v)));
            values.put("state", Redis.b(state));
            tx.hset(key, values);
            if (countAttempt) {
                tx.hincrby(key, "attempts", 1);
            }
            if (ttlMs > 0) {
                tx.pexpire(key, ttlMs);
            }
        }
    }
}
