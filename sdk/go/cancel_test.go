package envelope

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestCancelAnswersRemovedMarkedOrAlready(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := NewProducer(e.client, e.prefix, e.scripts)
	// A task delayed in another queue: Cancel finds it knowing only its id.
	delayed := New("jobs.run", nil)
	later := NewTimestamp(time.Now().Add(time.Hour))
	delayed.ScheduleTime = &later
	if _, err := p.Publish(ctx, "reports", delayed); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Publish(ctx, e.queue, New("jobs.run", nil)); err != nil { // registers nothing: due
		t.Fatal(err)
	}
	got, err := p.Cancel(ctx, delayed.TaskID)
	if err != nil || got != (CancelResult{Status: CancelRemoved, Queue: "reports"}) {
		t.Fatalf("Cancel of a delayed task: %+v %v", got, err)
	}
	reports := e.keys.Queue("reports")
	if n, _ := e.client.ZCard(ctx, reports.Delayed()).Result(); n != 0 {
		t.Fatal("still in the delayed set")
	}
	if n, _ := e.client.HLen(ctx, reports.DelayedData()).Result(); n != 0 {
		t.Fatal("its data is still in delayed:data")
	}
	if _, err := e.client.ZScore(ctx, e.keys.Cancelled(), delayed.TaskID).Result(); err != nil {
		t.Fatalf("a removed task is marked too (it may be published again): %v", err)
	}
	if got, err := p.Cancel(ctx, delayed.TaskID); err != nil || got != (CancelResult{Status: CancelAlready}) {
		t.Fatalf("second Cancel: %+v %v", got, err)
	}
	fresh := NewTaskID()
	if got, err := p.Cancel(ctx, fresh); err != nil || got != (CancelResult{Status: CancelMarked}) {
		t.Fatalf("Cancel of a task in no delayed set: %+v %v", got, err)
	}
}

func TestCancelInQueueLooksInThatQueueOnly(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := NewProducer(e.client, e.prefix, e.scripts)
	delayed := New("jobs.run", nil)
	later := NewTimestamp(time.Now().Add(time.Hour))
	delayed.ScheduleTime = &later
	if _, err := p.Publish(ctx, "reports", delayed); err != nil {
		t.Fatal(err)
	}
	if got, err := p.CancelInQueue(ctx, e.queue, delayed.TaskID); err != nil || got.Status != CancelMarked {
		t.Fatalf("CancelInQueue of another queue: %+v %v", got, err)
	}
	if n, _ := e.client.ZCard(ctx, e.keys.Queue("reports").Delayed()).Result(); n != 1 {
		t.Fatal("removed from a queue that was not named")
	}
	got, err := p.CancelInQueue(ctx, "reports", delayed.TaskID)
	if err != nil || got != (CancelResult{Status: CancelRemoved, Queue: "reports"}) {
		t.Fatalf("CancelInQueue of its queue: %+v %v", got, err)
	}
	if _, err := p.CancelInQueue(ctx, "a{b}", delayed.TaskID); err == nil {
		t.Fatal("a queue name with braces was accepted")
	}
}

func TestCancelDropsMarksOlderThanSevenDays(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	old := float64(time.Now().Add(-CancelMarkTTL - time.Minute).UnixMilli())
	recent := float64(time.Now().Add(-CancelMarkTTL + time.Hour).UnixMilli())
	e.client.ZAdd(ctx, e.keys.Cancelled(), redis.Z{Score: old, Member: "old"}, redis.Z{Score: recent, Member: "recent"})
	before := time.Now().UnixMilli()
	if _, err := NewProducer(e.client, e.prefix, e.scripts).Cancel(ctx, "new"); err != nil {
		t.Fatal(err)
	}
	marks, err := e.client.ZRangeWithScores(ctx, e.keys.Cancelled(), 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(marks) != 2 || marks[0].Member != "recent" || marks[1].Member != "new" ||
		int64(marks[1].Score) < before || int64(marks[1].Score) > time.Now().UnixMilli() {
		t.Fatalf("marks %v, want recent and new (scored now in ms)", marks)
	}
}

func TestCancelRefusesABadTaskID(t *testing.T) {
	e := newEnv(t)
	p := NewProducer(e.client, e.prefix, e.scripts)
	for id, rule := range map[string]string{"": "length", "has space": "pattern"} {
		_, err := p.Cancel(context.Background(), id)
		var ve *ValidationError
		if !errors.As(err, &ve) || ve.Violations[0].Field != "task_id" || ve.Violations[0].Rule != rule {
			t.Errorf("Cancel(%q): %v, want task_id [%s]", id, err, rule)
		}
	}
	if n, _ := e.client.Exists(context.Background(), e.keys.Cancelled()).Result(); n != 0 {
		t.Fatal("a bad id was marked")
	}
}

func TestAMarkedTaskIsNotRunWhenPublishedAgain(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	var runs atomic.Int32
	w := e.worker(nil)
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error { runs.Add(1); return nil })
	p := NewProducer(e.client, e.prefix, e.scripts)
	task := New("jobs.run", nil)
	if _, err := p.Cancel(ctx, task.TaskID); err != nil {
		t.Fatal(err)
	}
	e.start(w)
	for i := range 2 { // a marked task published again is not run either
		if _, err := p.Publish(ctx, e.queue, task); err != nil {
			t.Fatal(err)
		}
		e.waitFor("publish "+strconv.Itoa(i)+" to be acknowledged", e.drained)
	}
	other := New("jobs.run", nil)
	e.publish(other)
	e.waitFor("an unmarked task to run", func() bool { return runs.Load() == 1 })
	e.waitFor("the queue to drain", e.drained)
	if runs.Load() != 1 {
		t.Fatalf("%d runs, want only the unmarked task's", runs.Load())
	}
	if n := strings.Count(e.logs.String(), `"outcome":"cancelled"`); n != 2 {
		t.Fatalf("%d cancelled outcomes logged, want 2", n)
	}
	if len(e.dead()) != 0 {
		t.Fatal("a cancelled task was dead-lettered")
	}
}
