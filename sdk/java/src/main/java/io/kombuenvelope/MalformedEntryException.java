package io.kombuenvelope;

import java.util.List;

/**
 * A stream entry that cannot be decoded into a valid Envelope. {@link #kind()} is one of the error
 * names of the conformance entry vectors: {@code missing_field}, {@code version}, {@code encoding},
 * {@code gzip}, {@code too_large}, {@code envelope} (then {@link #violations()} says why).
 */
public class MalformedEntryException extends Exception {
    private static final long serialVersionUID = 1L;
    private final String kind;
    private final transient List<Violation> violations;

    public MalformedEntryException(String kind, String reason, List<Violation> violations) {
        super(reason);
        this.kind = kind;
        this.violations = violations == null ? List.of() : List.copyOf(violations);
    }

    public String kind() {
        return kind;
    }

    public List<Violation> violations() {
        return violations;
    }
}
