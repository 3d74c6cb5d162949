package envelope

// Limits per task type (docs/protocol.md section 19) against a real Redis:
// the TaskLimits API, and workers that keep to concurrency and rate limits
// set at run time.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// span is one run of a handler: its task and when it started and ended.
type span struct {
	taskID, taskType string
	redelivered      int
	start, end       time.Time
}

// spans records the runs of the handlers registered with record.
type spans struct {
	mu  sync.Mutex
	all []span
}

// record registers taskType on every worker, running for d (or until release
// is closed, when given) and recording its span.
func (s *spans) record(taskType string, d time.Duration, release <-chan struct{}, workers ...*Worker) {
	for _, w := range workers {
		w.Handle(taskType, func(ctx context.Context, t *Task) error {
			start := time.Now()
			if release != nil {
				<-release
			}
			time.Sleep(d)
			s.mu.Lock()
			defer s.mu.Unlock()
			s.all = append(s.all, span{t.TaskID, t.TaskType, t.Redelivered, start, time.Now()})
			return nil
		})
	}
}

// of are the recorded spans of taskType, in start order.
func (s *spans) of(taskType string) []span {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []span
	for _, sp := range s.all {
		if sp.taskType == taskType {
			out = append(out, sp)
		}
	}
	slices.SortFunc(out, func(a, b span) int { return a.start.Compare(b.start) })
	return out
}

// mostAtOnce is the most spans running at one instant.
func mostAtOnce(runs []span) int {
	most := 0
	for _, at := range runs {
		n := 0
		for _, other := range runs {
			if !other.start.After(at.start) && other.end.After(at.start) {
				n++
			}
		}
		most = max(most, n)
	}
	return most
}

// onceEach fails unless runs holds each of ids exactly once.
func onceEach(t *testing.T, runs []span, ids []string) {
	t.Helper()
	seen := map[string]int{}
	for _, r := range runs {
		seen[r.taskID]++
	}
	for _, id := range ids {
		if seen[id] != 1 {
			t.Errorf("task %s ran %d times", id, seen[id])
		}
	}
	if len(runs) != len(ids) {
		t.Errorf("%d runs of %d tasks", len(runs), len(ids))
	}
}

// publishN publishes n tasks of taskType and answers their ids.
func (e *env) publishN(taskType string, n int) []string {
	e.t.Helper()
	ids := make([]string, n)
	for i := range ids {
		task := New(taskType, nil)
		e.publish(task)
		ids[i] = task.TaskID
	}
	return ids
}

func (e *env) setLimit(taskType string, limit TaskLimit) {
	e.t.Helper()
	if err := (TaskLimits{e.client, e.keys}).Set(context.Background(), e.queue, taskType, limit); err != nil {
		e.t.Fatal(err)
	}
}

