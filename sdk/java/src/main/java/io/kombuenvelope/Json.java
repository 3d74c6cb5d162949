package io.kombuenvelope;

import com.fasterxml.jackson.core.JsonProcessingException;
import com.fasterxml.jackson.core.StreamReadConstraints;
import com.fasterxml.jackson.databind.DeserializationFeature;
import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import com.fasterxml.jackson.databind.cfg.JsonNodeFeature;
import com.fasterxml.jackson.databind.json.JsonMapper;

import java.io.IOException;
import java.io.UncheckedIOException;
import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.Iterator;
import java.util.Map;

/**
 * Strict JSON for Envelopes: UTF-8 only, no trailing data, no NaN, no lone surrogates, and numbers
 * kept as written (a {@code 1.0} stays a decimal, so integer fields can refuse it).
 */
final class Json {
    /** Nesting bound while parsing, so hostile input cannot exhaust the stack. */
    static final int MAX_PARSE_DEPTH = 256;

    static final ObjectMapper MAPPER = JsonMapper.builder()
            .enable(DeserializationFeature.FAIL_ON_TRAILING_TOKENS)
            .enable(DeserializationFeature.USE_BIG_DECIMAL_FOR_FLOATS)
            .enable(DeserializationFeature.USE_BIG_INTEGER_FOR_INTS)
            .disable(JsonNodeFeature.STRIP_TRAILING_BIGDECIMAL_ZEROES)
            .build();

    static {
        MAPPER.getFactory().setStreamReadConstraints(StreamReadConstraints.builder()
                .maxNestingDepth(MAX_PARSE_DEPTH).maxNumberLength(100_000)
                .maxStringLength(Integer.MAX_VALUE).build());
    }

    private Json() {}

    /** Thrown for text that is not JSON (rule {@code json}). */
    static final class NotJson extends Exception {
        NotJson(String message) {
            super(message);
        }
    }

    static JsonNode parse(byte[] data) throws NotJson {
        String text;
        try {
            text = StandardCharsets.UTF_8.newDecoder()
                    .onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT)
                    .decode(ByteBuffer.wrap(data)).toString();
        } catch (CharacterCodingException e) {
            throw new NotJson("not valid UTF-8");
        }
        return parse(text);
    }

    static JsonNode parse(String text) throws NotJson {
        JsonNode node;
        try {
            node = MAPPER.readTree(text);
        } catch (JsonProcessingException e) {
            throw new NotJson("not JSON: " + e.getOriginalMessage());
        }
        if (node == null || node.isMissingNode()) {
            throw new NotJson("not JSON: empty document");
        }
        String bad = loneSurrogate(node);
        if (bad != null) {
            throw new NotJson("not JSON: unpaired surrogate escape in " + bad);
        }
        return node;
    }

    /** Where a string (or object key) holds an unpaired UTF-16 surrogate, else null. */
    private static String loneSurrogate(JsonNode node) {
        if (node.isTextual()) {
            return hasLoneSurrogate(node.textValue()) ? "a string" : null;
        }
        if (node.isObject()) {
            for (Iterator<Map.Entry<String, JsonNode>> it = node.fields(); it.hasNext(); ) {
                Map.Entry<String, JsonNode> m = it.next();
                if (hasLoneSurrogate(m.getKey())) {
                    return "an object key";
                }
                String inner = loneSurrogate(m.getValue());
                if (inner != null) {
                    return inner;
                }
            }
        } else if (node.isArray()) {
            for (JsonNode item : node) {
                String inner = loneSurrogate(item);
                if (inner != null) {
                    return inner;
                }
            }
        }
        return null;
    }

    static boolean hasLoneSurrogate(String s) {
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            if (Character.isHighSurrogate(c)) {
                if (i + 1 < s.length() && Character.isLowSurrogate(s.charAt(i + 1))) {
                    i++;
                    continue;
                }
                return true;
            }
            if (Character.isLowSurrogate(c)) {
                return true;
            }
        }
        return false;
    }

    /** Compact UTF-8 JSON. */
    static byte[] write(JsonNode node) {
        try {
            return MAPPER.writeValueAsBytes(node);
        } catch (IOException e) {
            throw new UncheckedIOException(e);
        }
    }

    static String kind(JsonNode node) {
        switch (node.getNodeType()) {
            case OBJECT: return "object";
            case ARRAY: return "array";
            case STRING: return "string";
            case NUMBER: return "number";
            case BOOLEAN: return "boolean";
            case NULL: return "null";
            default: return node.getNodeType().name().toLowerCase();
        }
    }
}
