package envelope

// Worker tests against a real Redis: $ENVELOPE_TEST_REDIS_URL, else a private
// redis-server started by TestMain (main_test.go); skipped when there is
// neither. Every test uses its own key prefix.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

type env struct {
	t       *testing.T
	client  *redis.Client
	scripts Scripts
	prefix  string
	queue   string
	keys    KeySpace
	q       QueueKeys
	logs    *lockedBuffer
}

type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func newEnv(t *testing.T) *env {
	url := testRedisURL
	if url == "" {
		t.Skip("no Redis: set ENVELOPE_TEST_REDIS_URL or put redis-server on PATH")
	}
	client, err := NewClient(url)
	if err != nil {
		t.Fatal(err)
	}
	scripts, err := LoadScripts("") // $ENVELOPE_LUA_DIR, else the embedded copies
	if err != nil {
		t.Fatal(err)
	}
	prefix := "go-" + NewTraceID()[:10]
	e := &env{t: t, client: client, scripts: scripts, prefix: prefix, queue: "jobs",
		keys: KeySpace{prefix}, q: KeySpace{prefix}.Queue("jobs"), logs: &lockedBuffer{}}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("worker log:\n%s", e.logs.String())
		}
		ctx := context.Background()
		if keys, _ := client.Keys(ctx, prefix+":*").Result(); len(keys) > 0 {
			client.Del(ctx, keys...)
		}
		client.Close()
	})
	return e
}

func (e *env) worker(mutate func(*Config)) *Worker {
	cfg := Config{
		Prefix: e.prefix, Queue: e.queue, Lease: 600 * time.Millisecond, Block: 100 * time.Millisecond,
		Retry:  RetryPolicy{FastRetries: 2, Backoff: 100 * time.Millisecond, MaxBackoff: 400 * time.Millisecond},
		Logger: slog.New(slog.NewJSONHandler(e.logs, nil)), DeferDelay: 200 * time.Millisecond,
	}
	if mutate != nil {
		mutate(&cfg)
	}
	w, err := NewWorker(e.client, e.scripts, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	return w
}

// start runs w (and a promoter) until the test ends.
func (e *env) start(w *Worker) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _ = w.Run(ctx) }()
	p := &Promoter{Client: e.client, Keys: e.keys, Scripts: e.scripts, MaxIdle: 200 * time.Millisecond,
		Log: slog.New(slog.NewJSONHandler(e.logs, nil))}
	go func() { defer wg.Done(); p.Run(ctx) }()
	e.t.Cleanup(func() { cancel(); wg.Wait() })
}

func (e *env) publish(env *Envelope) {
	e.t.Helper()
	if _, err := NewProducer(e.client, e.prefix, e.scripts).Publish(context.Background(), e.queue, env); err != nil {
		e.t.Fatal(err)
	}
}

func (e *env) waitFor(what string, cond func() bool) {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			e.t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (e *env) dead() []map[string]any {
	msgs, err := e.client.XRange(context.Background(), e.q.Dead(), "-", "+").Result()
	if err != nil {
		e.t.Fatal(err)
	}
	out := make([]map[string]any, len(msgs))
	for i, m := range msgs {
		out[i] = m.Values
	}
	return out
}

func (e *env) drained() bool {
	ctx := context.Background()
	for _, s := range e.q.TaskStreams() {
		if n, _ := e.client.XLen(ctx, s).Result(); n > 0 {
			return false
		}
		if p, err := e.client.XPending(ctx, s, DefaultGroup).Result(); err == nil && p.Count > 0 {
			return false
		}
	}
	n, _ := e.client.ZCard(ctx, e.q.Delayed()).Result()
	return n == 0
}

// hold makes consumer read one entry (it then holds it pending).
func (e *env) hold(w *Worker, consumer string) string {
	e.t.Helper()
	ctx := context.Background()
	if err := w.ensureGroups(ctx); err != nil {
		e.t.Fatal(err)
	}
	res, err := e.client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: DefaultGroup, Consumer: consumer,
		Streams: []string{e.q.Stream(Normal), ">"}, Count: 1, Block: -1}).Result()
	if err != nil || len(res) != 1 || len(res[0].Messages) != 1 {
		e.t.Fatalf("reading as %s: %v %v", consumer, res, err)
	}
	return res[0].Messages[0].ID
}

