package envelope

// Ordering keys (docs/protocol.md section 20) with a real Redis: two workers
// of one queue and a promoter that only looks when woken, so the next task of
// a key starts because the settle step of the previous one woke it.

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// orderLog records in Redis what the handler of "jobs.run" did, one list
// entry "<what> <task_id>" each: start, end (success) or fail.
type orderLog struct {
	e *env
}

func (l orderLog) key() string { return l.e.prefix + ":test-log" }

func (l orderLog) add(what, taskID string) {
	if err := l.e.client.RPush(context.Background(), l.key(), what+" "+taskID).Err(); err != nil {
		l.e.t.Error(err)
	}
}

// all is the log, oldest first.
func (l orderLog) all() []string {
	return l.e.client.LRange(context.Background(), l.key(), 0, -1).Val()
}

// of is the log of the tasks whose id starts with idPrefix.
func (l orderLog) of(idPrefix string) string {
	var out []string
	for _, line := range l.all() {
		if _, id, _ := strings.Cut(line, " "); strings.HasPrefix(id, idPrefix) {
			out = append(out, line)
		}
	}
	return strings.Join(out, ", ")
}

// has reports whether line was logged.
func (l orderLog) has(line string) bool { return slices.Contains(l.all(), line) }

// startOrdered registers run for "jobs.run" on two workers of the queue and
// runs them, with a promoter that waits a minute unless woken, until the test ends.
func (e *env) startOrdered(run HandlerFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range 2 {
		w := e.worker(nil)
		w.Handle("jobs.run", run)
		wg.Go(func() { _ = w.Run(ctx) })
	}
	p := &Promoter{Client: e.client, Keys: e.keys, Scripts: e.scripts, MaxIdle: time.Minute,
		Log: slog.New(slog.NewJSONHandler(e.logs, nil))}
	wg.Go(func() { p.Run(ctx) })
	e.t.Cleanup(func() { cancel(); wg.Wait() })
}

// publishKeyed publishes a task of "jobs.run" with task_id id and ordering_key key.
func (e *env) publishKeyed(id, key string, opts ...PublishOption) string {
	e.t.Helper()
	opts = append([]PublishOption{WithTaskID(id), WithOrderingKey(key)}, opts...)
	task, err := NewTask(context.Background(), "jobs.run", nil, opts...)
	if err != nil {
		e.t.Fatal(err)
	}
	entryID, err := NewProducer(e.client, e.prefix, e.scripts).Publish(context.Background(), e.queue, task)
	if err != nil {
		e.t.Fatal(err)
	}
	return entryID
}

func TestTasksOfOneKeyRunOneAtATimeInOrderAndOtherKeysInParallel(t *testing.T) {
	e := newEnv(t)
	log := orderLog{e}
	for i := range 3 {
		for _, key := range []string{"a", "b"} {
			e.publishKeyed(key+string(rune('1'+i)), "order:"+key)
		}
	}
	e.startOrdered(func(ctx context.Context, task *Task) error {
		log.add("start", task.TaskID)
		time.Sleep(100 * time.Millisecond)
		// a1 ends once b1 started (or 3 s later): only a key of its own lets b1 start meanwhile.
		for deadline := time.Now().Add(3 * time.Second); task.TaskID == "a1" && !log.has("start b1") &&
			time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		log.add("end", task.TaskID)
		return nil
	})
	e.waitFor("every task to end", func() bool { return log.has("end a3") && log.has("end b3") })
	for _, key := range []string{"a", "b"} {
		want := strings.ReplaceAll("start k1, end k1, start k2, end k2, start k3, end k3", "k", key)
		if got := log.of(key); got != want {
			t.Fatalf("key %s ran %s, want %s", key, got, want)
		}
	}
	// The other key ran while this one did: at some point a task of each key was running.
	running, parallel := map[string]bool{}, false
	for _, line := range log.all() {
		what, id, _ := strings.Cut(line, " ")
		running[id[:1]] = what == "start"
		parallel = parallel || running["a"] && running["b"]
	}
	if !parallel {
		t.Fatalf("the two keys did not run in parallel: %v", log.all())
	}
	e.waitFor("the keys' lists to be gone", func() bool {
		return e.client.Exists(context.Background(), e.q.Order("order:a"), e.q.Order("order:b"),
			e.q.OrderWaiting("order:a"), e.q.OrderWaiting("order:b")).Val() == 0
	})
}

