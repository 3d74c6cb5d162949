package io.kombuenvelope;

import static org.junit.jupiter.api.Assertions.assertEquals;
import static org.junit.jupiter.api.Assertions.assertTrue;
import static org.junit.jupiter.api.Assertions.fail;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.node.ObjectNode;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.time.Instant;
import java.util.ArrayList;
import java.util.Base64;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.stream.Stream;

import org.junit.jupiter.api.DynamicTest;
import org.junit.jupiter.api.Test;
import org.junit.jupiter.api.TestFactory;

/** Runs every vector of the repository's conformance/ folder (conformance/README.md). */
class ConformanceTest {

    /** The conformance folder: -Dkombuenvelope.conformance.dir, else found walking up from here. */
    static Path conformanceDir() {
        String prop = System.getProperty("kombuenvelope.conformance.dir");
        if (prop != null && !prop.isEmpty()) {
            return Paths.get(prop);
        }
        for (Path p = Paths.get("").toAbsolutePath(); p != null; p = p.getParent()) {
            if (Files.isRegularFile(p.resolve("conformance/manifest.json"))) {
                return p.resolve("conformance");
            }
        }
        throw new IllegalStateException("conformance/manifest.json not found above " + Paths.get("").toAbsolutePath()
                + "; set -Dkombuenvelope.conformance.dir");
    }

    static JsonNode manifest() throws IOException {
        return Json.MAPPER.readTree(conformanceDir().resolve("manifest.json").toFile());
    }

    static List<String> files(String kind) throws IOException {
        List<String> out = new ArrayList<>();
        manifest().get(kind).forEach(n -> out.add(n.asText()));
        return out;
    }

    @Test
    void manifestListsVectors() throws IOException {
        assertTrue(files("envelopes").size() > 50);
        assertTrue(files("entries").size() > 10);
        assertTrue(files("schemas").size() > 10);
        assertTrue(files("limits").size() > 10);
    }

    /** Each limits vector (protocol section 19): accepted or refused, naming the field and the rule. */
    @TestFactory
    Stream<DynamicTest> limits() throws IOException {
        Path dir = conformanceDir();
        return files("limits").stream().map(f -> DynamicTest.dynamicTest(f, () -> {
            JsonNode c = Json.MAPPER.readTree(dir.resolve(f).toFile());
            try {
                TaskLimit limit = TaskLimit.fromJson(c.get("input"));
                if (!c.get("valid").asBoolean()) {
                    fail("accepted, expected " + c.get("field").asText() + " [" + c.get("rule").asText() + "]");
                }
                assertEquals(reread(c.get("input")), Json.parse(limit.toJson()), "the canonical JSON changed a member");
            } catch (InvalidLimitException ex) {
                if (c.get("valid").asBoolean()) {
                    fail("refused valid limits: " + ex.getMessage());
                }
                assertEquals(c.get("field").asText() + " " + c.get("rule").asText(), ex.field() + " " + ex.rule(),
                        ex.getMessage());
            }
        }));
    }

    /** Each payload schema vector: the violations' fields, rules and keywords, in order (messages differ). */
    @TestFactory
    Stream<DynamicTest> schemas() throws IOException {
        Path dir = conformanceDir();
        return files("schemas").stream().map(f -> DynamicTest.dynamicTest(f, () -> {
            JsonNode c = Json.MAPPER.readTree(dir.resolve(f).toFile());
            List<SchemaViolation> got = PayloadSchemas.violations(
                    PayloadSchemas.compile(c.get("schema").toString()), c.get("payload"));
            List<String> want = new ArrayList<>();
            c.get("violations").forEach(v -> want.add(v.get("field").asText() + " " + v.get("rule").asText() + " "
                    + v.get("keyword").asText()));
            assertEquals(want, got.stream().map(v -> v.field() + " " + v.toViolation().rule() + " " + v.keyword())
                    .toList(), c.get("name").asText());
        }));
    }

    @TestFactory
    Stream<DynamicTest> envelopes() throws IOException {
        Path dir = conformanceDir();
        return files("envelopes").stream().map(f -> DynamicTest.dynamicTest(f, () -> runEnvelope(
                Json.MAPPER.readTree(dir.resolve(f).toFile()))));
    }