func TestWorkerTakesOverDeadConsumersOnly(t *testing.T) {
	e := newEnv(t)
	var ran sync.Map
	w := e.worker(func(c *Config) { c.ForgetAfter = c.Lease })
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error {
		ran.Store(task.TaskID, task.Redelivered)
		return nil
	})
	dead, alive := New("jobs.run", nil), New("jobs.run", nil)
	e.publish(dead)
	e.hold(w, "ghost-dead")
	e.publish(alive)
	e.hold(w, "ghost-alive")
	e.client.Set(context.Background(), e.keys.Consumer("ghost-alive"), "h 1 go", time.Minute)

	e.start(w)
	e.waitFor("the dead consumer's entry to run", func() bool { _, ok := ran.Load(dead.TaskID); return ok })
	if n, _ := ran.Load(dead.TaskID); n != 1 {
		t.Fatalf("redelivery count %v, want 1", n)
	}
	e.waitFor("the dead consumer to be forgotten once idle for ForgetAfter", func() bool {
		consumers, _ := e.client.XInfoConsumers(context.Background(), e.q.Stream(Normal), DefaultGroup).Result()
		for _, c := range consumers {
			if c.Name == "ghost-dead" {
				return false
			}
		}
		return true
	})
	time.Sleep(3 * w.cfg.Lease) // long past any idle threshold
	if _, ok := ran.Load(alive.TaskID); ok {
		t.Fatal("an entry of a live consumer was taken over only because it was idle")
	}
	p, _ := e.client.XPendingExt(context.Background(), &redis.XPendingExtArgs{Stream: e.q.Stream(Normal),
		Group: DefaultGroup, Start: "-", End: "+", Count: 10}).Result()
	if len(p) != 1 || p[0].Consumer != "ghost-alive" {
		t.Fatalf("pending %v", p)
	}
}

func TestEntryOfAConsumerThatDiedTooOftenIsDeadLettered(t *testing.T) {
	e := newEnv(t)
	w := e.worker(func(c *Config) { c.MaxRedeliveries = 3 })
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error { t.Error("ran"); return nil })
	task := New("jobs.run", nil)
	e.client.XAdd(context.Background(), &redis.XAddArgs{Stream: e.q.Stream(Normal),
		Values: []string{"v", "1", "enc", "json", "body", string(task.JSON()), "n", "2"}})
	e.hold(w, "ghost")
	e.start(w)
	e.waitFor("a dead-letter entry", func() bool { return len(e.dead()) == 1 })
	d := e.dead()[0]
	if d["failure_class"] != ClassRedeliveryLimit || d["redeliveries"] != "3" || d["raw.body"] != string(task.JSON()) {
		t.Fatalf("dead-letter entry %v", d)
	}
	// requeue.lua wrote who and where (the consumer is the one that died holding it).
	if _, ok := d["attempts"]; ok {
		t.Fatalf("redelivery_limit entries count redeliveries, not attempts: %v", d)
	}
	if d["queue"] != e.queue || d["language"] != Language || d["consumer"] != "ghost" ||
		d["pid"] != w.pid || d["host"] != w.host || d["source_stream"] != e.q.Stream(Normal) {
		t.Fatalf("dead-letter entry %v", d)
	}
	for _, name := range []string{"first_failure_at", "last_failure_at", "dead_at"} {
		if _, err := ParseTimestamp(fmt.Sprint(d[name])); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	e.waitFor("the queue to be listed in dead-queues", func() bool {
		ok, _ := e.client.SIsMember(context.Background(), e.keys.DeadQueues(), e.queue).Result()
		return ok
	})
	e.waitFor("the dead letter to be counted", func() bool {
		return e.client.HGet(context.Background(), e.q.Stats(), StatsField("jobs.run", StatDead)).Val() == "1"
	})
}

func TestDeadConsumersAreForgottenOnlyAfterForgetAfter(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	w := e.worker(nil) // ForgetAfter: one hour
	if err := w.ensureGroups(ctx); err != nil {
		t.Fatal(err)
	}
	stream := e.q.Stream(Normal)
	for _, name := range []string{"ghost-idle", "alive-idle"} {
		if err := e.client.XGroupCreateConsumer(ctx, stream, DefaultGroup, name).Err(); err != nil {
			t.Fatal(err)
		}
	}
	e.client.Set(ctx, e.keys.Consumer("alive-idle"), "h 1 go", time.Minute)
	time.Sleep(w.cfg.Lease + 100*time.Millisecond)
	consumers := func() []string {
		list, _ := e.client.XInfoConsumers(ctx, stream, DefaultGroup).Result()
		var names []string
		for _, c := range list {
			names = append(names, c.Name)
		}
		return names
	}
	if _, err := w.TakeOverDeadConsumers(ctx); err != nil {
		t.Fatal(err)
	}
	if got := consumers(); len(got) != 2 {
		t.Fatalf("forgotten before an hour idle: %v", got)
	}
	short := e.worker(func(c *Config) { c.ForgetAfter = time.Millisecond }) // max(ForgetAfter, lease) applies
	if _, err := short.TakeOverDeadConsumers(ctx); err != nil {
		t.Fatal(err)
	}
	if got := consumers(); len(got) != 1 || got[0] != "alive-idle" {
		t.Fatalf("consumers left %v, want only the live one", got)
	}
}

