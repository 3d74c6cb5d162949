package envelope

import (
	"context"
	"slices"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
)

// W3C Trace Context headers of an Envelope (docs/protocol.md section 18).
const (
	HeaderTraceparent = "traceparent"
	HeaderTracestate  = "tracestate"
)

// TracerName is the instrumentation name of this SDK's spans.
const TracerName = "github.com/kombu-envelope/kombu-envelope/sdk/go"

// runningTraceKey keys the trace context of the task a handler runs.
type runningTraceKey struct{}

// runningTrace is that trace context as the task's headers carry it.
type runningTrace struct{ parent, state string }

// tracerOf is the SDK's tracer of tp, or of the global provider when tp is nil.
func tracerOf(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(TracerName)
}

// propagator is the global propagator when it carries traceparent, else W3C
// Trace Context (the global default writes nothing).
func propagator() propagation.TextMapPropagator {
	if p := otel.GetTextMapPropagator(); slices.Contains(p.Fields(), HeaderTraceparent) {
		return p
	}
	return propagation.TraceContext{}
}

// messagingAttributes are the attributes both spans of a task have.
func messagingAttributes(operation, queue string, e *Envelope) []attribute.KeyValue {
	return []attribute.KeyValue{
		attribute.String("messaging.system", "kombu_envelope"),
		attribute.String("messaging.operation.type", operation),
		attribute.String("messaging.destination.name", queue),
		attribute.String("messaging.message.id", e.TaskID),
		attribute.String("kombu_envelope.task_type", e.TaskType),
	}
}

// endSpan ends span, with status ERROR and err recorded when err is set.
func endSpan(span trace.Span, err error) {
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// startSend starts the PRODUCER span "send <queue>" of one publish of e and
// writes the trace context into e's headers, unless the caller set
// traceparent: the new span's, or without OpenTelemetry (no span of its own)
// the running task's headers unchanged, else the span context ctx carries.
func startSend(ctx context.Context, tp trace.TracerProvider, queue string, e *Envelope) trace.Span {
	spanCtx, span := tracerOf(tp).Start(ctx, "send "+queue, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(messagingAttributes("send", queue, e)...))
	if _, set := e.Headers[HeaderTraceparent]; set {
		return span
	}
	if e.Headers == nil {
		e.Headers = map[string]string{}
	}
	current := trace.SpanContextFromContext(ctx)
	if sc := span.SpanContext(); !sc.IsValid() || sc.Equal(current) {
		// Still the context read from the task (no process span of its own either).
		if running, ok := ctx.Value(runningTraceKey{}).(runningTrace); ok && current.IsRemote() {
			setHeaders(e, map[string]string{HeaderTraceparent: running.parent, HeaderTracestate: running.state})
			return span
		}
		spanCtx = trace.ContextWithSpanContext(ctx, current)
	}
	carrier := propagation.MapCarrier{}
	propagator().Inject(spanCtx, carrier)
	setHeaders(e, map[string]string{HeaderTraceparent: carrier[HeaderTraceparent],
		HeaderTracestate: carrier[HeaderTracestate]})
	return span
}

// setHeaders sets the non-empty values of headers that e does not set yet.
func setHeaders(e *Envelope, headers map[string]string) {
	for name, value := range headers {
		if _, set := e.Headers[name]; !set && value != "" {
			e.Headers[name] = value
		}
	}
}

// runningTaskContext makes the trace context of the task's headers current in
// ctx (an invalid traceparent is ignored), so that the tasks its handler
// publishes continue its trace.
func runningTaskContext(ctx context.Context, e *Envelope) context.Context {
	carrier := propagation.MapCarrier(e.Headers)
	ctx = propagator().Extract(ctx, carrier)
	if traceIDOfHeaders(e.Headers) == "" {
		return ctx
	}
	return context.WithValue(ctx, runningTraceKey{},
		runningTrace{parent: e.Headers[HeaderTraceparent], state: e.Headers[HeaderTracestate]})
}

// startProcess starts the CONSUMER span "process <queue>" of one attempt of
// task, child of the trace context ctx carries.
func startProcess(ctx context.Context, tp trace.TracerProvider, task *Task) (context.Context, trace.Span) {
	attrs := append(messagingAttributes("process", task.Queue, task.Envelope),
		attribute.Int64("kombu_envelope.retry_count", task.RetryCount))
	return tracerOf(tp).Start(ctx, "process "+task.Queue, trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(attrs...))
}

// traceIDOfHeaders is the trace id of a valid headers.traceparent, "" when none.
func traceIDOfHeaders(headers map[string]string) string {
	return traceIDOfSpan(propagation.TraceContext{}.Extract(context.Background(), propagation.MapCarrier(headers)))
}

// traceIDOfSpan is the trace id of the span context ctx carries, "" when none.
func traceIDOfSpan(ctx context.Context) string {
	if sc := trace.SpanContextFromContext(ctx); sc.IsValid() {
		return sc.TraceID().String()
	}
	return ""
}
