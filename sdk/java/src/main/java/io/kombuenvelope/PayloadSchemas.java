package io.kombuenvelope;

import com.fasterxml.jackson.databind.JsonNode;
import com.networknt.schema.InputFormat;
import com.networknt.schema.Schema;
import com.networknt.schema.SchemaRegistry;
import com.networknt.schema.SchemaRegistryConfig;
import com.networknt.schema.SpecificationVersion;
import com.networknt.schema.path.NodePath;

import java.time.Duration;
import java.util.ArrayList;
import java.util.Comparator;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.function.Supplier;

import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * The payload schemas of one prefix (docs/protocol.md section 16): {@code <prefix>:schemas}, field
 * {@code <task_type>@<payload_version>}, JSON Schema draft 2020-12 referring only to itself, read
 * with HGETALL at most every {@code schema_cache_s} and compiled once per text. A stored schema
 * that cannot be compiled is logged and ignored. {@code format} is never asserted. Thread-safe.
 */
final class PayloadSchemas {
    /** The default {@code schema_cache_s}. */
    static final Duration DEFAULT_CACHE = Duration.ofSeconds(30);
    /** The longest dead-letter reason of a schema violation, in characters. */
    private static final int MAX_REASON = 1000;
    private static final Logger LOG = LoggerFactory.getLogger(PayloadSchemas.class);
    private static final SchemaRegistry REGISTRY = SchemaRegistry.withDefaultDialect(SpecificationVersion.DRAFT_2020_12,
            b -> b.schemaLoader(l -> l.fetchRemoteResources(false))
                    .schemaRegistryConfig(SchemaRegistryConfig.builder().formatAssertionsEnabled(false).build()));
    private static final String DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema";
    /** The draft 2020-12 meta-schema, shipped with the validator: nothing is fetched. */
    private static final Schema META = REGISTRY.getSchema(com.networknt.schema.SchemaLocation.of(DRAFT_2020_12));

    private final Supplier<Map<String, byte[]>> read;
    private final long cacheNs;
    private long readAt;
    private Map<String, String> texts;
    /** Field to compiled schema; absent when it cannot be used. */
    private Map<String, Schema> compiled = Map.of();

    /** Schemas read with {@code read} (HGETALL of the hash), kept {@code cache}. */
    PayloadSchemas(Supplier<Map<String, byte[]>> read, Duration cache) {
        if (cache.isNegative()) {
            throw new IllegalArgumentException("schemaCache must be >= 0");
        }
        this.read = read;
        this.cacheNs = cache.toNanos();
    }

    /**
     * The ways {@code e}'s payload breaks the schema of its type and version, sorted; empty when
     * it has none or keeps it. Throws what the read of the hash threw.
     */
    List<SchemaViolation> violations(Envelope e) {
        Schema schema = schemaOf(e.taskType() + "@" + e.payloadVersion());
        return schema == null ? List.of() : violations(schema, e.payload());
    }

    private synchronized Schema schemaOf(String field) {
        if (texts == null || System.nanoTime() - readAt >= cacheNs) {
            Map<String, byte[]> stored = read.get();
            Map<String, String> newTexts = new HashMap<>();
            Map<String, Schema> newCompiled = new HashMap<>();
            stored.forEach((f, raw) -> {
                String text = Redis.s(raw);
                newTexts.put(f, text);
                Schema s = texts != null && text.equals(texts.get(f)) ? compiled.get(f) : usable(f, text);
                if (s != null) {
                    newCompiled.put(f, s);
                }
            });
            texts = newTexts;
            compiled = newCompiled;
            readAt = System.nanoTime();
        }
        return compiled.get(field);
    }

    private static Schema usable(String field, String text) {
        try {
            return compile(text);
        } catch (RuntimeException e) {
            LOG.warn("payload schema {} is ignored: {}", field, e.getMessage());
            return null;
        }
    }

    /**
     * Compiles a payload schema: a JSON object, valid draft 2020-12 (unless it names another
     * {@code $schema}), whose every {@code $ref} is a pointer that resolves inside it.
     *
     * @throws IllegalArgumentException when it cannot be used
     */
    static Schema compile(String text) {
        JsonNode doc;
        try {
            doc = Json.parse(text);
        } catch (Json.NotJson e) {
            throw new IllegalArgumentException(e.getMessage(), e);
        }
        if (!doc.isObject()) {
            throw new IllegalArgumentException("a payload schema must be a JSON object");
        }
        checkReferences(doc, doc);
        try {
            if (!doc.has("$schema") || DRAFT_2020_12.equals(doc.path("$schema").asText())) {
                List<com.networknt.schema.Error> broken = META.validate(text, InputFormat.JSON);
                if (!broken.isEmpty()) {
                    throw new IllegalArgumentException("not a valid draft 2020-12 schema: " + broken);
                }
            }
            return REGISTRY.getSchema(text, InputFormat.JSON);
        } catch (RuntimeException e) {
            throw e instanceof IllegalArgumentException ? e
                    : new IllegalArgumentException("not a usable schema: " + e.getMessage(), e);
        }
    }