func TestPublishReplacesADelayedCopyAndRegistersEveryDelayedStore(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := NewProducer(e.client, e.prefix, e.scripts)
	task := New("jobs.run", nil)
	later := NewTimestamp(time.Now().Add(time.Hour).UTC())
	task.ScheduleTime = &later
	for i := 0; i < 2; i++ { // the registry is rebuilt by the next delayed store
		e.client.Del(ctx, e.keys.Queues())
		if _, err := p.Publish(ctx, e.queue, task); err != nil {
			t.Fatal(err)
		}
		if ok, _ := e.client.SIsMember(ctx, e.keys.Queues(), e.queue).Result(); !ok {
			t.Fatal("delayed store without SADD <prefix>:queues")
		}
	}
	now := task.Clone()
	now.ScheduleTime = nil
	id, err := p.Publish(ctx, e.queue, now)
	if err != nil || id == "" {
		t.Fatalf("publish now: %q %v", id, err)
	}
	if n, _ := e.client.ZCard(ctx, e.q.Delayed()).Result(); n != 0 {
		t.Fatal("the delayed copy was left behind: the task would run twice")
	}
	if n, _ := e.client.HLen(ctx, e.q.DelayedData()).Result(); n != 0 {
		t.Fatal("the delayed copy's data was left behind")
	}
	if n, _ := e.client.XLen(ctx, e.q.Stream(Normal)).Result(); n != 1 {
		t.Fatalf("%d entries in the stream, want 1", n)
	}
}

func TestReadTakesExactlyPrefetchEntries(t *testing.T) {
	e := newEnv(t)
	release := make(chan struct{})
	var runs atomic.Int32
	w := e.worker(nil) // Prefetch 1
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error {
		if runs.Add(1) == 1 {
			<-release
		}
		return nil
	})
	for _, p := range []int{255, 100, 0} {
		task := New("jobs.run", nil)
		task.Priority = p
		e.publish(task)
	}
	e.start(w)
	e.waitFor("the first run", func() bool { return runs.Load() == 1 })
	time.Sleep(300 * time.Millisecond)
	total := int64(0)
	for _, s := range e.q.TaskStreams() {
		p, _ := e.client.XPending(context.Background(), s, DefaultGroup).Result()
		total += p.Count
	}
	close(release)
	if total != 1 {
		t.Fatalf("%d entries pending while one runs with Prefetch 1, want 1", total)
	}
	e.waitFor("the queue to drain", e.drained)
}

func TestBusyIdempotencyKeyIsDeferredThenTakenOverFromADeadHolder(t *testing.T) {
	e := newEnv(t)
	var runs atomic.Int32
	w := e.worker(nil)
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error { runs.Add(1); return nil })
	ctx := context.Background()
	idemKey := e.keys.Idempotency("jobs.run", "k1")
	e.client.Set(ctx, e.keys.Consumer("other"), "h 1 go", time.Minute)
	e.client.Set(ctx, idemKey, "running other task-0", time.Minute)
	task := New("jobs.run", nil)
	k := "k1"
	task.IdempotencyKey = &k
	e.publish(task)
	e.start(w)

	e.waitFor("the task to be deferred", func() bool {
		body, _ := e.client.HGet(ctx, e.q.DelayedData(), task.TaskID).Result()
		return strings.Contains(body, `"retry_count":0`)
	})
	time.Sleep(500 * time.Millisecond)
	if runs.Load() != 0 {
		t.Fatal("ran while another live consumer held the key")
	}
	e.client.Del(ctx, e.keys.Consumer("other")) // the holder dies
	e.waitFor("the task to run", func() bool { return runs.Load() == 1 })
	e.waitFor("the queue to drain", e.drained)
	if v, _ := e.client.Get(ctx, idemKey).Result(); !strings.HasPrefix(v, "done "+task.TaskID+" ") {
		t.Fatalf("marker %q", v)
	}
}

