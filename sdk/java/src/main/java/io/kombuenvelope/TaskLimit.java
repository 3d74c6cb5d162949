package io.kombuenvelope;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.node.ObjectNode;

import java.math.BigDecimal;
import java.nio.charset.StandardCharsets;
import java.util.Iterator;
import java.util.List;

/**
 * The limits of one task type on one queue (docs/protocol.md section 19, schema
 * kombu_envelope/schemas/limits.schema.json): at most {@code concurrency} attempts running at once,
 * at most {@code rate} starts per second with {@code burst} back to back, or evenly spaced when
 * {@code smooth}. A member not given is null. Every instance is valid: build one with
 * {@link #builder()} or read one with {@link #fromJson(JsonNode)}, both checked against the schema.
 */
public record TaskLimit(Long concurrency, Double rate, Long burst, Boolean smooth) {
    private static final List<String> MEMBERS = List.of("concurrency", "rate", "burst", "smooth");

    /** Checks the members against the schema; throws {@link InvalidLimitException} naming field and rule. */
    public TaskLimit {
        check(node(concurrency, rate, burst, smooth));
    }

    public static Builder builder() {
        return new Builder();
    }

    /** The limits a JSON value describes, checked against the schema first. */
    public static TaskLimit fromJson(JsonNode json) {
        check(json);
        return new TaskLimit(integer(json.get("concurrency")), json.has("rate") ? json.get("rate").doubleValue() : null,
                integer(json.get("burst")), json.has("smooth") ? json.get("smooth").booleanValue() : null);
    }

    /** The limits of a JSON text (as stored in {@code <prefix>:{<queue>}:limits}), checked against the schema. */
    public static TaskLimit parse(String json) {
        try {
            return fromJson(Json.parse(json));
        } catch (Json.NotJson e) {
            throw new InvalidLimitException(new Violation("", "json", e.getMessage()));
        }
    }

    /** The canonical JSON: compact, only the members given, in name order. */
    public String toJson() {
        return new String(Json.write(node(concurrency, rate, burst, smooth)), StandardCharsets.UTF_8);
    }

    private static ObjectNode node(Long concurrency, Double rate, Long burst, Boolean smooth) {
        ObjectNode o = Json.MAPPER.createObjectNode();
        if (burst != null) {
            o.put("burst", burst);
        }
        if (concurrency != null) {
            o.put("concurrency", concurrency);
        }
        if (rate != null) {
            if (rate == Math.rint(rate) && Math.abs(rate) < 0x1p53) {
                o.put("rate", rate.longValue());
            } else {
                o.put("rate", rate);
            }
        }
        if (smooth != null) {
            o.put("smooth", smooth);
        }
        return o;
    }

    private static Long integer(JsonNode n) {
        return n == null ? null : n.longValue();
    }

    /** Throws the first rule {@code json} breaks: its shape, unknown members, each member, then required. */
    static void check(JsonNode json) {
        if (json == null || !json.isObject()) {
            throw invalid("", "type", "limits must be a JSON object, not " + (json == null ? "nothing" : Json.kind(json)));
        }
        for (Iterator<String> it = json.fieldNames(); it.hasNext(); ) {
            String name = it.next();
            if (!MEMBERS.contains(name)) {
                throw invalid(name, "unknown_field", "unknown member \"" + name + "\" (allowed: " + MEMBERS + ")");
            }
        }
        checkInteger(json, "concurrency");
        JsonNode rate = json.get("rate");
        if (rate != null) {
            if (!rate.isNumber()) {
                throw invalid("rate", "type", "rate must be a number, not " + Json.kind(rate));
            }
            double value = rate.doubleValue();
            if (!Double.isFinite(value) || value <= 0 || rate.decimalValue().signum() <= 0) {
                throw invalid("rate", "minimum", "rate must be a finite number > 0 (starts per second), not " + rate);
            }
        }
        checkInteger(json, "burst");
        JsonNode smooth = json.get("smooth");
        if (smooth != null && !smooth.isBoolean()) {
            throw invalid("smooth", "type", "smooth must be a boolean, not " + Json.kind(smooth));
        }
        if (!json.has("concurrency") && !json.has("rate")) {
            throw invalid("concurrency", "required", "at least one of concurrency and rate is required");
        }
    }

    /** Member {@code name}, when given, is an integer of 64 bits at least 1. */
    private static void checkInteger(JsonNode json, String name) {
        JsonNode n = json.get(name);
        if (n == null) {
            return;
        }
        BigDecimal value = n.isNumber() ? n.decimalValue() : null;
        if (value == null || value.stripTrailingZeros().scale() > 0
                || value.toBigInteger().bitLength() >= Long.SIZE) {
            throw invalid(name, "type", name + " must be an integer (of 64 bits), not " + n);
        }
        if (value.signum() <= 0) {
            throw invalid(name, "minimum", name + " must be >= 1, not " + n);
        }
    }

    private static InvalidLimitException invalid(String field, String rule, String message) {
        return new InvalidLimitException(new Violation(field, rule, message));
    }

    /** Builds a {@link TaskLimit}; {@link #build()} checks it against the schema. */
    public static final class Builder {
        private Long concurrency;
        private Double rate;
        private Long burst;
        private Boolean smooth;

        private Builder() {}

        /** Attempts of this type running at once on the queue, all workers together (≥ 1). */
        public Builder concurrency(long v) { concurrency = v; return this; }
        /** Starts per second (> 0). */
        public Builder rate(double v) { rate = v; return this; }
        /** Starts allowed back to back above the rate after an idle spell (≥ 1; 1 unless set). */
        public Builder burst(long v) { burst = v; return this; }
        /** Spaces every start evenly (burst 1 whatever is set). */
        public Builder smooth(boolean v) { smooth = v; return this; }

        public TaskLimit build() {
            return new TaskLimit(concurrency, rate, burst, smooth);
        }
    }
}