    /** Refuses a {@code $ref} that is not a pointer into {@code root} or does not resolve there. */
    private static void checkReferences(JsonNode root, JsonNode node) {
        if (node.isObject()) {
            JsonNode ref = node.get("$ref");
            if (ref != null) {
                String r = ref.asText();
                String pointer = r.startsWith("#") ? r.substring(1) : null;
                if (pointer == null || !(pointer.isEmpty() || pointer.startsWith("/")) || root.at(pointer).isMissingNode()) {
                    throw new IllegalArgumentException("$ref " + r + " does not resolve inside the schema "
                            + "(a payload schema refers only to itself: #/$defs/...)");
                }
            }
        }
        node.forEach(child -> checkReferences(root, child));
    }

    /**
     * The ways {@code payload} breaks {@code schema}: one per missing required member and per
     * unexpected member, each on that member's path, sorted by path segment by segment (indices
     * as numbers), then keyword, then message.
     */
    static List<SchemaViolation> violations(Schema schema, JsonNode payload) {
        List<Located> found = new ArrayList<>();
        for (com.networknt.schema.Error err : schema.validate(payload.toString(), InputFormat.JSON)) {
            List<Object> path = typed(payload, err.getInstanceLocation());
            String keyword = err.getKeyword() != null ? err.getKeyword() : "schema";
            if (("required".equals(keyword) || "additionalProperties".equals(keyword)) && err.getProperty() != null) {
                path.add(err.getProperty());
            }
            found.add(new Located(path, keyword, err.getMessage()));
        }
        found.sort(Comparator.comparing(Located::path, PayloadSchemas::comparePaths)
                .thenComparing(Located::keyword, PayloadSchemas::compareCodePoints)
                .thenComparing(Located::message, PayloadSchemas::compareCodePoints));
        return found.stream().map(l -> new SchemaViolation("payload" + pathText(l.path()), l.keyword(), l.message()))
                .toList();
    }

    /** The dead-letter reason: {@code "schema: <path>: <message>; ..."}, cut to 1,000 characters. */
    static String deadLetterReason(List<SchemaViolation> violations) {
        StringBuilder b = new StringBuilder("schema: ");
        for (int i = 0; i < violations.size(); i++) {
            b.append(i > 0 ? "; " : "").append(violations.get(i).field()).append(": ").append(violations.get(i).message());
        }
        String reason = b.toString();
        if (reason.codePointCount(0, reason.length()) <= MAX_REASON) {
            return reason;
        }
        return reason.substring(0, reason.offsetByCodePoints(0, MAX_REASON - 1)) + "…";
    }

    /** One violation before it is sorted; path segments are member names (String) or indices (Integer). */
    private record Located(List<Object> path, String keyword, String message) {}

    /** The segments of an instance location: an index where the value is an array, a name elsewhere. */
    private static List<Object> typed(JsonNode doc, NodePath location) {
        List<Object> out = new ArrayList<>();
        JsonNode at = doc;
        for (int i = 0; i < location.getNameCount(); i++) {
            String part = location.getName(i);
            if (at != null && at.isArray() && part.matches("\\d+") && Integer.parseInt(part) < at.size()) {
                int index = Integer.parseInt(part);
                out.add(index);
                at = at.get(index);
            } else {
                out.add(part);
                at = at != null && at.isObject() ? at.get(part) : null;
            }
        }
        return out;
    }

    private static String pathText(List<Object> path) {
        StringBuilder b = new StringBuilder();
        for (Object s : path) {
            b.append(s instanceof Integer ? "[" + s + "]" : "." + s);
        }
        return b.toString();
    }

    /** Segment by segment, an index before a name, indices as numbers; a prefix first. */
    private static int comparePaths(List<Object> a, List<Object> b) {
        for (int i = 0; i < Math.min(a.size(), b.size()); i++) {
            Object x = a.get(i);
            Object y = b.get(i);
            int c;
            if (x instanceof Integer xi && y instanceof Integer yi) {
                c = Integer.compare(xi, yi);
            } else if (x instanceof Integer || y instanceof Integer) {
                c = x instanceof Integer ? -1 : 1;
            } else {
                c = compareCodePoints((String) x, (String) y);
            }
            if (c != 0) {
                return c;
            }
        }
        return Integer.compare(a.size(), b.size());
    }

    private static int compareCodePoints(String a, String b) {
        return java.util.Arrays.compare(a.codePoints().toArray(), b.codePoints().toArray());
    }
}