// lostClaims is a redis.Hook that, while on, answers the idem_begin.lua calls with a
// connection error: after Redis ran them (their reply is lost), or with drop unsent.
type lostClaims struct {
	sha  string
	drop bool
	on   atomic.Bool
	lost atomic.Int32
}

func (h *lostClaims) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *lostClaims) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *lostClaims) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if args := cmd.Args(); !h.on.Load() || cmd.Name() != "evalsha" || len(args) < 2 || args[1] != h.sha {
			return next(ctx, cmd)
		}
		if !h.drop {
			if err := next(ctx, cmd); err != nil {
				return err
			}
		}
		h.lost.Add(1)
		err := &net.OpError{Op: "read", Net: "tcp", Err: syscall.ECONNRESET}
		cmd.SetErr(err)
		return err
	}
}

// A claim whose reply is lost may have landed: it is released before the entry is
// deferred, so that no other consumer finds the key busy on this live one until it
// expires. A release that finds the claim never landed (another consumer's claim is
// there) deletes nothing and is not a takeover.
func TestAClaimThatFailedIsReleasedBeforeTheTaskIsDeferred(t *testing.T) {
	for _, c := range []struct {
		name  string
		drop  bool   // the request is lost, not its reply
		other string // a claim of another live consumer, there before the task
	}{
		{name: "reply lost"},
		{name: "request lost while another consumer holds the key", drop: true, other: "running other task-0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEnv(t)
			ctx := context.Background()
			var runs atomic.Int32
			w := e.worker(func(c *Config) { c.DeferDelay = time.Second })
			w.Handle("jobs.run", func(ctx context.Context, task *Task) error { runs.Add(1); return nil })
			idemKey := e.keys.Idempotency("jobs.run", "k1")
			if c.other != "" {
				e.client.Set(ctx, e.keys.Consumer("other"), "h 1 go", time.Minute)
				e.client.Set(ctx, idemKey, c.other, time.Minute)
			}
			fault := &lostClaims{sha: e.scripts.Get("idem_begin").Hash(), drop: c.drop}
			fault.on.Store(true)
			e.client.AddHook(fault)
			task := New("jobs.run", nil)
			k := "k1"
			task.IdempotencyKey = &k
			e.publish(task)
			e.start(w)

			e.waitFor("the task to be deferred", func() bool {
				n, _ := e.client.ZScore(ctx, e.q.Delayed(), task.TaskID).Result()
				return n > 0
			})
			if fault.lost.Load() == 0 || runs.Load() != 0 {
				t.Fatalf("%d claims lost, %d runs: want a lost claim and no run", fault.lost.Load(), runs.Load())
			}
			if v, err := e.client.Get(ctx, idemKey).Result(); c.other == "" && !errors.Is(err, redis.Nil) {
				t.Fatalf("the claim whose reply was lost was kept: %q", v)
			} else if c.other != "" && v != c.other {
				t.Fatalf("the other consumer's claim is %q, want %q", v, c.other)
			}

			fault.on.Store(false)
			if c.other != "" {
				e.client.Del(ctx, idemKey) // the other consumer released it
			}
			e.waitFor("the task to run", func() bool { return runs.Load() == 1 })
			e.waitFor("the queue to drain", e.drained)
			time.Sleep(300 * time.Millisecond)
			if n := runs.Load(); n != 1 {
				t.Fatalf("%d runs, want 1", n)
			}
			if v, _ := e.client.Get(ctx, idemKey).Result(); !strings.HasPrefix(v, "done "+task.TaskID+" ") {
				t.Fatalf("marker %q", v)
			}
			if out := e.logs.String(); strings.Contains(out, "taken over") ||
				!strings.Contains(out, "idempotency claim failed; releasing it and deferring") {
				t.Fatalf("want the failed claim logged and no takeover:\n%s", out)
			}
		})
	}
}

// withRetrySlotTaken is a worker running jobs.run (counting its runs) that allows one
// retry of it at a time, the one slot being held by another consumer.
func withRetrySlotTaken(t *testing.T) (*env, *Worker, *atomic.Int32, string) {
	e := newEnv(t)
	runs := new(atomic.Int32)
	w := e.worker(func(c *Config) { c.RetryConcurrency = 1 })
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error { runs.Add(1); return nil })
	slots := e.keys.Retrying("jobs.run")
	e.client.ZAdd(context.Background(), slots,
		redis.Z{Score: float64(time.Now().Add(time.Minute).UnixMilli()), Member: "other"})
	return e, w, runs, slots
}

