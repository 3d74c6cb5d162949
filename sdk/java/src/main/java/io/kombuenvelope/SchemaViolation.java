package io.kombuenvelope;

/**
 * One way a payload breaks its schema (docs/protocol.md section 16): {@code field} is
 * {@code payload<path>}, {@code keyword} the JSON Schema keyword that failed, {@code message} the
 * validator's own words.
 */
public record SchemaViolation(String field, String keyword, String message) {
    /** The rule of every schema violation. */
    public static final String RULE = "schema";

    /** As a validation violation: this field, rule {@code schema}. */
    public Violation toViolation() {
        return new Violation(field, RULE, message);
    }
}