func TestTaskLimitsRoundTripAndRefuseWhatBreaksTheSchema(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	limits := TaskLimits{e.client, e.keys}
	if err := limits.Set(ctx, e.queue, "limits.slow", TaskLimit{Concurrency: 2}); err != nil {
		t.Fatal(err)
	}
	rated := TaskLimit{Rate: 0.5, Burst: 3, Smooth: true}
	if err := limits.Set(ctx, e.queue, "limits.rated", rated); err != nil {
		t.Fatal(err)
	}
	guarded := TaskLimit{Breaker: Breaker{FailureRatio: 0.25, Window: 1500 * time.Millisecond, Probes: 2}}
	if err := limits.Set(ctx, e.queue, "limits.guarded", guarded); err != nil {
		t.Fatal(err)
	}
	stored, _ := e.client.HGetAll(ctx, e.q.Limits()).Result()
	want := map[string]string{"limits.slow": `{"concurrency":2}`,
		"limits.rated":   `{"rate":0.5,"burst":3,"smooth":true}`,
		"limits.guarded": `{"breaker":{"failure_ratio":0.25,"window_s":1.5,"probes":2}}`}
	if fmt.Sprint(stored) != fmt.Sprint(want) {
		t.Fatalf("stored %v, want %v", stored, want)
	}
	if got, ok, err := limits.Get(ctx, e.queue, "limits.rated"); err != nil || !ok || got != rated {
		t.Fatalf("Get: %+v %v %v", got, ok, err)
	}
	if got, ok, err := limits.Get(ctx, e.queue, "limits.guarded"); err != nil || !ok || got != guarded {
		t.Fatalf("Get of a breaker: %+v %v %v", got, ok, err)
	}
	if _, ok, err := limits.Get(ctx, e.queue, "limits.none"); err != nil || ok {
		t.Fatalf("Get of a type without a limit: %v %v", ok, err)
	}
	all, err := limits.List(ctx, e.queue)
	if err != nil || len(all) != 3 || all["limits.slow"] != (TaskLimit{Concurrency: 2}) {
		t.Fatalf("List: %v %v", all, err)
	}

	for _, c := range []struct {
		limit       TaskLimit
		field, rule string
	}{
		{TaskLimit{}, "concurrency", "required"},
		{TaskLimit{Burst: 2}, "concurrency", "required"},
		{TaskLimit{Concurrency: -1}, "concurrency", "minimum"},
		{TaskLimit{Rate: -2}, "rate", "minimum"},
		{TaskLimit{Rate: 1, Burst: -1}, "burst", "minimum"},
		{TaskLimit{Breaker: Breaker{MinAttempts: 5}}, "breaker.failure_ratio", "required"},
		{TaskLimit{Concurrency: 1, Breaker: Breaker{FailureRatio: 1.5}}, "breaker.failure_ratio", "maximum"},
		{TaskLimit{Breaker: Breaker{FailureRatio: 0.5, Cooldown: -time.Second}}, "breaker.cooldown_s", "minimum"},
		{TaskLimit{Breaker: Breaker{FailureRatio: 0.5, Probes: -1}}, "breaker.probes", "minimum"},
	} {
		err := limits.Set(ctx, e.queue, "limits.slow", c.limit)
		var invalid *InvalidLimitError
		if !errors.As(err, &invalid) || invalid.Field != c.field || invalid.Rule != c.rule ||
			!strings.Contains(err.Error(), c.field) {
			t.Errorf("Set(%+v): %v, want %s [%s]", c.limit, err, c.field, c.rule)
		}
	}
	if err := limits.Set(ctx, "{bad}", "limits.slow", TaskLimit{Concurrency: 1}); err == nil {
		t.Error("a queue name that is no hash tag was accepted")
	}
	if err := limits.Set(ctx, e.queue, "limits slow", TaskLimit{Concurrency: 1}); err == nil {
		t.Error("a task type with a space was accepted")
	}

	e.client.HSet(ctx, e.q.Limits(), "limits.broken", `{"concurency": 5}`)
	all, err = limits.List(ctx, e.queue)
	if err == nil || !strings.Contains(err.Error(), "limits.broken") || len(all) != 3 {
		t.Fatalf("List with a broken value: %v %v", all, err)
	}
	if removed, err := limits.Remove(ctx, e.queue, "limits.slow"); err != nil || !removed {
		t.Fatalf("Remove: %v %v", removed, err)
	}
	if removed, _ := limits.Remove(ctx, e.queue, "limits.slow"); removed {
		t.Fatal("removed twice")
	}
	if n, _ := e.client.HLen(ctx, e.q.Limits()).Result(); n != 3 {
		t.Fatalf("%d limits left, want 3", n)
	}
}

func TestTheParkedConsumerNameIsReserved(t *testing.T) {
	if _, err := NewWorker(nil, Scripts{}, Config{Queue: "jobs", Consumer: ParkedConsumer}); err == nil {
		t.Fatal("a worker named parked was accepted")
	}
}

// Two workers, three consumers each, on a backlog of 12 slow tasks limited to
// 2 at once and 12 unlimited ones behind them: the cap holds across both
// workers, the unlimited tasks flow past the parked ones, all run once.
func TestAConcurrencyLimitHoldsAcrossWorkersAndOtherTypesFlowPast(t *testing.T) {
	e := newEnv(t)
	e.setLimit("limits.slow", TaskLimit{Concurrency: 2})
	slow := e.publishN("limits.slow", 12)
	fast := e.publishN("limits.fast", 12)
	var runs spans
	workers := []*Worker{
		e.worker(func(c *Config) { c.Concurrency, c.Lease = 3, 1500*time.Millisecond }),
		e.worker(func(c *Config) { c.Concurrency, c.Lease = 3, 1500*time.Millisecond }),
	}
	runs.record("limits.slow", 150*time.Millisecond, nil, workers...)
	runs.record("limits.fast", 5*time.Millisecond, nil, workers...)
	for _, w := range workers {
		e.start(w)
	}
	e.waitFor("24 runs", func() bool { return len(runs.of("limits.slow"))+len(runs.of("limits.fast")) == 24 })
	slowRuns, fastRuns := runs.of("limits.slow"), runs.of("limits.fast")
	onceEach(t, slowRuns, slow)
	onceEach(t, fastRuns, fast)
	if most := mostAtOnce(slowRuns); most != 2 {
		t.Errorf("%d slow tasks ran at once, want the cap, 2", most)
	}
	lastFast := slices.MaxFunc(fastRuns, func(a, b span) int { return a.end.Compare(b.end) }).end
	if lastSlow := slowRuns[len(slowRuns)-1].start; !lastFast.Before(lastSlow) {
		t.Errorf("the unlimited tasks ended at %v, after the last slow task started (%v): blocked behind it",
			lastFast.Format(time.StampMilli), lastSlow.Format(time.StampMilli))
	}
	e.waitFor("the queue drained", e.drained)
	if n, _ := e.client.ZCard(context.Background(), e.q.Running("limits.slow")).Result(); n != 0 {
		t.Errorf("%d slots still held", n)
	}
}