func TestRetryWaitsForAFreeRetrySlot(t *testing.T) {
	e, w, runs, slots := withRetrySlotTaken(t)
	ctx := context.Background()
	task := tiered(New("jobs.run", nil))
	task.RetryCount = 1
	e.publish(task)
	e.start(w)
	e.waitFor("the retry to be rescheduled", func() bool {
		body, _ := e.client.HGet(ctx, e.q.DelayedData(), task.TaskID).Result()
		return strings.Contains(body, `"retry_count":1`)
	})
	if runs.Load() != 0 {
		t.Fatal("ran without a retry slot")
	}
	e.client.ZRem(ctx, slots, "other")
	e.waitFor("the retry to run", func() bool { return runs.Load() == 1 })
	e.waitFor("its slot to be released", func() bool { n, _ := e.client.ZCard(ctx, slots).Result(); return n == 0 })
}

func TestARetryWithoutTheTieredPolicyTakesNoRetrySlot(t *testing.T) {
	e, w, runs, slots := withRetrySlotTaken(t)
	ctx := context.Background()
	task := New("jobs.run", nil) // e.g. a Celery self.retry(): the cap is the tiered policy's
	task.RetryCount = 1
	e.publish(task)
	e.start(w)
	e.waitFor("the retry to run", func() bool { return runs.Load() == 1 })
	if n, _ := e.client.ZCard(ctx, slots).Result(); n != 1 {
		t.Fatalf("%d retry slots held, want only the other one", n)
	}
}

func TestIdempotencyIsCheckedBeforeTheRetrySlot(t *testing.T) {
	e, w, runs, _ := withRetrySlotTaken(t)
	ctx := context.Background()
	k1, k2 := "done-key", "free-key"
	e.client.Set(ctx, e.keys.Idempotency("jobs.run", k1), "done earlier 2025-09-11T04:40:00Z", time.Minute)
	dup, waiting := tiered(New("jobs.run", nil)), tiered(New("jobs.run", nil))
	dup.RetryCount, dup.IdempotencyKey = 1, &k1
	waiting.RetryCount, waiting.IdempotencyKey = 1, &k2
	e.publish(dup)
	e.publish(waiting)
	e.start(w)
	// The duplicate is acknowledged at once although every retry slot is taken.
	e.waitFor("the duplicate to be acknowledged and the other retry deferred", func() bool {
		n, _ := e.client.XLen(ctx, e.q.Stream(Normal)).Result()
		delayed, _ := e.client.ZScore(ctx, e.q.Delayed(), waiting.TaskID).Result()
		return n == 0 && delayed > 0
	})
	if _, err := e.client.ZScore(ctx, e.q.Delayed(), dup.TaskID).Result(); !errors.Is(err, redis.Nil) {
		t.Fatal("a duplicate waited for a retry slot")
	}
	// The deferred retry did not keep its idempotency claim.
	if n, _ := e.client.Exists(ctx, e.keys.Idempotency("jobs.run", k2)).Result(); n != 0 {
		t.Fatal("the claim of a retry without a slot was kept")
	}
	if runs.Load() != 0 {
		t.Fatal("ran")
	}
}

func TestCancelledTasksAreSkippedBeforeTheirTypeIsChecked(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	w := e.worker(nil)
	unknown := New("nobody.handles", nil)
	e.client.ZAdd(ctx, e.keys.Cancelled(), redis.Z{Score: float64(time.Now().UnixMilli()), Member: unknown.TaskID})
	e.publish(unknown)
	other := New("nobody.handles", nil)
	other.RetryCount = 1
	e.publish(other)
	e.start(w)
	e.waitFor("the other one to be dead-lettered", func() bool { return len(e.dead()) == 1 })
	e.waitFor("the queue to drain", e.drained)
	d := e.dead()[0]
	if d["task_id"] != other.TaskID || d["failure_class"] != ClassUnknownTaskType || d["attempts"] != "2" {
		t.Fatalf("dead-letter entry %v", d)
	}
	if n, _ := e.client.ZCard(ctx, e.keys.Cancelled()).Result(); n != 1 {
		t.Fatal("the cancel mark was removed: the same id published again would run")
	}
	if ok, _ := e.client.SIsMember(ctx, e.keys.DeadQueues(), e.queue).Result(); !ok {
		t.Fatal("the queue is not listed in dead-queues")
	}
}

