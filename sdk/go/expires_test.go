package envelope

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func TestExpiresIsKeptAsWrittenAndComparedAsAnInstant(t *testing.T) {
	in := `{"task_id":"t1","task_type":"jobs.run","trace_id":"tr","created_at":"2025-09-11T04:40:00Z",` +
		`"expires":"2025-09-11T12:45:00.5+08:00"}`
	e, err := Parse([]byte(in), DefaultLimits)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(e.JSON()), `"payload":{},"expires":"2025-09-11T12:45:00.500000+08:00","max_retries":3`) {
		t.Fatalf("written %s", e.JSON())
	}
	at := time.Date(2025, 9, 11, 4, 45, 0, 500_000_000, time.UTC) // the same instant
	if !e.IsExpired(at) || e.IsExpired(at.Add(-time.Microsecond)) {
		t.Fatal("expires is at or before now: expired")
	}
	if c := e.Clone(); c.Expires == e.Expires || c.Expires.String() != e.Expires.String() {
		t.Fatal("Clone shares or loses expires")
	}
	never := New("jobs.run", nil)
	if never.IsExpired(time.Now().Add(1000*time.Hour)) || strings.Contains(string(never.JSON()), "expires") {
		t.Fatal("an Envelope without expires expires, or writes it")
	}
}

func TestPublishOptionsSetExpires(t *testing.T) {
	at := time.Date(2030, 1, 2, 3, 4, 5, 0, time.FixedZone("", 8*3600))
	e, err := NewTask(context.Background(), "jobs.run", nil, WithExpires(at))
	if err != nil {
		t.Fatal(err)
	}
	if e.Expires.String() != "2030-01-02T03:04:05+08:00" {
		t.Fatalf("WithExpires wrote %s", e.Expires)
	}
	before := time.Now()
	e, err = NewTask(context.Background(), "jobs.run", nil, WithExpiresIn(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if d := e.Expires.Sub(before); d < time.Minute-time.Millisecond || d > time.Minute+5*time.Second {
		t.Fatalf("WithExpiresIn(1m) wrote %s, %s after now", e.Expires, d)
	}
	if err := e.Validate(DefaultLimits); err != nil {
		t.Fatal(err)
	}
}

func TestExpiredTasksAreAcknowledgedWithoutRunning(t *testing.T) {
	e := newEnv(t)
	var ran atomic.Value
	w := e.worker(nil)
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error { ran.Store(task.TaskID); return nil })
	p := NewProducer(e.client, e.prefix, e.scripts)
	ctx := context.Background()
	expired, err := p.PublishTask(ctx, e.queue, "jobs.run", nil, WithExpires(time.Now().Add(-time.Second)),
		WithTieredRetries())
	if err != nil {
		t.Fatal(err)
	}
	// Expired before its type is checked: not dead-lettered as unknown either.
	if _, err := p.PublishTask(ctx, e.queue, "nobody.handles", nil, WithExpiresIn(-time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	e.start(w)
	e.waitFor("the expired tasks to be acknowledged", e.drained)
	if ran.Load() != nil || len(e.dead()) != 0 {
		t.Fatalf("ran %v; dead-letter entries %v", ran.Load(), e.dead())
	}
	if n := strings.Count(e.logs.String(), `"outcome":"expired"`); n != 2 ||
		!strings.Contains(e.logs.String(), `"task_id":"`+expired.TaskID+`"`) {
		t.Fatalf("%d expired outcomes logged, want 2:\n%s", n, e.logs.String())
	}
	live, err := p.PublishTask(ctx, e.queue, "jobs.run", nil, WithExpiresIn(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	e.waitFor("a task that has not expired to run", func() bool { return ran.Load() == live.TaskID })
}
