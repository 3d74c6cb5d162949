package envelope

// The circuit breaker of a task type (docs/protocol.md section 19) with two
// workers and a real Redis: read.lua opens it from the outcomes the workers
// count (section 17), holds the type back for the cool-down, lets one probe
// through and closes on its success.

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync/atomic"
	"testing"
	"time"
)

func TestABreakerOpensOnFailuresHoldsTheTypeBackAndClosesAfterAProbe(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	const cooldown = 1500 * time.Millisecond
	e.setLimit("limits.flaky", TaskLimit{Breaker: Breaker{FailureRatio: 0.5, MinAttempts: 4,
		Window: 30 * time.Second, Cooldown: cooldown, Probes: 1}})
	var failing atomic.Bool
	failing.Store(true)
	var runs spans
	failedIDs := map[string]bool{} // under runs.mu
	workers := []*Worker{
		e.worker(func(c *Config) { c.Concurrency, c.Lease = 2, 1500*time.Millisecond }),
		e.worker(func(c *Config) { c.Concurrency, c.Lease = 2, 1500*time.Millisecond }),
	}
	for _, w := range workers {
		w.Handle("limits.flaky", func(ctx context.Context, task *Task) error {
			start, fail := time.Now(), failing.Load()
			time.Sleep(20 * time.Millisecond)
			runs.mu.Lock()
			runs.all = append(runs.all, span{task.TaskID, task.TaskType, task.Redelivered, start, time.Now()})
			failedIDs[task.TaskID] = fail
			runs.mu.Unlock()
			if fail {
				return errors.New("flaky: failing on purpose")
			}
			return nil
		})
		e.start(w)
	}
	breaker := e.q.Breaker("limits.flaky")
	state := func() string { return e.client.HGet(ctx, breaker, "state").Val() }
	publish := func() string {
		task := New("limits.flaky", nil)
		none := int64(0)
		task.MaxRetries = &none // a failure dead-letters it
		e.publish(task)
		return task.TaskID
	}

	// A task every 50 ms, each failing, until read.lua opens the breaker.
	var early []string
	for i := 0; state() != "open"; i++ {
		if len(early) == 100 {
			t.Fatalf("the breaker did not open after %d failures (state %q)", len(runs.of("limits.flaky")), state())
		}
		if i%5 == 0 {
			early = append(early, publish())
		}
		time.Sleep(10 * time.Millisecond)
	}
	since, err := strconv.ParseFloat(e.client.HGet(ctx, breaker, "since").Val(), 64)
	if err != nil {
		t.Fatal(err)
	}
	openedAt := time.UnixMicro(int64(since * 1000))
	coolAt := openedAt.Add(cooldown)

	// Published while open: none starts before the cool-down ends, then one
	// probe alone (it succeeds: the flag is cleared half-way through the
	// cool-down, long after the last task handed out before the opening
	// started); its success closes the breaker and the rest run.
	held := []string{publish(), publish(), publish()}
	time.Sleep(time.Until(openedAt.Add(cooldown / 2)))
	failing.Store(false)
	e.waitFor("the breaker closed", func() bool { return state() == "closed" })
	e.waitFor("every task ran", func() bool { return len(runs.of("limits.flaky")) == len(early)+len(held) })
	all := runs.of("limits.flaky")
	onceEach(t, all, append(early, held...))
	var failed, succeeded []span
	for _, r := range all {
		if failedIDs[r.taskID] {
			failed = append(failed, r)
		} else {
			succeeded = append(succeeded, r)
		}
	}
	if len(failed) < 4 {
		t.Fatalf("opened after %d failures, want at least min_attempts, 4", len(failed))
	}
	t.Logf("opened %v after the 4th failure ended, %v after the 1st started; %d failures",
		openedAt.Sub(failed[3].end).Round(time.Millisecond), openedAt.Sub(failed[0].start).Round(time.Millisecond),
		len(failed))
	for _, r := range all {
		if r.start.Before(coolAt) && (!failedIDs[r.taskID] || slices.Contains(held, r.taskID)) {
			t.Fatalf("task %s started %v before the cool-down ended", r.taskID, coolAt.Sub(r.start))
		}
	}
	probe := succeeded[0]
	for _, r := range succeeded[1:] {
		if r.start.Before(probe.end) {
			t.Fatalf("task %s started at %v, while the probe %s ran (until %v)", r.taskID,
				r.start.Format(time.StampMilli), probe.taskID, probe.end.Format(time.StampMilli))
		}
	}
	e.waitFor("the queue drained", e.drained)
	if dead := len(e.dead()); dead != len(failed) {
		t.Fatalf("%d dead letters, want the %d failures", dead, len(failed))
	}
}
