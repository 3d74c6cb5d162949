package io.kombuenvelope;

/**
 * One broken validation rule: the field (a dotted path, {@code envelope} for the whole document),
 * the rule name of docs/protocol.md section 1.2 and conformance/README.md, and a message.
 */
public record Violation(String field, String rule, String message) {
    @Override
    public String toString() {
        return field + ": " + message + " [" + rule + "]";
    }
}
