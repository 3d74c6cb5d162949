package io.kombuenvelope;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.node.JsonNodeFactory;
import com.fasterxml.jackson.databind.node.ObjectNode;

import java.math.BigDecimal;
import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.security.SecureRandom;
import java.time.Duration;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Collections;
import java.util.HexFormat;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.Set;
import java.util.TreeMap;
import java.util.UUID;
import java.util.regex.Pattern;

/**
 * One task, as every language sees it (docs/protocol.md section 1). Immutable; build one with
 * {@link #builder(String)} or read one with {@link #parse(byte[], Limits)}. {@code payload} and each
 * {@code ext} namespace are kept as JSON trees, member order included, so data this program does
 * not interpret passes through untouched.
 */
public final class Envelope {
    public static final int PRIORITY_DEFAULT = 100;
    public static final long MAX_RETRIES_DEFAULT = 3;
    public static final long MAX_SAFE_INTEGER = (1L << 53) - 1;
    private static final int MAX_EXT_DEPTH = 64;

    private static final Pattern TASK_TYPE = Pattern.compile(
            "[A-Za-z_][A-Za-z0-9_\\-]*(\\.[A-Za-z_][A-Za-z0-9_\\-]*)*");
    /** Printable ASCII without spaces: task_id, trace_id and ordering_key. */
    static final Pattern TOKEN = Pattern.compile("[\\x21-\\x7e]+");

    /** Refuses a task_id a caller names that no Envelope could carry. */
    static void checkTaskId(String taskId) {
        if (taskId == null || taskId.length() > 255 || !TOKEN.matcher(taskId).matches()) {
            throw new IllegalArgumentException("task_id must be 1-255 printable ASCII characters without spaces [pattern]");
        }
    }

    private static final Pattern EXT_NAME = Pattern.compile("[a-z][a-z0-9_.\\-]*");
    private static final Set<String> KNOWN = Set.of("task_id", "task_type", "payload_version", "payload",
            "schedule_time", "timeout_ms", "expires", "max_retries", "retry_count", "priority", "trace_id", "created_at",
            "idempotency_key", "ordering_key", "headers", "ext");
    private static final SecureRandom RANDOM = new SecureRandom();

    private final String taskId;
    private final String taskType;
    private final long payloadVersion;
    private final ObjectNode payload;
    private final Timestamp scheduleTime;
    private final Long timeoutMs;
    private final Timestamp expires;
    private final Long maxRetries;
    private final long retryCount;
    private final int priority;
    private final String traceId;
    private final Timestamp createdAt;
    private final String idempotencyKey;
    private final String orderingKey;
    private final Map<String, String> headers;
    private final Map<String, ObjectNode> ext;

    private Envelope(Builder b) {
        taskId = b.taskId;
        taskType = b.taskType;
        payloadVersion = b.payloadVersion;
        payload = b.payload.deepCopy();
        scheduleTime = b.scheduleTime;
        timeoutMs = b.timeoutMs;
        expires = b.expires;
        maxRetries = b.maxRetries;
        retryCount = b.retryCount;
        priority = b.priority;
        traceId = b.traceId;
        createdAt = b.createdAt;
        idempotencyKey = b.idempotencyKey;
        orderingKey = b.orderingKey;
        headers = Collections.unmodifiableMap(new TreeMap<>(b.headers));
        Map<String, ObjectNode> x = new LinkedHashMap<>();
        b.ext.forEach((k, v) -> x.put(k, v.deepCopy()));
        ext = Collections.unmodifiableMap(x);
    }

    /** A builder with a fresh task_id and trace_id, created_at now and every default set. */
    public static Builder builder(String taskType) {
        return new Builder().taskType(taskType);
    }

    /** A builder holding this Envelope's fields, to derive another (a retry, an edit). */
    public Builder toBuilder() {
        Builder b = new Builder();
        b.taskId = taskId;
        b.taskType = taskType;
        b.payloadVersion = payloadVersion;
        b.payload = payload.deepCopy();
        b.scheduleTime = scheduleTime;
        b.timeoutMs = timeoutMs;
        b.expires = expires;
        b.maxRetries = maxRetries;
        b.retryCount = retryCount;
        b.priority = priority;
        b.traceId(traceId);
        b.createdAt = createdAt;
        b.idempotencyKey = idempotencyKey;
        b.orderingKey = orderingKey;
        b.headers.putAll(headers);
        ext.forEach((k, v) -> b.ext.put(k, v.deepCopy()));
        return b;
    }

