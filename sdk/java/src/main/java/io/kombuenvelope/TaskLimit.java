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
 * {@code smooth}, and a circuit {@code breaker}. A member not given is null. Every instance is valid:
 * build one with {@link #builder()} or read one with {@link #fromJson(JsonNode)}, both checked against
 * the schema.
 */
public record TaskLimit(Long concurrency, Double rate, Long burst, Boolean smooth, Breaker breaker) {
    private static final List<String> MEMBERS = List.of("breaker", "burst", "concurrency", "rate", "smooth");

    /** Checks the members against the schema; throws {@link InvalidLimitException} naming field and rule. */
    public TaskLimit {
        check(node(concurrency, rate, burst, smooth, breaker));
    }

    public static Builder builder() {
        return new Builder();
    }

    /** The limits a JSON value describes, checked against the schema first. */
    public static TaskLimit fromJson(JsonNode json) {
        check(json);
        return new TaskLimit(integer(json.get("concurrency")), number(json.get("rate")), integer(json.get("burst")),
                json.has("smooth") ? json.get("smooth").booleanValue() : null,
                json.has("breaker") ? Breaker.read(json.get("breaker")) : null);
    }

    /** The limits of a JSON text (as stored in {@code <prefix>:{<queue>}:limits}), checked against the schema. */
    public static TaskLimit parse(String json) {
        try {
            return fromJson(Json.parse(json));
        } catch (Json.NotJson e) {
            throw new InvalidLimitException(new Violation("", "json", e.getMessage()));
        }
    }

    /** The canonical JSON: compact, only the members given, in name order (the breaker's too). */
    public String toJson() {
        return new String(Json.write(node(concurrency, rate, burst, smooth, breaker)), StandardCharsets.UTF_8);
    }

    private static ObjectNode node(Long concurrency, Double rate, Long burst, Boolean smooth, Breaker breaker) {
        ObjectNode o = Json.MAPPER.createObjectNode();
        if (breaker != null) {
            o.set("breaker", breaker.node());
        }
        putInteger(o, "burst", burst);
        putInteger(o, "concurrency", concurrency);
        putNumber(o, "rate", rate);
        if (smooth != null) {
            o.put("smooth", smooth);
        }
        return o;
    }

    private static void putInteger(ObjectNode o, String name, Long value) {
        if (value != null) {
            o.put(name, value);
        }
    }

    /** A number given, written as an integer when it is one (60, not 60.0). */
    private static void putNumber(ObjectNode o, String name, Double value) {
        if (value == null) {
            return;
        }
        if (value == Math.rint(value) && Math.abs(value) < 0x1p53) {
            o.put(name, value.longValue());
        } else {
            o.put(name, value);
        }
    }

    private static Long integer(JsonNode n) {
        return n == null ? null : n.longValue();
    }

    private static Double number(JsonNode n) {
        return n == null ? null : n.doubleValue();
    }

    /** Throws the first rule {@code json} breaks: its shape, unknown members, each member, then required. */
    static void check(JsonNode json) {
        if (json == null || !json.isObject()) {
            throw invalid("", "type", "limits must be a JSON object, not " + (json == null ? "nothing" : Json.kind(json)));
        }
        checkMembers(json, "", MEMBERS);
        checkInteger(json, "", "concurrency");
        checkPositive(json, "", "rate", "starts per second");
        checkInteger(json, "", "burst");
        JsonNode smooth = json.get("smooth");
        if (smooth != null && !smooth.isBoolean()) {
            throw invalid("smooth", "type", "smooth must be a boolean, not " + Json.kind(smooth));
        }
        JsonNode breaker = json.get("breaker");
        if (breaker != null) {
            Breaker.check(breaker);
        }
        if (!json.has("concurrency") && !json.has("rate") && breaker == null) {
            throw invalid("concurrency", "required", "at least one of concurrency, rate and breaker is required");
        }
    }

    /** Every member of object {@code json} is one of {@code members}; field {@code path + name} otherwise. */
    private static void checkMembers(JsonNode json, String path, List<String> members) {
        for (Iterator<String> it = json.fieldNames(); it.hasNext(); ) {
            String name = it.next();
            if (!members.contains(name)) {
                throw invalid(path + name, "unknown_field",
                        "unknown member \"" + path + name + "\" (allowed: " + members + ")");
            }
        }
    }

    /** Member {@code name}, when given, is an integer of 64 bits at least 1. */
    private static void checkInteger(JsonNode json, String path, String name) {
        JsonNode n = json.get(name);
        if (n == null) {
            return;
        }
        String field = path + name;
        BigDecimal value = n.isNumber() ? n.decimalValue() : null;
        if (value == null || value.stripTrailingZeros().scale() > 0
                || value.toBigInteger().bitLength() >= Long.SIZE) {
            throw invalid(field, "type", field + " must be an integer (of 64 bits), not " + n);
        }
        if (value.signum() <= 0) {
            throw invalid(field, "minimum", field + " must be >= 1, not " + n);
        }
    }

    /** Member {@code name}, when given, is a finite number > 0 (rule {@code minimum} otherwise). */
    private static void checkPositive(JsonNode json, String path, String name, String meaning) {
        JsonNode n = json.get(name);
        if (n == null) {
            return;
        }
        String field = path + name;
        if (!n.isNumber()) {
            throw invalid(field, "type", field + " must be a number, not " + Json.kind(n));
        }
        if (!Double.isFinite(n.doubleValue()) || n.doubleValue() <= 0 || n.decimalValue().signum() <= 0) {
            throw invalid(field, "minimum", field + " must be a finite number > 0 (" + meaning + "), not " + n);
        }
    }

    private static InvalidLimitException invalid(String field, String rule, String message) {
        return new InvalidLimitException(new Violation(field, rule, message));
    }

    /**
     * The circuit breaker of a task type (section 19, member {@code breaker}): once at least
     * {@code minAttempts} attempts ended within {@code windowSeconds} and at least {@code failureRatio}
     * of them failed, no attempt starts for {@code cooldownSeconds}; then {@code probes} attempts are let
     * through, and their successes close it, a failure opens it again. Enforced by {@code read.lua} from
     * the worker statistics (section 17). A member not given is null ({@code read.lua}'s default: 20
     * attempts, 60 s, 30 s, 1 probe); {@code failureRatio} is required.
     */
    public record Breaker(Double failureRatio, Long minAttempts, Double windowSeconds, Double cooldownSeconds,
                          Long probes) {
        private static final String PATH = "breaker.";
        private static final List<String> MEMBERS =
                List.of("cooldown_s", "failure_ratio", "min_attempts", "probes", "window_s");

        /** Checks the members against the schema; throws {@link InvalidLimitException} naming field and rule. */
        public Breaker {
            check(node(failureRatio, minAttempts, windowSeconds, cooldownSeconds, probes));
        }

        public static Builder builder() {
            return new Builder();
        }

        private static Breaker read(JsonNode json) {
            return new Breaker(number(json.get("failure_ratio")), integer(json.get("min_attempts")),
                    number(json.get("window_s")), number(json.get("cooldown_s")), integer(json.get("probes")));
        }

        private ObjectNode node() {
            return node(failureRatio, minAttempts, windowSeconds, cooldownSeconds, probes);
        }

        private static ObjectNode node(Double failureRatio, Long minAttempts, Double windowSeconds,
                                       Double cooldownSeconds, Long probes) {
            ObjectNode o = Json.MAPPER.createObjectNode();
            putNumber(o, "cooldown_s", cooldownSeconds);
            putNumber(o, "failure_ratio", failureRatio);
            putInteger(o, "min_attempts", minAttempts);
            putInteger(o, "probes", probes);
            putNumber(o, "window_s", windowSeconds);
            return o;
        }

        /** Its shape, unknown members, each member (type, minimum, maximum), then required. */
        private static void check(JsonNode json) {
            if (!json.isObject()) {
                throw invalid("breaker", "type", "breaker must be a JSON object, not " + Json.kind(json));
            }
            checkMembers(json, PATH, MEMBERS);
            checkPositive(json, PATH, "failure_ratio", "the share of failed attempts that opens the breaker");
            JsonNode ratio = json.get("failure_ratio");
            if (ratio != null && ratio.decimalValue().compareTo(BigDecimal.ONE) > 0) {
                throw invalid(PATH + "failure_ratio", "maximum", PATH + "failure_ratio must be <= 1, not " + ratio);
            }
            checkInteger(json, PATH, "min_attempts");
            checkPositive(json, PATH, "window_s", "seconds");
            checkPositive(json, PATH, "cooldown_s", "seconds");
            checkInteger(json, PATH, "probes");
            if (ratio == null) {
                throw invalid(PATH + "failure_ratio", "required", "a breaker needs its failure_ratio");
            }
        }

        /** Builds a {@link Breaker}; {@link #build()} checks it against the schema. */
        public static final class Builder {
            private Double failureRatio;
            private Long minAttempts;
            private Double windowSeconds;
            private Double cooldownSeconds;
            private Long probes;

            private Builder() {}

            /** The share of failed attempts that opens the breaker (0 < r ≤ 1; required). */
            public Builder failureRatio(double v) { failureRatio = v; return this; }
            /** Attempts that must have ended within the window before it can open (≥ 1; 20 unless set). */
            public Builder minAttempts(long v) { minAttempts = v; return this; }
            /** The window the outcomes are counted over, in seconds (> 0; 60 unless set). */
            public Builder windowSeconds(double v) { windowSeconds = v; return this; }
            /** How long an open breaker starts nothing, in seconds (> 0; 30 unless set). */
            public Builder cooldownSeconds(double v) { cooldownSeconds = v; return this; }
            /** Attempts let through half-open, all of which must succeed to close it (≥ 1; 1 unless set). */
            public Builder probes(long v) { probes = v; return this; }

            public Breaker build() {
                return new Breaker(failureRatio, minAttempts, windowSeconds, cooldownSeconds, probes);
            }
        }
    }

    /** Builds a {@link TaskLimit}; {@link #build()} checks it against the schema. */
    public static final class Builder {
        private Long concurrency;
        private Double rate;
        private Long burst;
        private Boolean smooth;
        private Breaker breaker;

        private Builder() {}

        /** Attempts of this type running at once on the queue, all workers together (≥ 1). */
        public Builder concurrency(long v) { concurrency = v; return this; }
        /** Starts per second (> 0). */
        public Builder rate(double v) { rate = v; return this; }
        /** Starts allowed back to back above the rate after an idle spell (≥ 1; 1 unless set). */
        public Builder burst(long v) { burst = v; return this; }
        /** Spaces every start evenly (burst 1 whatever is set). */
        public Builder smooth(boolean v) { smooth = v; return this; }
        /** The circuit breaker: no starts for a while after too many failures. */
        public Builder breaker(Breaker v) { breaker = v; return this; }

        public TaskLimit build() {
            return new TaskLimit(concurrency, rate, burst, smooth, breaker);
        }
    }
}
