package io.kombuenvelope;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.node.JsonNodeFactory;
import com.fasterxml.jackson.databind.node.ObjectNode;

import io.lettuce.core.RedisClient;
import io.lettuce.core.SetArgs;
import io.lettuce.core.api.StatefulRedisConnection;

import java.math.BigDecimal;
import java.time.Duration;
import java.time.Instant;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.function.Supplier;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Results for Celery callers (docs/protocol.md section 12): what {@code ext.celery.result} asks
 * for, the result document Celery's backend reads, and its write to the result backend's Redis
 * ({@code SET} with the lifetime and {@code PUBLISH}, in one MULTI). Without a backend it logs,
 * once per task type, that results were asked for and not written.
 */
final class CeleryResults implements AutoCloseable {
    private static final Logger LOG = LoggerFactory.getLogger(CeleryResults.class);
    static final String SUCCESS = "SUCCESS";
    static final String FAILURE = "FAILURE";
    static final String REVOKED = "REVOKED";
    /** How long a write is retried while the result backend is unreachable. */
    static final Duration OUTAGE_TOLERANCE = Duration.ofSeconds(30);
    private static final DateTimeFormatter DATE_DONE = DateTimeFormatter.ofPattern("yyyy-MM-dd'T'HH:mm:ss.SSSSSS'+00:00'")
            .withZone(ZoneOffset.UTC);

    /** Where a result goes: the backend's key, and its lifetime in seconds (null: no expiry). */
    record Request(String key, Long expiresS) {}

    private final StatefulRedisConnection<String, byte[]> connection;
    private final Set<String> typesWithoutBackend = ConcurrentHashMap.newKeySet();

    /**
     * Writes through a connection of its own to {@code backend} (the client stays the caller's);
     * null: no backend.
     */
    CeleryResults(RedisClient backend) {
        this.connection = backend == null ? null : backend.connect(Redis.CODEC);
    }

    /** Whether results are written. */
    boolean hasBackend() {
        return connection != null;
    }

    /**
     * Writes the result {@code env} asks for, if it asks for one, as {@code meta} makes it. A
     * result that cannot be written is logged; it never changes the task's outcome.
     */
    void report(Envelope env, Supplier<byte[]> meta) {
        Request r;
        try {
            r = requestOf(env);
        } catch (IllegalArgumentException ex) {
            LOG.error("a result was asked for and not written: {}", ex.getMessage());
            return;
        }
        if (r == null) {
            return;
        }
        if (connection == null) {
            if (typesWithoutBackend.add(env.taskType())) {
                LOG.warn("tasks of type {} ask for a result and this worker has no result backend "
                        + "(Worker.Builder.resultBackend): their results are not written", env.taskType());
            }
            return;
        }
        try {
            write(r, meta.get());
            LOG.info("result written to {}", r.key());
        } catch (RuntimeException ex) {
            LOG.error("writing the result to {} failed; the task's outcome stands: {}", r.key(), ex.toString());
        }
    }

    /**
     * The result {@code env} asks for, or null when it asks for none.
     *
     * @throws IllegalArgumentException naming the field and the rule when the request is malformed
     */
    static Request requestOf(Envelope env) {
        ObjectNode celery = env.ext().get("celery");
        JsonNode r = celery == null ? null : celery.get("result");
        if (r == null || r.isNull()) {
            return null;
        }
        if (!r.isObject()) {
            throw new IllegalArgumentException("ext.celery.result must be an object, not " + Json.kind(r) + " [type]");
        }
        JsonNode key = r.get("key");
        if (key == null || !key.isTextual()) {
            throw new IllegalArgumentException("ext.celery.result.key must be a string [type]");
        }
        if (key.textValue().isEmpty()) {
            throw new IllegalArgumentException("ext.celery.result.key must not be empty [length]");
        }
        JsonNode ttl = r.get("expires_s");
        if (ttl == null || ttl.isNull()) {
            return new Request(key.textValue(), null);
        }
        if (!ttl.isNumber() || !isWhole(ttl.decimalValue()) || ttl.decimalValue().signum() <= 0
                || ttl.decimalValue().compareTo(BigDecimal.valueOf(Envelope.MAX_SAFE_INTEGER)) > 0) {
            throw new IllegalArgumentException("ext.celery.result.expires_s must be a whole number of seconds >= 1, "
                    + "or null, not " + ttl + " [range]");
        }
        return new Request(key.textValue(), ttl.decimalValue().longValueExact());
    }

    private static boolean isWhole(BigDecimal d) {
        return d.signum() == 0 || d.stripTrailingZeros().scale() <= 0;
    }

    /** The compact JSON result document of section 12, dated now. */
    static byte[] meta(String status, JsonNode result, String traceback, String taskId) {
        JsonNodeFactory f = Json.MAPPER.getNodeFactory();
        ObjectNode o = f.objectNode();
        o.put("status", status);
        o.set("result", result == null ? f.nullNode() : result);
        o.put("traceback", traceback);
        o.putArray("children");
        o.put("date_done", DATE_DONE.format(Instant.now()));
        o.put("task_id", taskId);
        return Json.write(o);
    }

    /** The error object of a FAILURE or REVOKED result. */
    static JsonNode error(String type, String message, String module) {
        ObjectNode o = Json.MAPPER.getNodeFactory().objectNode();
        o.put("exc_type", type);
        o.putArray("exc_message").add(message);
        o.put("exc_module", module);
        return o;
    }

    /** The SUCCESS document of a handler's value; a value Jackson cannot write gives a FAILURE one. */
    static byte[] success(String taskId, Object value) {
        JsonNode json;
        try {
            json = Json.MAPPER.valueToTree(value);
        } catch (IllegalArgumentException ex) {
            LOG.error("the handler's return value cannot be written as JSON: {}", ex.getMessage());
            return failure(taskId, ex.getClass().getName(),
                    "the task's return value cannot be written as JSON: " + ex.getMessage(), null);
        }
        return meta(SUCCESS, json, null, taskId);
    }

    /** The FAILURE document of a dead-lettered task. */
    static byte[] failure(String taskId, String excType, String message, String traceback) {
        return meta(FAILURE, error(excType, message, null), traceback, taskId);
    }

    /** The REVOKED document of a cancelled ({@code revoked}) or expired ({@code expired}) task. */
    static byte[] revoked(String taskId, String why) {
        return meta(REVOKED, error("TaskRevokedError", why, "celery.exceptions"), null, taskId);
    }

    /** Stores {@code meta} under the request's key and publishes it there, retried while the backend is away. */
    private void write(Request r, byte[] meta) {
        Redis.retrying(OUTAGE_TOLERANCE, () -> Redis.transaction(connection, tx -> {
            if (r.expiresS() != null) {
                tx.set(r.key(), meta, SetArgs.Builder.ex(r.expiresS()));
            } else {
                tx.set(r.key(), meta);
            }
            tx.publish(r.key(), meta);
        }));
    }

    @Override
    public void close() {
        if (connection != null) {
            connection.close();
        }
    }
}