    /** A random UUID (version 4), the default task_id. */
    public static String newTaskId() {
        return UUID.randomUUID().toString();
    }

    /**
     * The trace id of the request being served ({@link TraceContext#current()}: a worker sets it
     * while a task runs, so tasks published from a handler carry it on), else the trace id of the
     * current OpenTelemetry span, else a new one.
     */
    public static String currentTraceId() {
        String t = TraceContext.current();
        if (t != null && !t.isEmpty() && t.length() <= 128 && TOKEN.matcher(t).matches()) {
            return t;
        }
        String span = Tracing.currentTraceId();
        return span != null ? span : newTraceId();
    }

    /** 32 random hex digits, the default trace_id. */
    public static String newTraceId() {
        byte[] b = new byte[16];
        RANDOM.nextBytes(b);
        return HexFormat.of().formatHex(b);
    }

    public String taskId() { return taskId; }
    public String taskType() { return taskType; }
    public long payloadVersion() { return payloadVersion; }
    /** A copy of the payload object. */
    public ObjectNode payload() { return payload.deepCopy(); }
    /** When the task may run; null: now. */
    public Timestamp scheduleTime() { return scheduleTime; }
    /** Longest time one attempt may run (ms); null: no limit. */
    public Long timeoutMs() { return timeoutMs; }
    /** After this instant the task must not start; null: never expires. */
    public Timestamp expires() { return expires; }
    /** Most retries after the first attempt; null: unlimited. */
    public Long maxRetries() { return maxRetries; }
    public long retryCount() { return retryCount; }
    public int priority() { return priority; }
    public String traceId() { return traceId; }
    public Timestamp createdAt() { return createdAt; }
    /** Null when the task has none. */
    public String idempotencyKey() { return idempotencyKey; }
    /**
     * The ordering key: tasks with the same key on a queue run one at a time, in the order they
     * joined it (docs/protocol.md section 20). Null when the task has none.
     */
    public String orderingKey() { return orderingKey; }
    public Map<String, String> headers() { return headers; }
    /** Namespaces in the order read; values are copies. */
    public Map<String, ObjectNode> ext() {
        Map<String, ObjectNode> x = new LinkedHashMap<>();
        ext.forEach((k, v) -> x.put(k, v.deepCopy()));
        return x;
    }

    /** Whether the task may run at {@code now}. */
    public boolean isDue(Instant now) {
        return scheduleTime == null || !scheduleTime.isAfter(now);
    }

    /** Whether the task expired at {@code now}: its {@code expires} is at or before it. */
    public boolean isExpired(Instant now) {
        return expires != null && !expires.isAfter(now);
    }

    /** Due time in ms since the Unix epoch ({@code nowMs} when unscheduled). */
    public long dueMs(long nowMs) {
        return scheduleTime == null ? nowMs : scheduleTime.toEpochMilli();
    }

    /** Whether the header {@code x-retry-policy} asks for the tiered automatic retries. */
    public boolean asksForTieredRetries() {
        return "tiered".equals(headers.get("x-retry-policy"));
    }

    // --- writing ---------------------------------------------------------------------------

