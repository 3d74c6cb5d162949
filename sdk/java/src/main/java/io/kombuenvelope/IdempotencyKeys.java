package io.kombuenvelope;

import com.fasterxml.jackson.databind.JsonNode;

import java.util.ArrayList;
import java.util.Iterator;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;

/**
 * The idempotency key rule of docs/protocol.md section 9, the same as Python's
 * {@code idempotency_fields}: the named payload fields in the order given, joined with {@code :};
 * a string as it is, any other value as compact JSON with sorted keys and non-ASCII escaped as
 * lower-case {@code \\uXXXX}.
 */
public final class IdempotencyKeys {
    private IdempotencyKeys() {}

    /**
     * The key of {@code payload} from {@code fields}.
     *
     * @throws IllegalArgumentException naming a field the payload lacks
     */
    public static String derive(JsonNode payload, String... fields) {
        if (fields.length == 0) {
            throw new IllegalArgumentException("idempotency fields: name at least one payload field");
        }
        List<String> parts = new ArrayList<>(fields.length);
        for (String f : fields) {
            JsonNode v = payload.get(f);
            if (v == null) {
                throw new IllegalArgumentException("payload." + f + ": missing, but named as an idempotency field");
            }
            parts.add(v.isTextual() ? v.textValue() : canonical(v));
        }
        return String.join(":", parts);
    }

    /** Compact JSON, object keys sorted, every character beyond ASCII escaped. */
    static String canonical(JsonNode v) {
        StringBuilder b = new StringBuilder();
        write(b, v);
        return b.toString();
    }

    private static void write(StringBuilder b, JsonNode v) {
        if (v.isObject()) {
            Map<String, JsonNode> sorted = new TreeMap<>();
            for (Iterator<Map.Entry<String, JsonNode>> it = v.fields(); it.hasNext(); ) {
                Map.Entry<String, JsonNode> m = it.next();
                sorted.put(m.getKey(), m.getValue());
            }
            b.append('{');
            boolean first = true;
            for (Map.Entry<String, JsonNode> m : sorted.entrySet()) {
                if (!first) {
                    b.append(',');
                }
                first = false;
                string(b, m.getKey());
                b.append(':');
                write(b, m.getValue());
            }
            b.append('}');
        } else if (v.isArray()) {
            b.append('[');
            boolean first = true;
            for (JsonNode item : v) {
                if (!first) {
                    b.append(',');
                }
                first = false;
                write(b, item);
            }
            b.append(']');
        } else if (v.isTextual()) {
            string(b, v.textValue());
        } else {
            b.append(v.toString());
        }
    }

    private static void string(StringBuilder b, String s) {
        b.append('"');
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                case '\b': b.append("\\b"); break;
                case '\f': b.append("\\f"); break;
                default:
                    if (c < 0x20 || c > 0x7e) {
                        b.append(String.format("\\u%04x", (int) c));
                    } else {
                        b.append(c);
                    }
            }
        }
        b.append('"');
    }
}
