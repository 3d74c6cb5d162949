package io.kombuenvelope;

import java.time.Duration;
import java.util.concurrent.ThreadLocalRandom;
import java.util.function.DoubleSupplier;

/**
 * The tiered automatic retries of docs/protocol.md section 8: a transient error retries at once
 * while {@code x-fast-retries} is below {@code fastRetries}, otherwise with exponential backoff
 * {@code min(backoff × 2^(next − f − 1) × j, maxBackoff)}, j in [0.8, 1.2].
 */
public record RetryPolicy(int fastRetries, Duration backoff, Duration maxBackoff, DoubleSupplier jitter) {
    public static final RetryPolicy DEFAULT = new RetryPolicy(2, Duration.ofSeconds(30), Duration.ofHours(1), null);

    public RetryPolicy {
        if (fastRetries < 0 || backoff == null || maxBackoff == null) {
            throw new IllegalArgumentException("fastRetries must be >= 0; backoff and maxBackoff are required");
        }
    }

    public RetryPolicy(int fastRetries, Duration backoff, Duration maxBackoff) {
        this(fastRetries, backoff, maxBackoff, null);
    }

    enum Kind { TASK_ERROR, TRANSIENT, TIMEOUT }

    enum Action { DEAD_LETTER, RETRY_NOW, RETRY_LATER }

    record Decision(Action action, String failureClass, long next, int fastRetries, Duration delay, String message) {}

    /** Retries of the fast tier already taken (header {@code x-fast-retries}, absent = 0). */
    static int fastRetriesTaken(Envelope e) {
        try {
            int n = Integer.parseInt(e.headers().getOrDefault("x-fast-retries", "0"));
            return Math.max(n, 0);
        } catch (NumberFormatException ex) {
            return 0;
        }
    }

    public Duration backoffDelay(long next, int fast) {
        long exp = Math.max(0, next - fast - 1);
        double j = jitter != null ? jitter.getAsDouble() : 0.8 + 0.4 * ThreadLocalRandom.current().nextDouble();
        double max = maxBackoff.toMillis();
        double delay = exp >= 62 ? max : Math.min(backoff.toMillis() * Math.pow(2, exp) * j, max);
        return Duration.ofMillis((long) delay);
    }

    Decision decide(Envelope e, Kind kind) {
        long next = e.retryCount() + 1;
        int fast = fastRetriesTaken(e);
        if (!e.asksForTieredRetries()) {
            String cls = kind == Kind.TIMEOUT ? "timeout" : "task_error";
            return new Decision(Action.DEAD_LETTER, cls, next, fast, Duration.ZERO,
                    "failed; not retried (no x-retry-policy: tiered header)");
        }
        if (e.maxRetries() != null && next > e.maxRetries()) {
            String cls = kind == Kind.TRANSIENT ? "transient_exhausted" : kind == Kind.TIMEOUT ? "timeout" : "task_error";
            return new Decision(Action.DEAD_LETTER, cls, next, fast, Duration.ZERO,
                    "gave up after " + next + " attempts (max_retries " + e.maxRetries() + ")");
        }
        if (kind == Kind.TRANSIENT && fast < fastRetries) {
            return new Decision(Action.RETRY_NOW, null, next, fast + 1, Duration.ZERO, null);
        }
        return new Decision(Action.RETRY_LATER, null, next, fast, backoffDelay(next, fast), null);
    }
}