    /**
     * The canonical JSON tree: fields in protocol order, headers sorted, {@code null} optional
     * fields left out except {@code max_retries}, whose null means unlimited.
     */
    public ObjectNode toJsonNode() {
        JsonNodeFactory f = Json.MAPPER.getNodeFactory();
        ObjectNode o = f.objectNode();
        o.put("task_id", taskId);
        o.put("task_type", taskType);
        o.put("payload_version", payloadVersion);
        o.set("payload", payload.deepCopy());
        if (scheduleTime != null) {
            o.put("schedule_time", scheduleTime.toString());
        }
        if (timeoutMs != null) {
            o.put("timeout_ms", timeoutMs);
        }
        if (expires != null) {
            o.put("expires", expires.toString());
        }
        if (maxRetries != null) {
            o.put("max_retries", maxRetries);
        } else {
            o.putNull("max_retries");
        }
        o.put("retry_count", retryCount);
        o.put("priority", priority);
        o.put("trace_id", traceId);
        o.put("created_at", createdAt == null ? null : createdAt.toString());
        if (idempotencyKey != null) {
            o.put("idempotency_key", idempotencyKey);
        }
        if (orderingKey != null) {
            o.put("ordering_key", orderingKey);
        }
        ObjectNode h = o.putObject("headers");
        headers.forEach(h::put);
        ObjectNode x = o.putObject("ext");
        ext.forEach((k, v) -> x.set(k, v.deepCopy()));
        return o;
    }

    /** The canonical compact UTF-8 JSON. */
    public byte[] toJson() {
        return Json.write(toJsonNode());
    }

    @Override
    public String toString() {
        return new String(toJson(), StandardCharsets.UTF_8);
    }

    @Override
    public boolean equals(Object o) {
        return o instanceof Envelope && ((Envelope) o).toJsonNode().equals(toJsonNode());
    }

    @Override
    public int hashCode() {
        return toJsonNode().hashCode();
    }

    // --- reading and validating ------------------------------------------------------------

    /** Validates UTF-8 JSON text as an Envelope (without the publish-time rules). */
    public static Envelope parse(byte[] data, Limits limits) {
        JsonNode root;
        try {
            root = Json.parse(data);
        } catch (Json.NotJson e) {
            throw new EnvelopeValidationException(List.of(new Violation("envelope", "json", e.getMessage())));
        }
        return fromJson(root, limits);
    }

    public static Envelope parse(byte[] data) {
        return parse(data, Limits.DEFAULT);
    }

    public static Envelope parse(String text) {
        return parse(text.getBytes(StandardCharsets.UTF_8), Limits.DEFAULT);
    }

    /**
     * Checks every rule except the publish-time ones by writing the Envelope and reading it back,
     * so a built Envelope meets exactly the rules a reader applies.
     */
    public Envelope validate(Limits limits) {
        return parse(toJson(), limits);
    }

    /** Applies the publish-time rule {@code max_delay}. */
    public void checkPublishable(Limits limits, Instant now) {
        if (scheduleTime != null && scheduleTime.isAfter(now.plus(limits.maxDelay()))) {
            throw new EnvelopeValidationException(List.of(new Violation("schedule_time", "max_delay",
                    scheduleTime + " is more than " + limits.maxDelay() + " (the maximum delay) ahead of now")));
        }
    }

