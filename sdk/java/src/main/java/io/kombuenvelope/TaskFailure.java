package io.kombuenvelope;

import java.time.Duration;

/** Exceptions a {@link TaskHandler} throws to say how its attempt failed (docs/protocol.md section 8). */
public class TaskFailure extends Exception {
    private static final long serialVersionUID = 1L;

    protected TaskFailure(String message, Throwable cause) {
        super(message, cause);
    }

    /** The payload can never work: dead-lettered at once as {@code invalid_payload}. */
    public static final class InvalidPayload extends TaskFailure {
        private static final long serialVersionUID = 1L;

        public InvalidPayload(String message) {
            super(message, null);
        }

        public InvalidPayload(String message, Throwable cause) {
            super(message, cause);
        }
    }

    /** The handler refuses the task: dead-lettered at once as {@code rejected}. */
    public static final class Rejected extends TaskFailure {
        private static final long serialVersionUID = 1L;

        public Rejected(String message) {
            super(message, null);
        }
    }

    /** A passing failure (like a connection error): retried on the fast tier under the tiered policy. */
    public static final class Transient extends TaskFailure {
        private static final long serialVersionUID = 1L;

        public Transient(String message) {
            super(message, null);
        }

        public Transient(String message, Throwable cause) {
            super(message, cause);
        }
    }

    /**
     * An explicit retry the task asks for itself, after {@code countdown}; capped by
     * {@code max_retries} (past it the task is dead-lettered).
     */
    public static final class Retry extends TaskFailure {
        private static final long serialVersionUID = 1L;
        private final Duration countdown;

        public Retry(String message, Duration countdown) {
            super(message, null);
            this.countdown = countdown == null ? Duration.ZERO : countdown;
        }

        public Retry(String message, Duration countdown, Throwable cause) {
            super(message, cause);
            this.countdown = countdown == null ? Duration.ZERO : countdown;
        }

        public Duration countdown() {
            return countdown;
        }
    }
}
