package io.kombuenvelope;

/** A task type's limits that break a rule of the limits schema; names the field and the rule. */
public class InvalidLimitException extends IllegalArgumentException {
    private static final long serialVersionUID = 1L;
    private final transient Violation violation;

    public InvalidLimitException(Violation violation) {
        super("invalid limits: " + violation);
        this.violation = violation;
    }

    /** The offending member, {@code breaker.<member>} in the breaker ({@code ""} when the limits are not a JSON object). */
    public String field() {
        return violation.field();
    }

    /** The rule: {@code type}, {@code minimum}, {@code maximum}, {@code required} or {@code unknown_field}. */
    public String rule() {
        return violation.rule();
    }

    public Violation violation() {
        return violation;
    }
}