// A rate of 20 starts a second with a burst of 1 spaces 40 starts ~50 ms apart.
func TestARateLimitSpacesTheStarts(t *testing.T) {
	e := newEnv(t)
	e.setLimit("limits.rated", TaskLimit{Rate: 20})
	ids := e.publishN("limits.rated", 40)
	var runs spans
	w := e.worker(func(c *Config) { c.Concurrency, c.Lease = 2, 1500*time.Millisecond })
	runs.record("limits.rated", 0, nil, w)
	e.start(w)
	e.waitFor("40 runs", func() bool { return len(runs.of("limits.rated")) == 40 })
	started := runs.of("limits.rated")
	onceEach(t, started, ids)
	total := started[len(started)-1].start.Sub(started[0].start)
	if total < 1600*time.Millisecond || total > 2600*time.Millisecond {
		t.Errorf("40 starts spanned %v, want about 39 × 50 ms", total)
	}
	for i := 1; i < len(started); i++ {
		if gap := started[i].start.Sub(started[i-1].start); gap > 150*time.Millisecond {
			t.Errorf("start %d came %v after the previous one: delivery did not resume within ~100 ms", i, gap)
		}
	}
}

// A consumer that read an entry with read.lua and vanished holds its slot
// until the slot's deadline, lease_ms after the read: the task parked behind
// it starts after the deadline, never before.
func TestASlotOfAVanishedConsumerComesBackAfterTheLease(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	const lease = 1500 * time.Millisecond
	e.setLimit("limits.one", TaskLimit{Concurrency: 1})
	held := e.publishN("limits.one", 1)
	w := e.worker(func(c *Config) { c.Lease = lease })
	if err := w.ensureGroups(ctx); err != nil {
		t.Fatal(err)
	}
	readAt := time.Now()
	res, err := e.scripts.Get("read").Run(ctx, e.client, e.q.TaskStreams(), DefaultGroup, "vanished", 1,
		lease.Milliseconds(), 1).Result()
	if streams, _, err2 := parseRead(res); err != nil || err2 != nil || len(streams) != 1 {
		t.Fatalf("the vanishing consumer's read: %v %v %v", res, err, err2)
	}
	waiting := e.publishN("limits.one", 1)
	var runs spans
	runs.record("limits.one", 0, nil, w)
	e.start(w)
	e.waitFor("both tasks ran", func() bool { return len(runs.of("limits.one")) == 2 })
	all := runs.of("limits.one")
	onceEach(t, all, append(waiting, held...))
	first := all[0]
	if first.taskID != waiting[0] {
		t.Fatalf("%s started first, want the parked task %s", first.taskID, waiting[0])
	}
	if early := readAt.Add(lease).Sub(first.start); early > 20*time.Millisecond {
		t.Fatalf("the parked task started %v before the vanished consumer's slot expired", early)
	}
	if late := first.start.Sub(readAt.Add(lease)); late > time.Second {
		t.Fatalf("the parked task started %v after the slot expired", late)
	}
}

// A task that runs for several leases keeps its slot (renewed with the
// liveness key), and the entry parked behind it is neither started nor taken
// over from the reserved consumer "parked".
func TestALongTaskKeepsItsSlotAndParkedEntriesAreNotTakenOver(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.setLimit("limits.one", TaskLimit{Concurrency: 1})
	ids := e.publishN("limits.one", 2)
	release := make(chan struct{})
	var runs spans
	w := e.worker(func(c *Config) { c.Concurrency = 2 }) // lease 600 ms
	runs.record("limits.one", 0, release, w)
	e.start(w)
	releaseAll := sync.OnceFunc(func() { close(release) })
	t.Cleanup(releaseAll) // before the workers are stopped, also when the test fails
	e.waitFor("the second entry parked", func() bool {
		n, _ := e.client.LLen(ctx, e.q.Base()+":parked:limits.one").Result()
		return n == 1
	})
	time.Sleep(2 * time.Second) // over three leases: renewals and takeover rounds
	parked, err := e.client.XPending(ctx, e.q.Stream(Normal), DefaultGroup).Result()
	if err != nil || parked.Consumers[ParkedConsumer] != 1 {
		t.Fatalf("the parked entry is no longer parked: %+v %v", parked, err)
	}
	if strings.Contains(e.logs.String(), "took over") {
		t.Fatal("an entry was taken over")
	}
	releaseAll()
	e.waitFor("both tasks ran", func() bool { return len(runs.of("limits.one")) == 2 })
	all := runs.of("limits.one")
	onceEach(t, all, ids)
	if !all[1].start.After(all[0].end) || all[1].redelivered != 0 {
		t.Fatalf("the second task ran alongside the first or was redelivered: %+v", all)
	}
}