func TestTransientErrorsTakeTheFastTierThenBackoff(t *testing.T) {
	e := newEnv(t)
	var seen, firsts []string
	var scheduled []bool
	var mu sync.Mutex
	w := e.worker(nil)
	w.Handle("jobs.flaky", func(ctx context.Context, task *Task) error {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, task.Headers[HeaderFastRetries])
		firsts = append(firsts, task.Headers[HeaderFirstFailureAt])
		scheduled = append(scheduled, task.ScheduleTime != nil)
		if len(seen) < 4 {
			return Transient(errors.New("connection reset"))
		}
		return nil
	})
	task := tiered(New("jobs.flaky", nil))
	e.publish(task)
	e.start(w)
	e.waitFor("four attempts", func() bool { mu.Lock(); defer mu.Unlock(); return len(seen) == 4 })
	e.waitFor("the queue to drain", e.drained)
	if strings.Join(seen, ",") != ",1,2,2" {
		t.Fatalf("x-fast-retries per attempt: %q", seen)
	}
	// Fast retries (delay 0) leave schedule_time out; the backoff retry has one.
	if fmt.Sprint(scheduled) != "[false false false true]" {
		t.Fatalf("schedule_time per attempt: %v", scheduled)
	}
	// x-first-failure-at is set on the first failure and kept.
	if firsts[0] != "" || firsts[1] == "" || firsts[2] != firsts[1] || firsts[3] != firsts[1] {
		t.Fatalf("x-first-failure-at per attempt: %q", firsts)
	}
	if _, err := ParseTimestamp(firsts[1]); err != nil {
		t.Fatal(err)
	}
	if len(e.dead()) != 0 {
		t.Fatal("dead-lettered")
	}
}

func TestTimeoutsAndPermanentErrors(t *testing.T) {
	e := newEnv(t)
	w := e.worker(nil)
	w.Handle("jobs.slow", func(ctx context.Context, task *Task) error {
		time.Sleep(5 * time.Second) // ignores its deadline: abandoned
		return nil
	})
	w.Handle("jobs.bad", func(ctx context.Context, task *Task) error {
		return InvalidPayload(errors.New("order_id is missing"))
	})
	w.Handle("jobs.refused", func(ctx context.Context, task *Task) error {
		return Reject(errors.New("not for this tenant"))
	})
	zero, one, timeout := int64(0), int64(1), int64(100)
	slow := New("jobs.slow", nil)
	slow.MaxRetries, slow.TimeoutMS = &zero, &timeout
	slower := tiered(New("jobs.slow", nil)) // one retry: a timeout skips the fast tier
	slower.MaxRetries, slower.TimeoutMS = &one, &timeout
	bad := New("jobs.bad", nil)
	refused := New("jobs.refused", nil)
	old := New("jobs.bad", nil)
	old.PayloadVersion = 2
	for _, task := range []*Envelope{slow, slower, bad, refused, old} {
		e.publish(task)
	}
	started := time.Now()
	e.start(w)
	e.waitFor("five dead-letter entries", func() bool { return len(e.dead()) == 5 })
	if time.Since(started) > 4*time.Second {
		t.Fatal("a timed-out attempt was waited for")
	}
	classes := map[string]string{}
	for _, d := range e.dead() {
		classes[fmt.Sprint(d["task_id"])] = fmt.Sprint(d["failure_class"]) + "/" + fmt.Sprint(d["attempts"])
		if fmt.Sprint(d["task_id"]) == slower.TaskID {
			last, err := DecodeEntry(map[string]string{"v": fmt.Sprint(d["raw.v"]), "enc": fmt.Sprint(d["raw.enc"]),
				"body": fmt.Sprint(d["raw.body"])}, DefaultLimits)
			if err != nil {
				t.Fatal(err)
			}
			if _, fast := last.Headers[HeaderFastRetries]; fast || last.RetryCount != 1 || last.ScheduleTime == nil {
				t.Fatalf("the retry of a timeout took the fast tier: %s", last.JSON())
			}
		}
	}
	want := map[string]string{slow.TaskID: "timeout/1", slower.TaskID: "timeout/2",
		bad.TaskID: "invalid_payload/1", refused.TaskID: "rejected/1",
		old.TaskID: ClassUnsupportedPayloadVersion + "/1"}
	for id, class := range want {
		if classes[id] != class {
			t.Fatalf("classes %v, want %v", classes, want)
		}
	}
}