func TestARetriedKeyedTaskKeepsItsPlace(t *testing.T) {
	e := newEnv(t)
	log := orderLog{e}
	e.publishKeyed("r1", "k", WithTieredRetries())
	e.publishKeyed("r2", "k")
	var failed sync.Once
	e.startOrdered(func(ctx context.Context, task *Task) error {
		log.add("start", task.TaskID)
		var err error
		if task.TaskID == "r1" {
			failed.Do(func() { err = errors.New("flaky") }) // retried through the delayed set
		}
		if err != nil {
			log.add("fail", task.TaskID)
			return err
		}
		log.add("end", task.TaskID)
		return nil
	})
	e.waitFor("r2 to end", func() bool { return log.has("end r2") })
	if got, want := log.of("r"), "start r1, fail r1, start r1, end r1, start r2, end r2"; got != want {
		t.Fatalf("ran %s, want %s", got, want)
	}
}

func TestADeadLetteredHeadMovesItsKeyOnOrHaltsIt(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	log := orderLog{e}
	var rejected sync.Map // the first attempt of a task whose id ends in 1 is rejected
	e.startOrdered(func(ctx context.Context, task *Task) error {
		log.add("start", task.TaskID)
		if _, again := rejected.LoadOrStore(task.TaskID, true); !again && strings.HasSuffix(task.TaskID, "1") {
			log.add("fail", task.TaskID)
			return Reject(errors.New("refused"))
		}
		log.add("end", task.TaskID)
		return nil
	})

	e.publishKeyed("m1", "moves")
	e.publishKeyed("m2", "moves")
	e.waitFor("m2 to end", func() bool { return log.has("end m2") })
	if got, want := log.of("m"), "start m1, fail m1, start m2, end m2"; got != want {
		t.Fatalf("ran %s, want %s", got, want)
	}

	e.client.HSet(ctx, e.q.OrderPolicy(), "jobs.run", "halt")
	e.publishKeyed("h1", "halts")
	e.publishKeyed("h2", "halts")
	e.waitFor("h1 to be dead-lettered", func() bool { return len(e.dead()) == 2 })
	time.Sleep(500 * time.Millisecond)
	if got, want := log.of("h"), "start h1, fail h1"; got != want {
		t.Fatalf("ran %s under the halt policy, want %s", got, want)
	}
	if halted := e.client.HGet(ctx, e.q.OrderHalted(), "halts").Val(); halted != "h1" {
		t.Fatalf("order-halted holds %q for the key, want the head h1", halted)
	}
	// Replaying the head clears the halt: it runs again as the head, then h2.
	dead := NewDeadLetters(e.client, e.prefix, e.scripts)
	entries, err := dead.List(ctx, e.queue, "", 0)
	if err != nil || len(entries) != 2 || entries[1].Envelope.TaskID != "h1" {
		t.Fatalf("dead letters %v %v", entries, err)
	}
	e.client.Del(ctx, e.keys.Queues()) // a lost registry: the keyed replay lists it again
	if _, err := dead.Replay(ctx, e.queue, entries[1].ID, ReplayOptions{}); err != nil {
		t.Fatal(err)
	}
	if ok, _ := e.client.SIsMember(ctx, e.keys.Queues(), e.queue).Result(); !ok {
		t.Fatalf("the keyed replay did not register %s in %s", e.queue, e.keys.Queues())
	}
	e.waitFor("h2 to end", func() bool { return log.has("end h2") })
	if got, want := log.of("h"), "start h1, fail h1, start h1, end h1, start h2, end h2"; got != want {
		t.Fatalf("ran %s, want %s", got, want)
	}
}

func TestADelayedKeyedTaskJoinsTheOrderWhenDue(t *testing.T) {
	e := newEnv(t)
	log := orderLog{e}
	if id := e.publishKeyed("d3", "k", WithDelay(200*time.Millisecond)); id != "" {
		t.Fatalf("a delayed publish answered %q", id)
	}
	e.publishKeyed("d1", "k")
	if id := e.publishKeyed("d2", "k"); id != Waiting {
		t.Fatalf("the second task of a key answered %q, want %q", id, Waiting)
	}
	e.startOrdered(func(ctx context.Context, task *Task) error {
		log.add("start", task.TaskID)
		time.Sleep(300 * time.Millisecond) // d3 is due while d1 runs
		log.add("end", task.TaskID)
		return nil
	})
	e.waitFor("d3 to end", func() bool { return log.has("end d3") })
	if got, want := log.of("d"), "start d1, end d1, start d2, end d2, start d3, end d3"; got != want {
		t.Fatalf("ran %s, want %s", got, want)
	}
}

