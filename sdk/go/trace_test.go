package envelope

// Trace context (docs/protocol.md section 18) against a real Redis: with the
// OpenTelemetry SDK and an in-memory exporter, and without OpenTelemetry
// (the global provider is never set in these tests: pass-through).

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// seen collects the Envelopes the handlers of a test ran, by task type.
type seen struct {
	mu    sync.Mutex
	tasks map[string]*Envelope
}

func (s *seen) add(t *Task) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.tasks == nil {
		s.tasks = map[string]*Envelope{}
	}
	s.tasks[t.TaskType] = t.Envelope
}

func (s *seen) get(taskType string) *Envelope {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.tasks[taskType]
}

// tracedWorker runs a worker whose "jobs.parent" publishes a "jobs.child"
// from its handler and whose "jobs.fail" fails; tp is the tracer provider of
// the worker and of both producers (nil: the global one).
func tracedWorker(e *env, tp trace.TracerProvider) (*Producer, *seen) {
	p := NewProducer(e.client, e.prefix, e.scripts)
	p.TracerProvider = tp
	ran := &seen{}
	w := e.worker(func(c *Config) { c.TracerProvider = tp })
	w.Handle("jobs.parent", func(ctx context.Context, task *Task) error {
		ran.add(task)
		_, err := p.PublishTask(ctx, e.queue, "jobs.child", nil)
		return err
	})
	w.Handle("jobs.child", func(ctx context.Context, task *Task) error { ran.add(task); return nil })
	w.Handle("jobs.fail", func(ctx context.Context, task *Task) error { ran.add(task); return errors.New("boom") })
	e.start(w)
	return p, ran
}

func spanNamed(t *testing.T, spans tracetest.SpanStubs, name, taskID string) tracetest.SpanStub {
	t.Helper()
	for _, s := range spans {
		for _, a := range s.Attributes {
			if s.Name == name && a.Key == "messaging.message.id" && a.Value.AsString() == taskID {
				return s
			}
		}
	}
	t.Fatalf("no span %q of task %s among %d", name, taskID, len(spans))
	return tracetest.SpanStub{}
}

func traceparentOf(sc trace.SpanContext) string {
	return fmt.Sprintf("00-%s-%s-%s", sc.TraceID(), sc.SpanID(), sc.TraceFlags())
}

func hasAttributes(t *testing.T, s tracetest.SpanStub, want map[attribute.Key]attribute.Value) {
	t.Helper()
	got := map[attribute.Key]attribute.Value{}
	for _, a := range s.Attributes {
		got[a.Key] = a.Value
	}
	for k, v := range want {
		if got[k] != v {
			t.Fatalf("span %q: %s = %v, want %v (all: %v)", s.Name, k, got[k].Emit(), v.Emit(), s.Attributes)
		}
	}
}

func TestTraceContextWithOpenTelemetry(t *testing.T) {
	e := newEnv(t)
	exporter := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	p, ran := tracedWorker(e, tp)

	ctx, request := tp.Tracer("test").Start(context.Background(), "request")
	parent, err := p.PublishTask(ctx, e.queue, "jobs.parent", nil)
	if err != nil {
		t.Fatal(err)
	}
	failing, err := p.PublishTask(ctx, e.queue, "jobs.fail", nil)
	if err != nil {
		t.Fatal(err)
	}
	request.End()
	e.waitFor("the child to run", func() bool { return ran.get("jobs.child") != nil })
	e.waitFor("the failure to be dead-lettered", func() bool { return len(e.dead()) == 1 })
	traceID := request.SpanContext().TraceID()
	if parent.TraceID != traceID.String() {
		t.Fatalf("trace_id %s, want the traceparent's %s", parent.TraceID, traceID)
	}

	spans := exporter.GetSpans()
	send := spanNamed(t, spans, "send "+e.queue, parent.TaskID)
	if send.SpanKind != trace.SpanKindProducer || send.Parent.SpanID() != request.SpanContext().SpanID() {
		t.Fatalf("send span %+v", send)
	}
	if got := ran.get("jobs.parent").Headers[HeaderTraceparent]; got != traceparentOf(send.SpanContext) {
		t.Fatalf("traceparent %q, want the send span's %q", got, traceparentOf(send.SpanContext))
	}
	hasAttributes(t, send, map[attribute.Key]attribute.Value{
		"messaging.system": attribute.StringValue("kombu_envelope"), "messaging.operation.type": attribute.StringValue("send"),
		"messaging.destination.name": attribute.StringValue(e.queue), "kombu_envelope.task_type": attribute.StringValue("jobs.parent"),
	})
	process := spanNamed(t, spans, "process "+e.queue, parent.TaskID)
	if process.SpanKind != trace.SpanKindConsumer || process.Parent.SpanID() != send.SpanContext.SpanID() ||
		process.SpanContext.TraceID() != traceID || process.Status.Code == codes.Error {
		t.Fatalf("process span %+v", process)
	}
	hasAttributes(t, process, map[attribute.Key]attribute.Value{
		"messaging.system": attribute.StringValue("kombu_envelope"), "messaging.operation.type": attribute.StringValue("process"),
		"messaging.destination.name": attribute.StringValue(e.queue), "kombu_envelope.task_type": attribute.StringValue("jobs.parent"),
		"kombu_envelope.retry_count": attribute.Int64Value(0),
	})

	// The task published from the handler continues the trace: its send span is a child of the process span.
	child := ran.get("jobs.child")
	childSend := spanNamed(t, spans, "send "+e.queue, child.TaskID)
	if childSend.Parent.SpanID() != process.SpanContext.SpanID() || child.TraceID != traceID.String() ||
		child.Headers[HeaderTraceparent] != traceparentOf(childSend.SpanContext) {
		t.Fatalf("child %s with traceparent %q; its send span %+v", child.JSON(), child.Headers[HeaderTraceparent], childSend)
	}
	if childProcess := spanNamed(t, spans, "process "+e.queue, child.TaskID); childProcess.Parent.SpanID() != childSend.SpanContext.SpanID() {
		t.Fatalf("child process span %+v", childProcess)
	}

	failed := spanNamed(t, spans, "process "+e.queue, failing.TaskID)
	if failed.Status.Code != codes.Error || len(failed.Events) != 1 || failed.Events[0].Name != "exception" {
		t.Fatalf("failed process span: status %+v, events %+v", failed.Status, failed.Events)
	}
}

