package envelope

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

func TestPublishTaskOptionsAndTheTraceIDOfTheContext(t *testing.T) {
	ctx := ContextWithTraceID(context.Background(), "4bf92f3577b34da6a3ce929d0e0e4736")
	at := time.Date(2030, 9, 11, 12, 45, 0, 0, time.FixedZone("", 8*3600))
	e, err := NewTask(ctx, "order.close", map[string]any{"order_id": "1"}, WithScheduleTime(at),
		WithIdempotencyKey("order:1"), WithOrderingKey("order:1"), WithPriority(9), WithMaxRetries(-1), WithTieredRetries(),
		WithTimeout(1500*time.Millisecond), WithPayloadVersion(2))
	if err != nil {
		t.Fatal(err)
	}
	if e.TraceID != "4bf92f3577b34da6a3ce929d0e0e4736" || e.ScheduleTime.String() != "2030-09-11T12:45:00+08:00" ||
		*e.IdempotencyKey != "order:1" || *e.OrderingKey != "order:1" || e.Priority != 9 || e.MaxRetries != nil ||
		!AsksForTiered(e) || *e.TimeoutMS != 1500 || e.PayloadVersion != 2 || string(e.Payload) != `{"order_id":"1"}` {
		t.Fatalf("envelope: %s", e.JSON())
	}
	if err := e.Validate(DefaultLimits); err != nil {
		t.Fatal(err)
	}
	own, _ := NewTask(context.Background(), "x", nil, WithTraceID("abc"))
	if own.TraceID != "abc" || string(own.Payload) != "{}" {
		t.Fatalf("envelope: %s", own.JSON())
	}
}

func TestPublishBatchAndTraceIDsFollowTasksPublishedByHandlers(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	var mu sync.Mutex
	traces := map[string]string{}
	w := e.worker(nil)
	p := NewProducer(e.client, e.prefix, e.scripts)
	w.Handle("jobs.parent", func(ctx context.Context, task *Task) error {
		_, err := p.PublishTask(ctx, e.queue, "jobs.child", map[string]string{"parent": task.TaskID})
		return err
	})
	w.Handle("jobs.child", func(ctx context.Context, task *Task) error {
		var payload struct{ Parent string }
		_ = task.DecodePayload(&payload)
		mu.Lock()
		defer mu.Unlock()
		traces[payload.Parent] = task.TraceID
		return nil
	})
	a, b := New("jobs.parent", nil), New("jobs.parent", nil)
	broken := New("jobs.parent", nil)
	broken.TaskType = "" // invalid
	ids, err := p.PublishBatch(ctx, e.queue, []*Envelope{a, broken, b})
	var batch *BatchError
	if !errors.As(err, &batch) || len(batch.Failed) != 1 || batch.Failed[1] == nil {
		t.Fatalf("PublishBatch: %v", err)
	}
	if ids[0] == "" || ids[1] != "" || ids[2] == "" {
		t.Fatalf("ids: %q", ids)
	}
	e.start(w)
	e.waitFor("both children to run", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(traces) == 2
	})
	if traces[a.TaskID] != a.TraceID || traces[b.TaskID] != b.TraceID {
		t.Fatalf("child trace ids %v, want the parents' %s %s", traces, a.TraceID, b.TraceID)
	}
}