    /** Validates a parsed JSON value as an Envelope. */
    public static Envelope fromJson(JsonNode root, Limits limits) {
        Checker c = new Checker();
        if (root == null || !root.isObject()) {
            c.add("envelope", "type", "an Envelope is a JSON object, not " + (root == null ? "null" : Json.kind(root)));
            throw new EnvelopeValidationException(c.violations);
        }
        Builder e = new Builder();
        e.taskId = null;
        e.traceId = null;
        e.createdAt = null;
        JsonNode v;
        if ((v = root.get("task_id")) == null) {
            c.add("task_id", "required", "field required (producers fill it in; readers never invent it)");
        } else {
            e.taskId = c.token(v, "task_id", 255);
        }
        if ((v = root.get("task_type")) == null) {
            c.add("task_type", "required", "field required");
        } else {
            String s = c.str(v, "task_type", 1, 255);
            if (s != null) {
                if (!TASK_TYPE.matcher(s).matches()) {
                    c.add("task_type", "pattern", "must be dotted identifiers, e.g. order.close_timeout");
                }
                e.taskType = s;
            }
        }
        if ((v = root.get("payload_version")) != null) {
            Long n = c.integer(v, "payload_version", 1, MAX_SAFE_INTEGER);
            if (n != null) {
                e.payloadVersion = n;
            }
        }
        if ((v = root.get("payload")) != null) {
            if (!v.isObject()) {
                c.add("payload", "type", "must be a JSON object, not " + Json.kind(v));
            } else if (c.jsonData(v, "payload", "payload", limits.maxPayloadDepth())) {
                int size = Json.write(v).length;
                if (size > limits.maxPayloadBytes()) {
                    c.add("payload", "max_bytes", "payload is " + size + " bytes of JSON, above the limit of "
                            + limits.maxPayloadBytes());
                }
                e.payload = (ObjectNode) v;
            }
        }
        if ((v = root.get("schedule_time")) != null && !v.isNull()) {
            e.scheduleTime = c.timestamp(v, "schedule_time");
        }
        if ((v = root.get("timeout_ms")) != null && !v.isNull()) {
            e.timeoutMs = c.integer(v, "timeout_ms", 1, MAX_SAFE_INTEGER);
        }
        if ((v = root.get("expires")) != null && !v.isNull()) {
            e.expires = c.timestamp(v, "expires");
        }
        boolean maxRetriesOk = true;
        if ((v = root.get("max_retries")) != null) {
            if (v.isNull()) {
                e.maxRetries = null;
            } else {
                Long n = c.integer(v, "max_retries", 0, MAX_SAFE_INTEGER);
                if (n != null) {
                    e.maxRetries = n;
                } else {
                    maxRetriesOk = false;
                }
            }
        }
        if ((v = root.get("retry_count")) != null) {
            Long n = c.integer(v, "retry_count", 0, MAX_SAFE_INTEGER);
            if (n != null) {
                e.retryCount = n;
            }
        }
        if (maxRetriesOk && e.maxRetries != null && e.retryCount > e.maxRetries) {
            c.add("retry_count", "retry_count_le_max_retries",
                    "retry_count (" + e.retryCount + ") exceeds max_retries (" + e.maxRetries + ")");
        }
        if ((v = root.get("priority")) != null) {
            Long n = c.integer(v, "priority", 0, 255);
            if (n != null) {
                e.priority = n.intValue();
            }
        }
        if ((v = root.get("trace_id")) == null) {
            c.add("trace_id", "required", "field required (producers fill it in; readers never invent it)");
        } else {
            e.traceId = c.token(v, "trace_id", 128);
        }
        if ((v = root.get("created_at")) == null) {
            c.add("created_at", "required", "field required (producers fill it in; readers never invent it)");
        } else {
            e.createdAt = c.timestamp(v, "created_at");
        }
        if ((v = root.get("idempotency_key")) != null && !v.isNull()) {
            e.idempotencyKey = c.str(v, "idempotency_key", 1, 512);
        }
        if ((v = root.get("ordering_key")) != null && !v.isNull()) {
            e.orderingKey = c.token(v, "ordering_key", 255);
        }
        if ((v = root.get("headers")) != null) {
            if (!v.isObject()) {
                c.add("headers", "type", "must be an object of string to string, not " + Json.kind(v));
            } else {
                for (Iterator<Map.Entry<String, JsonNode>> it = v.fields(); it.hasNext(); ) {
                    Map.Entry<String, JsonNode> m = it.next();
                    if (!m.getValue().isTextual()) {
                        c.add("headers." + m.getKey(), "type", "header values are strings, not " + Json.kind(m.getValue()));
                    } else {
                        e.headers.put(m.getKey(), m.getValue().textValue());
                    }
                }
            }
        }
        if ((v = root.get("ext")) != null) {
            if (!v.isObject()) {
                c.add("ext", "type", "must be an object of namespace to object, not " + Json.kind(v));
            } else {
                for (Iterator<Map.Entry<String, JsonNode>> it = v.fields(); it.hasNext(); ) {
                    Map.Entry<String, JsonNode> m = it.next();
                    String field = "ext." + m.getKey();
                    if (!EXT_NAME.matcher(m.getKey()).matches()) {
                        c.add(field, "pattern", "namespaces match ^[a-z][a-z0-9_.-]*$");
                    } else if (!m.getValue().isObject()) {
                        c.add(field, "type", "must be a JSON object, not " + Json.kind(m.getValue()));
                    } else if (c.jsonData(m.getValue(), "ext", field, MAX_EXT_DEPTH - 1)) {
                        e.ext.put(m.getKey(), (ObjectNode) m.getValue());
                    }
                }
            }
        }
        for (Iterator<String> it = root.fieldNames(); it.hasNext(); ) {
            String name = it.next();
            if (!KNOWN.contains(name)) {
                c.add(name, "unknown_field", "extra fields are not permitted (language-specific data goes under ext)");
            }
        }
        if (!c.violations.isEmpty()) {
            throw new EnvelopeValidationException(c.violations);
        }
        return new Envelope(e);
    }

