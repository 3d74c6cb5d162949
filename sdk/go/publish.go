package envelope

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

type traceKey struct{}

// ContextWithTraceID returns ctx carrying traceID, the trace id of the request
// being served. PublishTask stamps it on the tasks it publishes, and a
// handler's ctx carries the trace id of its task, so tasks published from a
// handler continue its trace.
func ContextWithTraceID(ctx context.Context, traceID string) context.Context {
	return context.WithValue(ctx, traceKey{}, traceID)
}

// TraceIDFromContext is the trace id ctx carries, "" when none.
func TraceIDFromContext(ctx context.Context) string {
	id, _ := ctx.Value(traceKey{}).(string)
	return id
}

// PublishOption sets a field of an Envelope that PublishTask builds.
type PublishOption func(e *Envelope) error

// WithScheduleTime runs the task at t (schedule_time, its offset kept).
func WithScheduleTime(t time.Time) PublishOption {
	return func(e *Envelope) error {
		ts := NewTimestamp(t)
		e.ScheduleTime = &ts
		return nil
	}
}

// WithDelay runs the task d from now.
func WithDelay(d time.Duration) PublishOption { return WithScheduleTime(time.Now().Add(d)) }

// WithExpires sets expires: a worker that receives the task at t or later
// acknowledges it without running it. t's offset is kept.
func WithExpires(t time.Time) PublishOption {
	return func(e *Envelope) error {
		ts := NewTimestamp(t)
		e.Expires = &ts
		return nil
	}
}

// WithExpiresIn sets expires d from now.
func WithExpiresIn(d time.Duration) PublishOption { return WithExpires(time.Now().Add(d)) }

// WithIdempotencyKey sets idempotency_key: tasks of one task_type with one key have one effect.
func WithIdempotencyKey(key string) PublishOption {
	return func(e *Envelope) error { e.IdempotencyKey = &key; return nil }
}

// WithOrderingKey sets ordering_key: tasks of one key on a queue run one at a
// time, in the order they joined it (docs/protocol.md section 20).
func WithOrderingKey(key string) PublishOption {
	return func(e *Envelope) error { e.OrderingKey = &key; return nil }
}

// WithPriority sets priority (0-255; see BucketFor for the streams).
func WithPriority(priority int) PublishOption {
	return func(e *Envelope) error { e.Priority = priority; return nil }
}

// WithTraceID sets trace_id (default: the trace id of ctx, see NewTask, else a new one).
func WithTraceID(traceID string) PublishOption {
	return func(e *Envelope) error { e.TraceID = traceID; return nil }
}

// WithTaskID sets task_id (default: a new UUID).
func WithTaskID(taskID string) PublishOption {
	return func(e *Envelope) error { e.TaskID = taskID; return nil }
}

// WithPayloadVersion sets payload_version (default 1).
func WithPayloadVersion(v int64) PublishOption {
	return func(e *Envelope) error { e.PayloadVersion = v; return nil }
}

// WithTimeout sets timeout_ms, the longest one attempt may run.
func WithTimeout(d time.Duration) PublishOption {
	return func(e *Envelope) error {
		ms := d.Milliseconds()
		e.TimeoutMS = &ms
		return nil
	}
}

// WithMaxRetries sets max_retries; a negative n means null (unlimited).
func WithMaxRetries(n int64) PublishOption {
	return func(e *Envelope) error {
		if n < 0 {
			e.MaxRetries = nil
		} else {
			e.MaxRetries = &n
		}
		return nil
	}
}

// WithTieredRetries asks for automatic retries (header x-retry-policy: tiered);
// without it every failure is final.
func WithTieredRetries() PublishOption { return WithHeader(HeaderRetryPolicy, PolicyTiered) }

// WithHeader sets one header.
func WithHeader(name, value string) PublishOption {
	return func(e *Envelope) error {
		if e.Headers == nil {
			e.Headers = map[string]string{}
		}
		e.Headers[name] = value
		return nil
	}
}

// NewTask builds an Envelope for taskType with payload (a JSON object: a
// []byte or json.RawMessage as it is, anything else through json.Marshal),
// then opts. Unless WithTraceID sets it, its trace_id is the one ctx carries
// (TraceIDFromContext), else the trace id of a traceparent header set by opts,
// else that of ctx's OpenTelemetry span context, else a new one
// (docs/protocol.md section 18).
func NewTask(ctx context.Context, taskType string, payload any, opts ...PublishOption) (*Envelope, error) {
	var body []byte
	switch p := payload.(type) {
	case nil:
	case []byte:
		body = p
	case json.RawMessage:
		body = p
	default:
		var err error
		if body, err = json.Marshal(p); err != nil {
			return nil, fmt.Errorf("encoding the payload: %w", err)
		}
	}
	e := New(taskType, body)
	fresh := e.TraceID
	for _, opt := range opts {
		if err := opt(e); err != nil {
			return nil, err
		}
	}
	if e.TraceID == fresh {
		if id := cmp.Or(TraceIDFromContext(ctx), traceIDOfHeaders(e.Headers), traceIDOfSpan(ctx)); id != "" {
			e.TraceID = id
		}
	}
	return e, nil
}

// PublishTask builds a task (NewTask) and publishes it on queue; it returns
// the Envelope as published, so its TaskID can be kept.
func (p *Producer) PublishTask(ctx context.Context, queue, taskType string, payload any,
	opts ...PublishOption) (*Envelope, error) {
	e, err := NewTask(ctx, taskType, payload, opts...)
	if err != nil {
		return nil, err
	}
	if _, err := p.Publish(ctx, queue, e); err != nil {
		return nil, err
	}
	return e, nil
}

// BatchError reports the tasks of a PublishBatch that were not published.
type BatchError struct {
	Failed map[int]error // index in the batch -> why
}

func (e *BatchError) Error() string {
	return fmt.Sprintf("%d of the batch's tasks were not published (first: %v)", len(e.Failed), e.first())
}

func (e *BatchError) first() error {
	lowest := -1
	for i := range e.Failed {
		if lowest < 0 || i < lowest {
			lowest = i
		}
	}
	return e.Failed[lowest]
}

// Unwrap gives errors.Is / errors.As the failures.
func (e *BatchError) Unwrap() []error {
	out := make([]error, 0, len(e.Failed))
	for _, err := range e.Failed {
		out = append(out, err)
	}
	return out
}

// PublishBatch publishes every Envelope on queue, each as Publish does (each
// one is checked, atomic and deduplicated on its own; the batch is not a
// transaction; with RequireServed the announcements are read once).
// It returns the stream entry ids in order ("" for a delayed task or one that
// failed, Waiting for a keyed task waiting for its turn) and, when some failed, a *BatchError naming them; the others are
// published either way.
func (p *Producer) PublishBatch(ctx context.Context, queue string, envelopes []*Envelope) ([]string, error) {
	ids := make([]string, len(envelopes))
	failed := map[int]error{}
	var announced []Announcement
	if p.RequireServed && len(envelopes) > 0 {
		var err error
		if announced, err = p.announcedForCheck(ctx); err != nil {
			return ids, err
		}
	}
	for i, e := range envelopes {
		if err := ctx.Err(); err != nil {
			failed[i] = err
			continue
		}
		if e == nil {
			failed[i] = errors.New("nil Envelope")
			continue
		}
		id, err := p.publish(ctx, queue, e, announced)
		if err != nil {
			failed[i] = err
			continue
		}
		ids[i] = id
	}
	if len(failed) > 0 {
		return ids, &BatchError{Failed: failed}
	}
	return ids, nil
}
