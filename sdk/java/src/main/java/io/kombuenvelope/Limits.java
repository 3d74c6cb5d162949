package io.kombuenvelope;

import java.time.Duration;

/** The configurable validation limits; defaults are the protocol's: 90 days, depth 5, 1 MiB. */
public record Limits(Duration maxDelay, int maxPayloadDepth, int maxPayloadBytes) {
    public static final Limits DEFAULT = new Limits(Duration.ofDays(90), 5, 1024 * 1024);

    /** Extra room in a body for the fields other than payload. */
    public static final int BODY_OVERHEAD_BYTES = 256 * 1024;

    public Limits {
        if (maxDelay == null || maxDelay.isNegative()) {
            throw new IllegalArgumentException("maxDelay must be a non-negative duration");
        }
        if (maxPayloadDepth < 1 || maxPayloadBytes < 2) {
            throw new IllegalArgumentException("maxPayloadDepth must be >= 1 and maxPayloadBytes >= 2");
        }
    }

    /** The largest body (uncompressed JSON) written or read. */
    public int maxBodyBytes() {
        return maxPayloadBytes + BODY_OVERHEAD_BYTES;
    }
}
