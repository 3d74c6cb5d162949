package io.kombuenvelope;

import java.util.List;
import java.util.stream.Collectors;

/** An Envelope that breaks one or more rules; each violation names the field and the rule. */
public class EnvelopeValidationException extends IllegalArgumentException {
    private static final long serialVersionUID = 1L;
    private final transient List<Violation> violations;

    public EnvelopeValidationException(List<Violation> violations) {
        super("invalid envelope: " + violations.stream().map(Violation::toString).collect(Collectors.joining("; ")));
        this.violations = List.copyOf(violations);
    }

    public List<Violation> violations() {
        return violations;
    }

    /** The first violation's field. */
    public String field() {
        return violations.get(0).field();
    }

    /** The first violation's rule. */
    public String rule() {
        return violations.get(0).rule();
    }
}
