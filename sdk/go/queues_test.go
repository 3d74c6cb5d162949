package envelope

// A Worker consuming several queues (Config.Queues), on one Redis; on a
// Cluster, ha_test.go runs one Worker over queues on different shards.

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"
)

// queuesEnv is a Worker over queues "first" and "second" whose jobs.run
// handler records the queue and task id of each run.
type queuesEnv struct {
	*env
	w    *Worker
	mu   sync.Mutex
	runs []string // "<queue> <task_id>"
}

func newQueuesEnv(t *testing.T, mutate func(*Config)) *queuesEnv {
	e := &queuesEnv{env: newEnv(t)}
	e.w = e.worker(func(c *Config) {
		c.Queue, c.Queues = "", []string{"first", "second"}
		if mutate != nil {
			mutate(c)
		}
	})
	e.w.Handle("jobs.run", func(ctx context.Context, task *Task) error {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.runs = append(e.runs, task.Queue+" "+task.TaskID)
		return nil
	})
	return e
}

func (e *queuesEnv) publishTo(queue string, task *Envelope) {
	e.t.Helper()
	if _, err := NewProducer(e.client, e.prefix, e.scripts).Publish(context.Background(), queue, task); err != nil {
		e.t.Fatal(err)
	}
}

func (e *queuesEnv) ran() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.runs)
}

func TestQueuesAreConfiguredAsOneOrSeveral(t *testing.T) {
	for _, cfg := range []Config{
		{Queue: "a", Queues: []string{"b"}},
		{Queues: []string{"a", "a"}},
		{Queues: []string{"a", "{b}"}},
		{},
	} {
		if _, err := NewWorker(nil, Scripts{}, cfg); err == nil {
			t.Errorf("%+v was accepted", cfg)
		}
	}
}

func TestAWorkerServesItsQueuesInOrderAndDeadLettersIntoEachEntrysQueue(t *testing.T) {
	e := newQueuesEnv(t, nil) // Prefetch 1, Concurrency 1: a credit of one
	var want []string
	for _, queue := range []string{"second", "first", "second", "first"} {
		task := New("jobs.run", nil)
		e.publishTo(queue, task)
		want = append(want, queue+" "+task.TaskID)
	}
	e.publishTo("second", New("jobs.nobody", nil))
	e.start(e.w)
	e.waitFor("four runs", func() bool { return len(e.ran()) == 4 })
	// The first queue is served before the second, each in its own order.
	order := []string{want[1], want[3], want[0], want[2]}
	if got := e.ran(); !slices.Equal(got, order) {
		t.Fatalf("ran %v, want %v", got, order)
	}
	ctx := context.Background()
	e.waitFor("the dead letter", func() bool {
		n, _ := e.client.XLen(ctx, e.keys.Queue("second").Dead()).Result()
		return n == 1
	})
	if dead, _ := e.client.SMembers(ctx, e.keys.DeadQueues()).Result(); !slices.Equal(dead, []string{"second"}) {
		t.Fatalf("dead-queues %v", dead)
	}
	if n, _ := e.client.XLen(ctx, e.keys.Queue("first").Dead()).Result(); n != 0 {
		t.Fatalf("%d dead letters in the first queue", n)
	}
}

func TestABlockedWorkerWakesUpForEitherQueue(t *testing.T) {
	e := newQueuesEnv(t, func(c *Config) { c.Block = 5 * time.Second })
	e.start(e.w)
	time.Sleep(300 * time.Millisecond) // both waits are armed
	for i, queue := range []string{"second", "first", "second"} {
		start := time.Now()
		e.publishTo(queue, New("jobs.run", nil))
		e.waitFor("a run on "+queue, func() bool { return len(e.ran()) == i+1 })
		if took := time.Since(start); took > time.Second {
			t.Fatalf("a task on %s waited %v: its wait did not wake up", queue, took)
		}
	}
}
