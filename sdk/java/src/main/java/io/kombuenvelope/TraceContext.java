package io.kombuenvelope;

/**
 * The trace of the request this thread serves: its trace id and, when it came with one, its W3C
 * {@code traceparent} and {@code tracestate}. The worker sets them (and the SLF4J MDC's
 * {@code trace_id}) while a task runs; set them yourself around the handling of an incoming
 * request ({@code try (var scope = TraceContext.with(id)) { ... }}) so the tasks it publishes
 * carry them. {@link Envelope#builder(String)} takes the trace id, else the MDC's
 * {@code trace_id}, else the current OpenTelemetry span's, else a new one; a {@link Producer}
 * passes the {@code traceparent} on when no OpenTelemetry span of its own is made
 * (docs/protocol.md section 18).
 */
public final class TraceContext {
    private record Current(String traceId, String traceparent, String tracestate) {}

    private static final ThreadLocal<Current> CURRENT = new ThreadLocal<>();

    private TraceContext() {}

    /** The current trace id, or null. */
    public static String current() {
        Current c = CURRENT.get();
        return c != null ? c.traceId() : org.slf4j.MDC.get("trace_id");
    }

    /** The current {@code traceparent}, or null. */
    public static String traceparent() {
        Current c = CURRENT.get();
        return c != null ? c.traceparent() : null;
    }

    /** The current {@code tracestate}, or null. */
    public static String tracestate() {
        Current c = CURRENT.get();
        return c != null ? c.tracestate() : null;
    }

    /** Sets the trace id (and the MDC's {@code trace_id}) until the scope is closed. */
    public static Scope with(String traceId) {
        return with(traceId, null, null);
    }

    /**
     * Sets the trace id (and the MDC's {@code trace_id}) with the W3C {@code traceparent} and
     * {@code tracestate} it came with (either may be null) until the scope is closed.
     */
    public static Scope with(String traceId, String traceparent, String tracestate) {
        Current previous = CURRENT.get();
        String previousMdc = org.slf4j.MDC.get("trace_id");
        CURRENT.set(new Current(traceId, traceparent, tracestate));
        org.slf4j.MDC.put("trace_id", traceId);
        return () -> {
            if (previous == null) {
                CURRENT.remove();
            } else {
                CURRENT.set(previous);
            }
            if (previousMdc == null) {
                org.slf4j.MDC.remove("trace_id");
            } else {
                org.slf4j.MDC.put("trace_id", previousMdc);
            }
        };
    }

    /** Restores the previous trace when closed. */
    @FunctionalInterface
    public interface Scope extends AutoCloseable {
        @Override
        void close();
    }
}