    private static final class Checker {
        final List<Violation> violations = new ArrayList<>();

        void add(String field, String rule, String message) {
            violations.add(new Violation(field, rule, message));
        }

        String str(JsonNode v, String field, int min, int max) {
            if (!v.isTextual()) {
                add(field, "type", "must be a string, not " + Json.kind(v));
                return null;
            }
            String s = v.textValue();
            int n = s.codePointCount(0, s.length());
            if (n < min || n > max) {
                add(field, "length", "must be " + min + " to " + max + " characters long, not " + n);
                return null;
            }
            return s;
        }

        String token(JsonNode v, String field, int max) {
            String s = str(v, field, 1, max);
            if (s == null) {
                return null;
            }
            if (!TOKEN.matcher(s).matches()) {
                add(field, "pattern", "must be printable ASCII without spaces");
                return null;
            }
            return s;
        }

        Long integer(JsonNode v, String field, long lo, long hi) {
            if (!v.isIntegralNumber()) {
                add(field, "type", "must be an integer written without fraction or exponent, not "
                        + (v.isNumber() ? "a decimal number" : Json.kind(v)));
                return null;
            }
            BigInteger n = v.bigIntegerValue();
            if (n.compareTo(BigInteger.valueOf(lo)) < 0 || n.compareTo(BigInteger.valueOf(hi)) > 0) {
                add(field, "range", "must be between " + lo + " and " + hi);
                return null;
            }
            return n.longValue();
        }

        Timestamp timestamp(JsonNode v, String field) {
            if (!v.isTextual()) {
                add(field, "type", "must be an RFC 3339 string with an offset, not " + Json.kind(v)
                        + " (numeric timestamps are ambiguous)");
                return null;
            }
            try {
                return Timestamp.parseChecked(v.textValue());
            } catch (Timestamp.TimeError e) {
                add(field, e.rule, e.getMessage());
                return null;
            }
        }

        /** Nesting (the value itself is level 1) and finite numbers; violations name field. */
        boolean jsonData(JsonNode v, String field, String where, int maxDepth) {
            return walk(v, field, where, 1, maxDepth);
        }

        private boolean walk(JsonNode v, String field, String where, int level, int maxDepth) {
            if (v.isContainerNode()) {
                if (level > maxDepth) {
                    add(field, "max_depth", "nested deeper than " + maxDepth + " levels at " + where);
                    return false;
                }
                if (v.isArray()) {
                    int i = 0;
                    for (JsonNode item : v) {
                        if (!walk(item, field, where + "[" + i++ + "]", level + 1, maxDepth)) {
                            return false;
                        }
                    }
                } else {
                    for (Iterator<Map.Entry<String, JsonNode>> it = v.fields(); it.hasNext(); ) {
                        Map.Entry<String, JsonNode> m = it.next();
                        if (!walk(m.getValue(), field, where + "." + m.getKey(), level + 1, maxDepth)) {
                            return false;
                        }
                    }
                }
            } else if (v.isNumber() && !v.isIntegralNumber()) {
                BigDecimal d = v.decimalValue();
                if (Double.isInfinite(d.doubleValue())) {
                    add(field, "json_value", where + " is too large for a double (infinity is not JSON)");
                    return false;
                }
            }
            return true;
        }
    }