func TestTasksAcknowledgedWithoutRunningMoveTheirKeyOn(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	log := orderLog{e}
	e.publishKeyed("u0", "k", WithIdempotencyKey("once"))
	e.publishKeyed("u1", "k", WithExpires(time.Now().Add(-time.Minute)))
	e.publishKeyed("u2", "k")
	if _, err := NewProducer(e.client, e.prefix, e.scripts).Cancel(ctx, "u2"); err != nil {
		t.Fatal(err)
	}
	e.publishKeyed("u3", "k", WithIdempotencyKey("once")) // a duplicate of u0
	e.publishKeyed("u4", "k")
	e.startOrdered(func(ctx context.Context, task *Task) error {
		log.add("start", task.TaskID)
		log.add("end", task.TaskID)
		return nil
	})
	e.waitFor("u4 to end", func() bool { return log.has("end u4") })
	if got, want := log.of("u"), "start u0, end u0, start u4, end u4"; got != want {
		t.Fatalf("ran %s, want %s", got, want)
	}
}

func TestABigKeyedTaskIsWrittenAsPlainJSONAndRegistersItsQueue(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	big := []byte(`{"blob":"` + strings.Repeat("x", 2*GzipMinBytes) + `"}`)
	task, err := NewTask(ctx, "jobs.run", big, WithOrderingKey("k"))
	if err != nil {
		t.Fatal(err)
	}
	p := NewProducer(e.client, e.prefix, e.scripts)
	for range 2 { // the registry is rebuilt by the next keyed publish
		e.client.Del(ctx, e.keys.Queues())
		id, err := p.Publish(ctx, e.queue, task.Clone())
		if err != nil || id == "" {
			t.Fatalf("publish: %q %v", id, err)
		}
		if ok, _ := e.client.SIsMember(ctx, e.keys.Queues(), e.queue).Result(); !ok {
			t.Fatal("a keyed publish did not register its queue in <prefix>:queues: no promoter would release its key")
		}
		task.TaskID = NewTaskID()
	}
	msgs := e.client.XRange(ctx, e.q.Stream(Normal), "-", "+").Val()
	if len(msgs) != 1 {
		t.Fatalf("%d stream entries, want the head only", len(msgs))
	}
	if enc := msgs[0].Values[FieldEncoding]; enc != EncJSON {
		t.Fatalf("a %d-byte keyed body is written enc %v, want json", len(task.JSON()), enc)
	}
	waiting := e.client.HVals(ctx, e.q.OrderWaiting("k")).Val()
	if len(waiting) != 1 || !strings.HasPrefix(waiting[0], "normal\njson\n{") {
		t.Fatalf("the second task does not wait as plain JSON: %d stored", len(waiting))
	}
	if order := e.client.LLen(ctx, e.q.Order("k")).Val(); order != 2 {
		t.Fatalf("the key's order holds %d tasks, want 2", order)
	}
}

func TestAKeyedEntryNotDueYetKeepsItsPlaceInTheDelayedSet(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	log := orderLog{e}
	// The head, in its stream ahead of its schedule_time (its publisher's clock is behind).
	early := New("jobs.run", nil)
	key, later := "k", NewTimestamp(time.Now().Add(300*time.Millisecond).UTC())
	early.TaskID, early.OrderingKey, early.ScheduleTime = "s1", &key, &later
	e.client.RPush(ctx, e.q.Order(key), early.TaskID)
	e.client.XAdd(ctx, &redis.XAddArgs{Stream: e.q.Stream(Normal),
		Values: []string{"v", "1", "enc", "json", "body", string(early.JSON())}})
	if id := e.publishKeyed("s2", key); id != Waiting {
		t.Fatalf("the task behind the head answered %q, want %q", id, Waiting)
	}
	e.startOrdered(func(ctx context.Context, task *Task) error {
		log.add("start", task.TaskID)
		log.add("end", task.TaskID)
		return nil
	})
	e.waitFor("s2 to end", func() bool { return log.has("end s2") })
	if got, want := log.of("s"), "start s1, end s1, start s2, end s2"; got != want {
		t.Fatalf("ran %s, want %s: moving the head to the delayed set gave its key's turn away", got, want)
	}
}