// Raising a concurrency limit from 1 to 3 takes effect without a restart.
func TestALimitChangedAtRunTimeTakesEffect(t *testing.T) {
	e := newEnv(t)
	e.setLimit("limits.slow", TaskLimit{Concurrency: 1})
	ids := e.publishN("limits.slow", 12)
	var runs spans
	w := e.worker(func(c *Config) { c.Concurrency, c.Lease = 3, 1500*time.Millisecond })
	runs.record("limits.slow", 150*time.Millisecond, nil, w)
	e.start(w)
	e.waitFor("three runs", func() bool { return len(runs.of("limits.slow")) >= 3 })
	changedAt := time.Now()
	e.setLimit("limits.slow", TaskLimit{Concurrency: 3})
	e.waitFor("12 runs", func() bool { return len(runs.of("limits.slow")) == 12 })
	all := runs.of("limits.slow")
	onceEach(t, all, ids)
	var before, after []span
	for _, r := range all {
		if r.start.Before(changedAt) {
			before = append(before, r)
		} else {
			after = append(after, r)
		}
	}
	if most := mostAtOnce(before); most != 1 {
		t.Errorf("%d ran at once under a limit of 1", most)
	}
	if most := mostAtOnce(after); most != 3 {
		t.Errorf("%d ran at once after the limit was raised to 3, want 3", most)
	}
}

// With a Prefetch of several entries, an entry of a limited type read behind
// others is not handed out with them (it would hold its slot while they run):
// it is parked, holds no slot meanwhile, and runs once the worker can start it.
func TestALimitedEntryReadBehindOthersWaitsParkedWithoutASlot(t *testing.T) {
	e := newEnv(t)
	e.setLimit("limits.one", TaskLimit{Concurrency: 1})
	fast := e.publishN("limits.fast", 2)
	limited := e.publishN("limits.one", 1)
	var runs spans
	var mu sync.Mutex
	var slotsWhileFast []int64
	w := e.worker(func(c *Config) { c.Prefetch = 3 })
	w.Handle("limits.fast", func(ctx context.Context, t *Task) error {
		held := e.client.ZCard(ctx, e.q.Running("limits.one")).Val()
		time.Sleep(50 * time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		slotsWhileFast = append(slotsWhileFast, held)
		runs.mu.Lock()
		defer runs.mu.Unlock()
		runs.all = append(runs.all, span{t.TaskID, t.TaskType, t.Redelivered, time.Now(), time.Now()})
		return nil
	})
	runs.record("limits.one", 0, nil, w)
	e.start(w)
	e.waitFor("three runs", func() bool { return len(runs.of("limits.fast"))+len(runs.of("limits.one")) == 3 })
	onceEach(t, runs.of("limits.fast"), fast)
	onceEach(t, runs.of("limits.one"), limited)
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(slotsWhileFast, []int64{0, 0}) {
		t.Fatalf("slots held while the entries read before it ran: %v", slotsWhileFast)
	}
}

// A breaker's seconds are Durations: rounded to the nanosecond, refused past
// what a Duration holds or below 1 ns, and written back as the seconds they hold.
func TestBreakerSecondsAreDurations(t *testing.T) {
	limit, err := ParseTaskLimit([]byte(`{"breaker":{"failure_ratio":1e0,"window_s":0.001,"cooldown_s":2.5}}`))
	if err != nil || limit.Breaker.Window != time.Millisecond || limit.Breaker.Cooldown != 2500*time.Millisecond {
		t.Fatalf("%+v %v", limit, err)
	}
	if got := string(limit.JSON()); got != `{"breaker":{"failure_ratio":1,"window_s":0.001,"cooldown_s":2.5}}` {
		t.Fatalf("written as %s", got)
	}
	for text, rule := range map[string]string{
		`{"breaker":{"failure_ratio":1,"window_s":1e10}}`:  "maximum",
		`{"breaker":{"failure_ratio":1,"window_s":1e-12}}`: "minimum",
		`{"breaker":{"failure_ratio":1,"window_s":1e999}}`: "type",
		`{"breaker":{"failure_ratio":1,"window_s":-0.5}}`:  "minimum",
	} {
		var invalid *InvalidLimitError
		if _, err := ParseTaskLimit([]byte(text)); !errors.As(err, &invalid) ||
			invalid.Field != "breaker.window_s" || invalid.Rule != rule {
			t.Errorf("%s: %v, want breaker.window_s [%s]", text, err, rule)
		}
	}
}