func TestTraceContextPassesThroughWithoutOpenTelemetry(t *testing.T) {
	e := newEnv(t)
	p, ran := tracedWorker(e, nil)
	ctx := context.Background()

	// A traceparent set by the caller (another language's producer) is kept, gives
	// the task its trace id as trace_id, and a task published from its handler
	// copies it and its tracestate unchanged.
	const traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	const tracestate = "vendor=opaque, other=1" // kept as it is, blank included
	parent, err := p.PublishTask(ctx, e.queue, "jobs.parent", nil, WithHeader(HeaderTraceparent, traceparent),
		WithHeader(HeaderTracestate, tracestate))
	if err != nil {
		t.Fatal(err)
	}
	if parent.TraceID != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Fatalf("published with a traceparent: %s", parent.JSON())
	}
	e.waitFor("the child to run", func() bool { return ran.get("jobs.child") != nil })
	child := ran.get("jobs.child")
	if child.Headers[HeaderTraceparent] != traceparent || child.Headers[HeaderTracestate] != tracestate ||
		child.TraceID != parent.TraceID {
		t.Fatalf("child %s", child.JSON())
	}
	own, err := NewTask(ctx, "jobs.child", nil, WithHeader(HeaderTraceparent, traceparent), WithTraceID("own"))
	if err != nil || own.TraceID != "own" {
		t.Fatalf("a trace_id of its own: %v %v", own, err)
	}

	// Published in a span context (remote, no SDK): its traceparent, and trace_id its trace id.
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5},
		TraceFlags: trace.FlagsSampled, Remote: true})
	task, err := p.PublishTask(trace.ContextWithRemoteSpanContext(ctx, sc), e.queue, "jobs.fail", nil)
	if err != nil {
		t.Fatal(err)
	}
	if task.Headers[HeaderTraceparent] != traceparentOf(sc) || task.TraceID != sc.TraceID().String() {
		t.Fatalf("published in a span context: %s", task.JSON())
	}

	// Outside any trace: no traceparent.
	plain, err := p.PublishTask(ctx, e.queue, "jobs.child", nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, set := plain.Headers[HeaderTraceparent]; set {
		t.Fatalf("published outside a trace: %s", plain.JSON())
	}
}

// An invalid traceparent is ignored: the task runs, and what its handler
// publishes starts no trace from it.
func TestAnInvalidTraceparentIsIgnored(t *testing.T) {
	e := newEnv(t)
	p, ran := tracedWorker(e, nil)
	if _, err := p.PublishTask(context.Background(), e.queue, "jobs.parent", nil,
		WithHeader(HeaderTraceparent, "00-00000000000000000000000000000000-00f067aa0ba902b7-01")); err != nil {
		t.Fatal(err)
	}
	e.waitFor("the child to run", func() bool { return ran.get("jobs.child") != nil })
	if _, set := ran.get("jobs.child").Headers[HeaderTraceparent]; set {
		t.Fatalf("child of an invalid traceparent: %s", ran.get("jobs.child").JSON())
	}
}

// A handler's span of an SDK the producer does not use is still what a task
// it publishes continues, not the running task's traceparent.
func TestAProducerWithoutSpansContinuesTheCurrentSpan(t *testing.T) {
	tp := sdktrace.NewTracerProvider()
	defer func() { _ = tp.Shutdown(context.Background()) }()
	running := New("jobs.parent", nil)
	running.Headers[HeaderTraceparent] = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ctx, span := tp.Tracer("test").Start(runningTaskContext(context.Background(), running), "process")
	defer span.End()
	e := New("jobs.child", nil)
	startSend(ctx, nil, "jobs", e).End()
	if got := e.Headers[HeaderTraceparent]; got != traceparentOf(span.SpanContext()) {
		t.Fatalf("traceparent %q, want the current span's %q", got, traceparentOf(span.SpanContext()))
	}
}