    @TestFactory
    Stream<DynamicTest> entries() throws IOException {
        Path dir = conformanceDir();
        return files("entries").stream().map(f -> DynamicTest.dynamicTest(f, () -> runEntry(
                Json.MAPPER.readTree(dir.resolve(f).toFile()))));
    }

    private static void runEnvelope(JsonNode c) {
        JsonNode input = c.get("input");
        byte[] text;
        if (input.isObject() && input.size() == 1 && input.has("raw") && input.get("raw").isTextual()) {
            text = input.get("raw").textValue().getBytes(StandardCharsets.UTF_8);
        } else {
            text = Json.write(input);
        }
        boolean publish = c.path("publish").asBoolean(false);
        boolean valid = c.get("valid").asBoolean();
        try {
            Envelope e;
            if (publish) {
                ObjectNode o = ((ObjectNode) Json.MAPPER.readTree(text)).deepCopy();
                Instant now = Instant.now();
                long offset = c.path("schedule_offset_s").asLong(0);
                o.put("schedule_time", Timestamp.of(now.plusSeconds(offset)).toString());
                e = Envelope.fromJson(o, Limits.DEFAULT);
                e.checkPublishable(Limits.DEFAULT, Instant.now());
            } else {
                e = Envelope.parse(text, Limits.DEFAULT);
            }
            if (!valid) {
                fail("accepted, expected " + c.get("field").asText() + " [" + c.get("rule").asText() + "]");
            }
            JsonNode expect = c.get("expect");
            if (expect != null) {
                compare(expect, e);
            }
        } catch (EnvelopeValidationException ex) {
            if (valid) {
                fail("refused a valid envelope: " + ex.getMessage());
            }
            assertViolation(c, ex.violations());
        } catch (IOException ex) {
            throw new IllegalStateException(ex);
        }
    }

    private static void assertViolation(JsonNode c, List<Violation> violations) {
        String field = c.get("field").asText();
        String rule = c.get("rule").asText();
        assertEquals(1, violations.size(), "expected exactly one violation, got " + violations);
        Violation v = violations.get(0);
        assertEquals(rule, v.rule(), "rule of " + v);
        assertEquals(field, v.field(), "field of " + v);
    }

    /** Each expected field equals the field as written back (re-read through the same parser). */
    private static void compare(JsonNode expect, Envelope e) {
        JsonNode written;
        try {
            written = Json.parse(e.toJson());
        } catch (Json.NotJson ex) {
            throw new AssertionError(ex);
        }
        JsonNode expected = reread(expect);
        for (Iterator<Map.Entry<String, JsonNode>> it = expected.fields(); it.hasNext(); ) {
            Map.Entry<String, JsonNode> m = it.next();
            assertTrue(written.has(m.getKey()), "field " + m.getKey() + " not written: " + written);
            assertEquals(m.getValue(), written.get(m.getKey()), "field " + m.getKey());
        }
    }

    private static JsonNode reread(JsonNode n) {
        try {
            return Json.parse(Json.write(n));
        } catch (Json.NotJson ex) {
            throw new AssertionError(ex);
        }
    }

    private static void runEntry(JsonNode c) {
        Map<String, byte[]> fields = new LinkedHashMap<>();
        for (Iterator<Map.Entry<String, JsonNode>> it = c.get("fields").fields(); it.hasNext(); ) {
            Map.Entry<String, JsonNode> m = it.next();
            if (m.getKey().equals("body_base64")) {
                fields.put("body", Base64.getDecoder().decode(m.getValue().asText()));
            } else {
                fields.put(m.getKey(), m.getValue().asText().getBytes(StandardCharsets.UTF_8));
            }
        }
        boolean valid = c.get("valid").asBoolean();
        try {
            Envelope e = EntryCodec.decodeEntry(fields, Limits.DEFAULT);
            if (!valid) {
                fail("decoded, expected error " + c.get("error").asText());
            }
            compare(c.get("envelope"), e);
        } catch (MalformedEntryException ex) {
            if (valid) {
                fail("refused a valid entry: " + ex.kind() + ": " + ex.getMessage());
            }
            assertEquals(c.get("error").asText(), ex.kind(), ex.getMessage());
            if (c.has("field")) {
                assertViolation(c, ex.violations());
            }
        }
    }
}
