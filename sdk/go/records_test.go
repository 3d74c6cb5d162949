package envelope

// Task records (docs/protocol.md section 14) against a real Redis: the state
// each step writes, what GetTask reports, and expiry.

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// record is the task record of taskID in the test's queue.
func (e *env) record(taskID string) map[string]string {
	e.t.Helper()
	fields, err := e.client.HGetAll(context.Background(), e.q.Task(taskID)).Result()
	if err != nil {
		e.t.Fatal(err)
	}
	return fields
}

// waitState waits until the record of taskID has state.
func (e *env) waitState(taskID, state string) map[string]string {
	e.t.Helper()
	var fields map[string]string
	e.waitFor("record state "+state, func() bool { fields = e.record(taskID); return fields["state"] == state })
	return fields
}

// ttl is the expiry left on the record of taskID.
func (e *env) ttl(taskID string) time.Duration {
	return e.client.PTTL(context.Background(), e.q.Task(taskID)).Val()
}

func (e *env) state(p *Producer, taskID string) string {
	e.t.Helper()
	info, err := p.GetTask(context.Background(), e.queue, taskID)
	if err != nil {
		e.t.Fatal(err)
	}
	return info.State
}

func TestPublishScheduleAndCancelWriteRecords(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := NewProducer(e.client, e.prefix, e.scripts)
	now := New("jobs.run", nil)
	later := New("jobs.run", nil)
	later.RetryCount = 1
	later.MaxRetries = nil
	if err := WithDelay(time.Hour)(later); err != nil {
		t.Fatal(err)
	}
	if _, err := p.PublishBatch(ctx, e.queue, []*Envelope{now, later}); err != nil {
		t.Fatal(err)
	}
	r := e.record(now.TaskID)
	if r["state"] != StateQueued || r["task_type"] != "jobs.run" || r["payload_version"] != "1" ||
		r["queue"] != e.queue || r["retry_count"] != "0" || r["published_at"] == "" || r["updated_at"] == "" {
		t.Fatalf("record of a publish now %v", r)
	}
	if _, err := ParseTimestamp(r["published_at"]); err != nil || !strings.HasSuffix(r["published_at"], "Z") {
		t.Fatalf("published_at %q: %v", r["published_at"], err)
	}
	if ttl := e.ttl(now.TaskID); ttl < 7*24*time.Hour-time.Minute {
		t.Fatalf("a queued record expires in %v, want 7 days", ttl)
	}
	r = e.record(later.TaskID)
	if r["state"] != StateScheduled || r["retry_count"] != "1" || r["due_at"] == "" {
		t.Fatalf("record of a publish for later %v", r)
	}
	if ttl := e.ttl(later.TaskID); ttl < 7*24*time.Hour+time.Hour-time.Minute {
		t.Fatalf("a scheduled record expires in %v, want 7 days after its due time", ttl)
	}
	// Without the queue, the reader looks in every queue it knows.
	if info, err := p.GetTask(ctx, "", later.TaskID); err != nil || info.State != StateScheduled || info.Queue != e.queue {
		t.Fatalf("GetTask %+v: %v", info, err)
	}
	if _, err := p.Cancel(ctx, later.TaskID); err != nil {
		t.Fatal(err)
	}
	r = e.record(later.TaskID)
	if r["state"] != StateCancelled || r["reason"] != "cancelled" || r["finished_at"] == "" {
		t.Fatalf("record of a cancel %v", r)
	}
	if ttl := e.ttl(later.TaskID); ttl > DefaultTaskRecordRetention || ttl < DefaultTaskRecordRetention-time.Minute {
		t.Fatalf("a final record expires in %v, want the retention", ttl)
	}
	if got := e.state(p, NewTaskID()); got != StateUnknown {
		t.Fatalf("GetTask of an unknown task: %s", got)
	}
}

