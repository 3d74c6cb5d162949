package io.kombuenvelope;

import io.opentelemetry.api.GlobalOpenTelemetry;
import io.opentelemetry.api.OpenTelemetry;
import io.opentelemetry.api.common.AttributeKey;
import io.opentelemetry.api.trace.Span;
import io.opentelemetry.api.trace.SpanContext;
import io.opentelemetry.api.trace.SpanKind;
import io.opentelemetry.api.trace.StatusCode;
import io.opentelemetry.api.trace.Tracer;
import io.opentelemetry.api.trace.propagation.W3CTraceContextPropagator;
import io.opentelemetry.context.Context;
import io.opentelemetry.context.propagation.TextMapGetter;

import java.util.Map;
import java.util.regex.Pattern;

/**
 * W3C Trace Context in the Envelope's headers and the OpenTelemetry spans around publishes and
 * attempts (docs/protocol.md section 18). Uses the OpenTelemetry API only: with no SDK installed
 * its tracer is the no-op one, whose spans carry their parent's context, so a task published from
 * a running task passes that task's {@code traceparent} on. The {@link OpenTelemetry} is the one
 * given to the builder, else {@link GlobalOpenTelemetry} (looked up at each span, so one set
 * after the worker started is used).
 */
final class Tracing {
    static final String TRACEPARENT = "traceparent";
    static final String TRACESTATE = "tracestate";
    private static final String SCOPE = "io.kombuenvelope";
    private static final Pattern VALID = Pattern.compile("[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?");
    private static final AttributeKey<String> SYSTEM = AttributeKey.stringKey("messaging.system");
    private static final AttributeKey<String> OPERATION = AttributeKey.stringKey("messaging.operation.type");
    private static final AttributeKey<String> DESTINATION = AttributeKey.stringKey("messaging.destination.name");
    private static final AttributeKey<String> MESSAGE_ID = AttributeKey.stringKey("messaging.message.id");
    private static final AttributeKey<String> TASK_TYPE = AttributeKey.stringKey("kombu_envelope.task_type");
    private static final AttributeKey<Long> RETRY_COUNT = AttributeKey.longKey("kombu_envelope.retry_count");
    private static final TextMapGetter<Map<String, String>> HEADERS = new TextMapGetter<>() {
        @Override
        public Iterable<String> keys(Map<String, String> carrier) {
            return carrier.keySet();
        }

        @Override
        public String get(Map<String, String> carrier, String key) {
            return carrier == null ? null : carrier.get(key);
        }
    };

    private final OpenTelemetry openTelemetry;

    /** Spans of {@code openTelemetry}, or of {@link GlobalOpenTelemetry} when null. */
    Tracing(OpenTelemetry openTelemetry) {
        this.openTelemetry = openTelemetry;
    }

    private Tracer tracer() {
        return (openTelemetry != null ? openTelemetry : GlobalOpenTelemetry.getOrNoop()).getTracer(SCOPE);
    }

    /**
     * The trace id of a {@code traceparent} (32 lowercase hex digits), or null when it is not a
     * valid one (absent, malformed, version {@code ff}, an all-zero id).
     */
    static String traceIdOf(String traceparent) {
        SpanContext c = parse(traceparent, null);
        return c.isValid() ? c.getTraceId() : null;
    }

    /** The trace id of the current OpenTelemetry span, or null when none is current. */
    static String currentTraceId() {
        SpanContext c = Span.current().getSpanContext();
        return c.isValid() ? c.getTraceId() : null;
    }

    private static SpanContext parse(String traceparent, String tracestate) {
        if (traceparent == null || !VALID.matcher(traceparent).matches() || traceparent.startsWith("ff")) {
            return SpanContext.getInvalid();
        }
        Map<String, String> carrier = tracestate == null ? Map.of(TRACEPARENT, traceparent)
                : Map.of(TRACEPARENT, traceparent, TRACESTATE, tracestate);
        return Span.fromContext(W3CTraceContextPropagator.getInstance().extract(Context.root(), carrier, HEADERS))
                .getSpanContext();
    }

    /** Starts the {@code PRODUCER} span {@code send <queue>} of one publish of {@code env}, child of the current context. */
    Send send(String queue, Envelope env) {
        Span span = tracer().spanBuilder("send " + queue).setSpanKind(SpanKind.PRODUCER)
                .setAttribute(SYSTEM, "kombu_envelope").setAttribute(OPERATION, "send")
                .setAttribute(DESTINATION, queue).setAttribute(MESSAGE_ID, env.taskId())
                .setAttribute(TASK_TYPE, env.taskType()).startSpan();
        return new Send(span);
    }

    /**
     * Starts the {@code CONSUMER} span {@code process <queue>} of one attempt of {@code env}, child
     * of its {@code headers.traceparent} (an invalid one is ignored).
     */
    Attempt process(String queue, Envelope env) {
        SpanContext incoming = parse(env.headers().get(TRACEPARENT), env.headers().get(TRACESTATE));
        Context parent = incoming.isValid() ? Context.root().with(Span.wrap(incoming)) : Context.root();
        Span span = tracer().spanBuilder("process " + queue).setSpanKind(SpanKind.CONSUMER).setParent(parent)
                .setAttribute(SYSTEM, "kombu_envelope").setAttribute(OPERATION, "process")
                .setAttribute(DESTINATION, queue).setAttribute(MESSAGE_ID, env.taskId())
                .setAttribute(TASK_TYPE, env.taskType()).setAttribute(RETRY_COUNT, env.retryCount()).startSpan();
        return new Attempt(span, parent.with(span));
    }

    /** Marks {@code span} failed with {@code error}. */
    private static void failed(Span span, Throwable error) {
        span.recordException(error);
        span.setStatus(StatusCode.ERROR, String.valueOf(error.getMessage()));
    }

    /** The span of one publish. */
    static final class Send {
        private final Span span;

        private Send(Span span) {
            this.span = span;
        }

        /**
         * {@code env} with the trace context it is published in: unchanged when the caller set
         * {@code headers.traceparent}; else the running task's {@code traceparent} and
         * {@code tracestate} as they came, when no span of its own was made (no OpenTelemetry
         * SDK); else this span's context.
         */
        Envelope stamp(Envelope env, Limits limits) {
            if (env.headers().containsKey(TRACEPARENT)) {
                return env;
            }
            SpanContext mine = span.getSpanContext();
            String runningParent = TraceContext.traceparent();
            SpanContext running = parse(runningParent, null);
            Envelope.Builder b = env.toBuilder().limits(limits);
            if (running.isValid() && (!mine.isValid() || (running.getTraceId().equals(mine.getTraceId())
                    && running.getSpanId().equals(mine.getSpanId())))) {
                b.header(TRACEPARENT, runningParent).header(TRACESTATE, TraceContext.tracestate());
            } else if (mine.isValid()) {
                W3CTraceContextPropagator.getInstance().inject(Context.root().with(span), b, Envelope.Builder::header);
            } else {
                return env;
            }
            return b.build();
        }

        /** Marks the publish failed. */
        void fail(Throwable error) {
            failed(span, error);
        }

        void end() {
            span.end();
        }
    }

    /** The span of one attempt and the context its handler runs in. */
    static final class Attempt {
        private final Span span;
        private final Context context;

        private Attempt(Span span, Context context) {
            this.span = span;
            this.context = context;
        }

        /** The context to make current while the handler runs. */
        Context context() {
            return context;
        }

        /** Marks the attempt failed. */
        void fail(Throwable error) {
            failed(span, error);
        }

        void end() {
            span.end();
        }
    }
}