func TestCancelledAndNotYetDueEntries(t *testing.T) {
	e := newEnv(t)
	var runs atomic.Int32
	w := e.worker(nil)
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error { runs.Add(1); return nil })
	ctx := context.Background()
	cancelled := New("jobs.run", nil)
	if got, err := NewProducer(e.client, e.prefix, e.scripts).Cancel(ctx, cancelled.TaskID); err != nil ||
		got != (CancelResult{Status: CancelMarked}) {
		t.Fatalf("Cancel: %+v %v", got, err)
	}
	e.publish(cancelled)
	later := New("jobs.run", nil)
	at, _ := ParseTimestamp(NewTimestamp(time.Now().Add(time.Hour)).String())
	later.ScheduleTime = &at
	body := string(later.JSON())
	// Added to a stream although not due: the worker moves it to the delayed set.
	e.client.XAdd(ctx, &redis.XAddArgs{Stream: e.q.Stream(High),
		Values: []string{"v", "1", "enc", "json", "body", body}})
	e.start(w)
	e.waitFor("the early entry to be delayed", func() bool {
		stored, _ := e.client.HGet(ctx, e.q.DelayedData(), later.TaskID).Result()
		return stored == "normal\njson\n"+body
	})
	e.waitFor("the cancelled entry to be acknowledged", func() bool {
		n, _ := e.client.XLen(ctx, e.q.Stream(Normal)).Result()
		p, _ := e.client.XPending(ctx, e.q.Stream(Normal), DefaultGroup).Result()
		return n == 0 && p != nil && p.Count == 0
	})
	if due, _ := e.client.ZScore(ctx, e.q.Delayed(), later.TaskID).Result(); int64(due) != at.UnixMilli() {
		t.Fatalf("due %v, want %d", due, at.UnixMilli())
	}
	if member, _ := e.client.SIsMember(ctx, e.keys.Queues(), e.queue).Result(); !member {
		t.Fatal("queue not registered for promotion")
	}
	if _, err := e.client.ZScore(ctx, e.keys.Cancelled(), cancelled.TaskID).Result(); err != nil {
		t.Fatalf("the cancel mark was not kept: %v", err)
	}
	if runs.Load() != 0 {
		t.Fatal("ran a cancelled or early task")
	}
}

func TestMostUrgentBucketFirst(t *testing.T) {
	e := newEnv(t)
	var order []int
	var mu sync.Mutex
	w := e.worker(func(c *Config) { c.Prefetch = 10 })
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error {
		mu.Lock()
		defer mu.Unlock()
		order = append(order, task.Priority)
		return nil
	})
	for _, p := range []int{0, 100, 255, 84, 170} {
		task := New("jobs.run", nil)
		task.Priority = p
		e.publish(task)
	}
	e.start(w)
	e.waitFor("five runs", func() bool { mu.Lock(); defer mu.Unlock(); return len(order) == 5 })
	mu.Lock()
	defer mu.Unlock()
	for i, want := range []int{255, 170, 100, 0, 84} {
		if order[i] != want {
			t.Fatalf("ran in order %v", order)
		}
	}
}

func TestShutdownPutsUnstartedEntriesBackAndDeletesTheLivenessKey(t *testing.T) {
	e := newEnv(t)
	started := make(chan struct{}, 3)
	w := e.worker(func(c *Config) { c.Prefetch = 3 })
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error {
		started <- struct{}{}
		time.Sleep(300 * time.Millisecond)
		return nil
	})
	for i := 0; i < 3; i++ {
		e.publish(New("jobs.run", nil))
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- w.Run(ctx) }()
	<-started
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	bg := context.Background()
	if n, _ := e.client.XLen(bg, e.q.Stream(Normal)).Result(); n != 2 {
		t.Fatalf("%d entries back in the stream, want 2", n)
	}
	if p, _ := e.client.XPending(bg, e.q.Stream(Normal), DefaultGroup).Result(); p.Count != 0 {
		t.Fatalf("%d entries still pending", p.Count)
	}
	if n, _ := e.client.Exists(bg, e.keys.Consumer(w.Consumer())).Result(); n != 0 {
		t.Fatal("liveness key left behind")
	}
}