func TestRecordsExpireAfterTheRetentionAndCanBeTurnedOff(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := NewProducer(e.client, e.prefix, e.scripts)
	p.TaskRecordRetention = 300 * time.Millisecond
	task, err := p.PublishTask(ctx, e.queue, "jobs.run", nil, WithDelay(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Cancel(ctx, task.TaskID); err != nil {
		t.Fatal(err)
	}
	if got := e.state(p, task.TaskID); got != StateCancelled {
		t.Fatalf("GetTask %s", got)
	}
	e.waitFor("the record to expire", func() bool { return len(e.record(task.TaskID)) == 0 })
	if got := e.state(p, task.TaskID); got != StateUnknown {
		t.Fatalf("GetTask after expiry %s", got)
	}

	p.TaskRecordRetention = NoTaskRecords
	quiet, err := p.PublishTask(ctx, e.queue, "jobs.run", nil, WithDelay(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	if r := e.record(quiet.TaskID); len(r) != 0 {
		t.Fatalf("records are off, yet %v", r)
	}
	if got := e.state(p, quiet.TaskID); got != StateScheduled {
		t.Fatalf("GetTask of a delayed task without a record: %s", got)
	}
}

func TestWorkerStepsWriteRecords(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := NewProducer(e.client, e.prefix, e.scripts)
	release := make(chan struct{})
	var failing atomic.Bool
	failing.Store(true)
	w := e.worker(nil)
	w.Handle("jobs.block", func(ctx context.Context, task *Task) error { <-release; return nil })
	w.Handle("jobs.flaky", func(ctx context.Context, task *Task) error {
		if failing.Load() {
			return errors.New("flaky")
		}
		return nil
	})
	w.Handle("jobs.ok", func(ctx context.Context, task *Task) error { return nil })
	e.start(w)

	blocked, _ := p.PublishTask(ctx, e.queue, "jobs.block", nil)
	r := e.waitState(blocked.TaskID, StateRunning)
	if r["attempts"] != "1" || r["worker"] != w.Consumer() || r["language"] != Language ||
		r["host"] != w.host || r["pid"] != w.pid || r["started_at"] == "" {
		t.Fatalf("record of a start %v", r)
	}
	if got := e.state(p, blocked.TaskID); got != StateRunning {
		t.Fatalf("GetTask %s", got)
	}
	close(release)
	r = e.waitState(blocked.TaskID, StateSucceeded)
	if r["finished_at"] == "" || r["reason"] != "" {
		t.Fatalf("record of a success %v", r)
	}
	if ttl := e.ttl(blocked.TaskID); ttl > DefaultTaskRecordRetention {
		t.Fatalf("a succeeded record expires in %v", ttl)
	}

	// A retry (retrying, with the error), then a dead letter, a purge and a replay.
	flaky, _ := p.PublishTask(ctx, e.queue, "jobs.flaky", nil, WithTieredRetries(), WithMaxRetries(3))
	r = e.waitState(flaky.TaskID, StateRetrying) // one of the three retries' windows
	if r["retry_count"] < "1" || r["retry_count"] > "3" || r["due_at"] == "" || r["error"] != "*errors.errorString: flaky" {
		t.Fatalf("record of a retry %v", r)
	}
	r = e.waitState(flaky.TaskID, StateDead)
	if r["attempts"] != "4" || r["dead_id"] == "" || r["finished_at"] == "" ||
		!strings.HasPrefix(r["error"], "*errors.errorString: flaky") {
		t.Fatalf("record of a dead letter %v", r)
	}
	if got := e.state(p, flaky.TaskID); got != StateDead {
		t.Fatalf("GetTask %s", got)
	}
	failing.Store(false)
	if _, err := NewDeadLetters(e.client, e.prefix, e.scripts).Replay(ctx, e.queue, r["dead_id"], ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	r = e.waitState(flaky.TaskID, StateSucceeded)
	if r["attempts"] != "5" || r["retry_count"] != "0" {
		t.Fatalf("record of a replayed task %v", r)
	}
	e.client.HSet(ctx, e.q.Task(flaky.TaskID), "state", StateDead) // as if its dead-letter entry were purged
	if got := e.state(p, flaky.TaskID); got != StateFailed {
		t.Fatalf("GetTask of a purged dead letter %s", got)
	}

	// The skips: cancelled, expired, duplicate.
	cancelled := New("jobs.ok", nil)
	if _, err := p.Cancel(ctx, cancelled.TaskID); err != nil {
		t.Fatal(err)
	}
	e.publish(cancelled)
	expired, _ := p.PublishTask(ctx, e.queue, "jobs.ok", nil, WithExpires(time.Now().Add(-time.Minute)))
	duplicate := New("jobs.ok", nil)
	key := "k-" + duplicate.TaskID
	duplicate.IdempotencyKey = &key
	e.client.Set(ctx, e.keys.Idempotency("jobs.ok", key), "done other 2025-01-01T00:00:00Z", time.Minute)
	e.publish(duplicate)
	for _, c := range []struct {
		task          *Envelope
		state, reason string
	}{{cancelled, StateCancelled, "cancelled"}, {expired, StateCancelled, "expired"},
		{duplicate, StateSucceeded, "duplicate"}} {
		if r := e.waitState(c.task.TaskID, c.state); r["reason"] != c.reason || r["finished_at"] == "" {
			t.Fatalf("record of a skip (%s) %v", c.reason, r)
		}
	}

	// A deferral: the idempotency key is busy on a live holder.
	busy := New("jobs.ok", nil)
	busyKey := "k-" + busy.TaskID
	busy.IdempotencyKey = &busyKey
	e.client.Set(ctx, e.keys.Consumer("holder"), "h 1 go", time.Minute)
	e.client.Set(ctx, e.keys.Idempotency("jobs.ok", busyKey), "running holder other", time.Minute)
	e.publish(busy)
	if r := e.waitState(busy.TaskID, StateScheduled); r["due_at"] == "" || r["retry_count"] != "0" {
		t.Fatalf("record of a deferral %v", r)
	}
}

func TestTakeoverAndPutBackWriteRecords(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := NewProducer(e.client, e.prefix, e.scripts)
	w := e.worker(func(c *Config) { c.MaxRedeliveries = 2 })
	taken := New("jobs.run", nil)
	e.publish(taken)
	e.hold(w, "ghost")
	// The ghost had started it, then died: readers see it queued before any takeover.
	e.client.HSet(ctx, e.q.Task(taken.TaskID), "state", StateRunning, "worker", "ghost")
	if got := e.state(p, taken.TaskID); got != StateQueued {
		t.Fatalf("GetTask of a task whose worker died: %s", got)
	}
	time.Sleep(w.cfg.Lease + 100*time.Millisecond)
	if n, err := w.TakeOverDeadConsumers(ctx); err != nil || n != 1 {
		t.Fatalf("took over %d: %v", n, err)
	}
	if r := e.record(taken.TaskID); r["state"] != StateQueued {
		t.Fatalf("record after a takeover %v", r)
	}

	e.hold(w, "ghost") // its second death: dead-lettered
	time.Sleep(w.cfg.Lease + 100*time.Millisecond)
	if n, err := w.TakeOverDeadConsumers(ctx); err != nil || n != 1 {
		t.Fatalf("took over %d: %v", n, err)
	}
	r := e.record(taken.TaskID)
	if r["state"] != StateDead || r["dead_id"] == "" || !strings.HasPrefix(r["error"], "redelivery_limit: ") {
		t.Fatalf("record after the redelivery limit %v", r)
	}
	if ttl := e.ttl(taken.TaskID); ttl > DefaultTaskRecordRetention {
		t.Fatalf("a dead record expires in %v", ttl)
	}

	back := New("jobs.run", nil)
	e.publish(back)
	e.hold(w, w.Consumer())
	e.client.HSet(ctx, e.q.Task(back.TaskID), "state", StateRunning)
	if n := w.requeueOwnPending(ctx); n != 1 {
		t.Fatalf("put back %d", n)
	}
	if r := e.record(back.TaskID); r["state"] != StateQueued {
		t.Fatalf("record after a put back %v", r)
	}
	// An entry that cannot be decoded is moved without a record.
	id := e.client.XAdd(ctx, &redis.XAddArgs{Stream: e.q.Stream(Normal), Values: []string{"v", "9"}}).Val()
	e.hold(w, w.Consumer())
	if n := w.requeueOwnPending(ctx); n != 1 {
		t.Fatalf("put back %d (entry %s)", n, id)
	}
}