    /** Builds an Envelope; {@link #build()} validates it (every rule but the publish-time ones). */
    public static final class Builder {
        private String taskId = newTaskId();
        private String taskType;
        private long payloadVersion = 1;
        private ObjectNode payload = Json.MAPPER.createObjectNode();
        private Timestamp scheduleTime;
        private Long timeoutMs;
        private Timestamp expires;
        private Long maxRetries = MAX_RETRIES_DEFAULT;
        private long retryCount;
        private int priority = PRIORITY_DEFAULT;
        private String traceId = currentTraceId();
        private boolean traceIdSet;
        private Timestamp createdAt = Timestamp.now();
        private String idempotencyKey;
        private String orderingKey;
        private final Map<String, String> headers = new TreeMap<>();
        private final Map<String, ObjectNode> ext = new LinkedHashMap<>();
        private Limits limits = Limits.DEFAULT;

        private Builder() {}

        public Builder taskId(String v) { taskId = v; return this; }
        public Builder taskType(String v) { taskType = v; return this; }
        public Builder payloadVersion(long v) { payloadVersion = v; return this; }
        public Builder payload(ObjectNode v) { payload = Objects.requireNonNull(v, "payload").deepCopy(); return this; }
        /** The payload from a map (or any value Jackson turns into a JSON object). */
        public Builder payload(Map<String, ?> v) { payload = Json.MAPPER.valueToTree(v); return this; }
        /** Sets one payload member from any value Jackson can write. */
        public Builder put(String name, Object value) { payload.set(name, Json.MAPPER.valueToTree(value)); return this; }
        public Builder scheduleTime(Timestamp v) { scheduleTime = v; return this; }
        public Builder scheduleTime(Instant v) { scheduleTime = v == null ? null : Timestamp.of(v); return this; }
        public Builder timeoutMs(Long v) { timeoutMs = v; return this; }
        /** After this instant the task must not start (Celery's {@code expires}); null: never. */
        public Builder expires(Timestamp v) { expires = v; return this; }
        /** An expiry instant, written in UTC; null: never. */
        public Builder expires(Instant v) { expires = v == null ? null : Timestamp.of(v); return this; }
        /** Expires {@code ttl} from now (Celery's relative {@code expires}). */
        public Builder expiresIn(Duration ttl) { return expires(Instant.now().plus(Objects.requireNonNull(ttl, "ttl"))); }
        /** Null: unlimited. */
        public Builder maxRetries(Long v) { maxRetries = v; return this; }
        public Builder retryCount(long v) { retryCount = v; return this; }
        public Builder priority(int v) { priority = v; return this; }
        /** The trace_id; unless set, that of {@code headers.traceparent} when valid, else {@link #currentTraceId()}. */
        public Builder traceId(String v) { traceId = v; traceIdSet = true; return this; }
        public Builder createdAt(Timestamp v) { createdAt = v; return this; }
        public Builder idempotencyKey(String v) { idempotencyKey = v; return this; }
        /** The ordering key (docs/protocol.md section 20): 1-255 printable ASCII characters without spaces; null: none. */
        public Builder orderingKey(String v) { orderingKey = v; return this; }
        public Builder header(String name, String value) {
            if (value == null) {
                headers.remove(name);
            } else {
                headers.put(name, value);
            }
            return this;
        }
        public Builder headers(Map<String, String> v) { headers.clear(); headers.putAll(v); return this; }
        public Builder ext(String namespace, ObjectNode value) {
            if (value == null) {
                ext.remove(namespace);
            } else {
                ext.put(namespace, value.deepCopy());
            }
            return this;
        }
        /** Asks for the tiered automatic retries ({@code x-retry-policy: tiered}). */
        public Builder tieredRetries() { return header("x-retry-policy", "tiered"); }
        public Builder limits(Limits v) { limits = Objects.requireNonNull(v, "limits"); return this; }

        /**
         * The Envelope, validated as a reader would validate it.
         *
         * @throws EnvelopeValidationException naming the field and the rule
         */
        public Envelope build() {
            if (taskType == null) {
                throw new EnvelopeValidationException(List.of(new Violation("task_type", "required", "field required")));
            }
            String inTrace = traceIdSet ? null : Tracing.traceIdOf(headers.get(Tracing.TRACEPARENT));
            if (inTrace != null) {
                traceId = inTrace;
            }
            Envelope e = new Envelope(this);
            return parse(e.toJson(), limits);
        }
    }
}