// An abandoned attempt keeps its claim and its key's mark until it returns: its
// retry, and a second entry of the task (a failover lost an ack) read in the same
// batch by the same consumer, are deferred meanwhile, never run beside it.
func TestAnAbandonedAttemptKeepsItsIdempotencyClaimUntilItReturns(t *testing.T) {
	e := newEnv(t)
	var effects, running atomic.Int32
	w := e.worker(func(c *Config) { c.Concurrency, c.Prefetch = 2, 2 })
	w.Handle("jobs.overrun", func(ctx context.Context, task *Task) error {
		if running.Add(1) > 1 {
			t.Error("two attempts of the task ran at once")
		}
		defer running.Add(-1)
		time.Sleep(1500 * time.Millisecond) // ignores its deadline: abandoned at 100 ms
		effects.Add(1)
		return nil
	})
	one, timeout, key := int64(1), int64(100), "overrun-1"
	task := tiered(New("jobs.overrun", nil)) // the timeout is retried once, 100-400 ms later
	task.MaxRetries, task.TimeoutMS, task.IdempotencyKey = &one, &timeout, &key
	e.publish(task)
	fields, err := EncodeEntry(task, GzipMinBytes, DefaultLimits)
	if err != nil {
		t.Fatal(err)
	}
	e.client.XAdd(context.Background(), &redis.XAddArgs{Stream: e.q.Stream(Normal), Values: fields})
	e.start(w) // one read of Prefetch 2 takes both entries

	idemKey := e.keys.Idempotency("jobs.overrun", key)
	e.waitFor("the abandoned attempt to mark the key done", func() bool {
		v, _ := e.client.Get(context.Background(), idemKey).Result()
		return strings.HasPrefix(v, "done ")
	})
	e.waitFor("the queue to drain", e.drained)
	time.Sleep(300 * time.Millisecond)
	if n := effects.Load(); n != 1 {
		t.Fatalf("%d effects: the retry ran while the abandoned attempt still held the key", n)
	}
	if !strings.Contains(e.logs.String(), "another attempt of this consumer holds the idempotency key; deferred") {
		t.Fatal("the second entry was not deferred by the mark of its key")
	}
	if dead := e.dead(); len(dead) != 0 {
		t.Fatalf("dead-lettered: %v", dead)
	}
}

func TestShutdownKeepsTheConsumerAliveUntilAnAbandonedAttemptReturns(t *testing.T) {
	e := newEnv(t)
	var returned atomic.Bool
	w := e.worker(nil)
	w.Handle("jobs.overrun", func(ctx context.Context, task *Task) error {
		time.Sleep(1200 * time.Millisecond) // ignores its deadline: abandoned at 100 ms
		returned.Store(true)
		return nil
	})
	zero, timeout := int64(0), int64(100)
	task := New("jobs.overrun", nil)
	task.MaxRetries, task.TimeoutMS = &zero, &timeout
	e.publish(task)
	ctx := context.Background()
	stopped := make(chan struct{})
	go func() { _ = w.Run(ctx); close(stopped) }()
	e.waitFor("the attempt to be dead-lettered at its deadline", func() bool { return len(e.dead()) == 1 })

	shutdownCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := w.Shutdown(shutdownCtx); err != nil {
		t.Fatal(err)
	}
	<-stopped
	if !returned.Load() {
		t.Fatal("Run returned while an abandoned handler still ran")
	}
	if n, _ := e.client.Exists(ctx, e.keys.Consumer(w.Consumer())).Result(); n != 0 {
		t.Fatal("the liveness key outlived the worker")
	}
}

// A claim whose holder's liveness key is gone at the first look but back
// within one renewal interval is not taken over (the holder lived through an
// outage); once the key stays gone, the claim is taken over.
func TestADeadClaimHolderIsLookedAtTwice(t *testing.T) {
	e := newEnv(t)
	var runs atomic.Int32
	w := e.worker(func(c *Config) { c.Lease = 1500 * time.Millisecond })
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error { runs.Add(1); return nil })
	ctx := context.Background()
	idemKey := e.keys.Idempotency("jobs.run", "k2")
	e.client.Set(ctx, idemKey, "running other task-0", time.Minute)
	task := New("jobs.run", nil)
	k := "k2"
	task.IdempotencyKey = &k
	e.publish(task)
	e.start(w)

	e.waitFor("the first look", func() bool { return strings.Contains(e.logs.String(), "looking again") })
	e.client.Set(ctx, e.keys.Consumer("other"), "h 1 go", time.Minute) // the holder renews
	e.waitFor("the task to be deferred", func() bool {
		return strings.Contains(e.logs.String(), "another consumer runs this idempotency key; deferred")
	})
	if runs.Load() != 0 || strings.Contains(e.logs.String(), "taking the claim over") {
		t.Fatal("took over the claim of a holder that renewed within the interval")
	}
	if v, _ := e.client.Get(ctx, idemKey).Result(); v != "running other task-0" {
		t.Fatalf("claim %q", v)
	}

	e.client.Del(ctx, e.keys.Consumer("other")) // the holder is gone for good
	e.waitFor("the task to run", func() bool { return runs.Load() == 1 })
	e.waitFor("the queue to drain", e.drained)
}
