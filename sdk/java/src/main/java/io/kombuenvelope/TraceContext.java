package io.kombuenvelope;

/**
 * The trace id of the request this thread serves. The worker sets it (and the SLF4J MDC's
 * {@code trace_id}) while a task runs; set it yourself around the handling of an incoming
 * request ({@code try (var scope = TraceContext.with(id)) { ... }}) so the tasks it publishes
 * carry it. {@link Envelope#builder(String)} takes it, else the MDC's {@code trace_id}, else a new one.
 */
public final class TraceContext {
    private static final ThreadLocal<String> CURRENT = new ThreadLocal<>();

    private TraceContext() {}

    /** The current trace id, or null. */
    public static String current() {
        String t = CURRENT.get();
        return t != null ? t : org.slf4j.MDC.get("trace_id");
    }

    /** Sets the trace id (and the MDC's {@code trace_id}) until the scope is closed. */
    public static Scope with(String traceId) {
        String previous = CURRENT.get();
        String previousMdc = org.slf4j.MDC.get("trace_id");
        CURRENT.set(traceId);
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

    /** Restores the previous trace id when closed. */
    @FunctionalInterface
    public interface Scope extends AutoCloseable {
        @Override
        void close();
    }
}
