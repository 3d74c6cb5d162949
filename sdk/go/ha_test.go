package envelope

// High availability against real topologies (topology_test.go): producer ->
// worker round trips behind Sentinel and on a Cluster with queues on several
// shards, and failover drills that SIGKILL a primary while a worker runs and
// a producer publishes. The handler records its effect in a separate Redis,
// the ledger, so the counts survive whatever the topology loses.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// Task types of the workers of these tests: ha.effect counts its effect in
// the ledger; ha.flaky fails its first attempt, then does the same.
const (
	effectTask = "ha.effect"
	flakyTask  = "ha.flaky"
)

type haEnv struct {
	t       *testing.T
	client  redis.UniversalClient
	ledger  *redis.Client
	scripts Scripts
	prefix  string
	keys    KeySpace
	logs    *lockedBuffer
}

func newHAEnv(t *testing.T, url string) *haEnv {
	client, err := NewUniversalClient(url)
	if err != nil {
		t.Fatal(err)
	}
	prefix := "ha-" + NewTraceID()[:8]
	h := &haEnv{t: t, client: client, ledger: nodeClient(t, startNode(t, "")), scripts: DefaultScripts(),
		prefix: prefix, keys: KeySpace{prefix}, logs: &lockedBuffer{}}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("log:\n%s", tail(h.logs.String(), 200))
		}
		client.Close()
	})
	return h
}

func tail(s string, lines int) string {
	all := strings.Split(s, "\n")
	return strings.Join(all[max(0, len(all)-lines):], "\n")
}

func (h *haEnv) logger() *slog.Logger { return slog.New(slog.NewJSONHandler(h.logs, nil)) }

func (h *haEnv) producer(d Durability) *Producer {
	p := NewProducer(h.client, h.prefix, h.scripts)
	p.Durability, p.Log = d, h.logger()
	return p
}

// runWorkers runs one worker consuming queues, whose handler counts effects
// in the ledger, and a promoter. stop ends them and reports how many had
// returned on their own before (a worker or promoter that gave up).
func (h *haEnv) runWorkers(queues []string, d Durability) (stop func() int) {
	ctx, cancel := context.WithCancel(context.Background())
	var exited atomic.Int32
	var wg sync.WaitGroup
	w, err := NewWorker(h.client, h.scripts, Config{Prefix: h.prefix, Queues: queues, Durability: d,
		Block: 200 * time.Millisecond, DeferDelay: 300 * time.Millisecond, Logger: h.logger(),
		Retry: RetryPolicy{Backoff: 100 * time.Millisecond, MaxBackoff: 200 * time.Millisecond}})
	if err != nil {
		h.t.Fatal(err)
	}
	effect := func(ctx context.Context, t *Task) error {
		return h.ledger.Incr(ctx, "effect:"+t.TaskID).Err()
	}
	w.Handle(effectTask, effect)
	w.Handle(flakyTask, func(ctx context.Context, t *Task) error {
		if t.RetryCount == 0 {
			return errors.New("the first attempt fails")
		}
		return effect(ctx, t)
	})
	wg.Go(func() {
		if err := w.Run(ctx); err != nil || ctx.Err() == nil {
			h.t.Errorf("worker of %v returned before it was stopped: %v", queues, err)
			exited.Add(1)
		}
	})
	p := &Promoter{Client: h.client, Keys: h.keys, Scripts: h.scripts, MaxIdle: 200 * time.Millisecond,
		Log: h.logger()}
	wg.Go(func() {
		p.Run(ctx)
		if ctx.Err() == nil {
			exited.Add(1)
		}
	})
	return func() int {
		n := int(exited.Load())
		cancel()
		wg.Wait()
		return n
	}
}

// effects are the ledger's effect counts of ids.
func (h *haEnv) effects(ids []string) []int {
	out := make([]int, len(ids))
	for start := 0; start < len(ids); start += 500 {
		end := min(start+500, len(ids))
		keys := make([]string, 0, end-start)
		for _, id := range ids[start:end] {
			keys = append(keys, "effect:"+id)
		}
		vals, err := h.ledger.MGet(context.Background(), keys...).Result()
		if err != nil {
			h.t.Fatal(err)
		}
		for i, v := range vals {
			if v != nil {
				_, _ = fmt.Sscan(v.(string), &out[start+i])
			}
		}
	}
	return out
}

// publish publishes one effect task with an idempotency key, delayed by delay.
func (h *haEnv) publish(ctx context.Context, p *Producer, queue, id string, delay time.Duration) error {
	opts := []PublishOption{WithTaskID(id), WithIdempotencyKey(id)}
	if delay > 0 {
		opts = append(opts, WithDelay(delay))
	}
	_, err := p.PublishTask(ctx, queue, effectTask, map[string]string{"id": id}, opts...)
	return err
}

// roundTrip publishes an immediate and a delayed task on queue and waits
// for both effects.
func (h *haEnv) roundTrip(queue string) {
	p := h.producer(Durability{})
	ids := []string{queue + "-now-" + NewTraceID()[:6], queue + "-later-" + NewTraceID()[:6]}
	for i, id := range ids {
		if err := h.publish(context.Background(), p, queue, id, time.Duration(i)*300*time.Millisecond); err != nil {
			h.t.Fatal(err)
		}
	}
	eventually(h.t, 10*time.Second, "the round trips on "+queue, func() bool {
		got := h.effects(ids)
		return got[0] == 1 && got[1] == 1
	})
}

// drill publishes effect tasks (every third delayed) on queues from one
// goroutine per queue while workers run, SIGKILLs a primary with kill after a
// second, keeps publishing until recovered reports the failover done and a
// second more, then waits for the effects. It fails on a worker or promoter
// that stopped; it reports the tasks lost (publish succeeded, no effect) and
// those with their effect twice, and with d.Replicas > 0 (every replica of the
// killed primary) requires none of either.
func (h *haEnv) drill(name string, queues []string, d Durability, kill func(), recovered func() bool) {
	t := h.t
	stop := h.runWorkers(queues, d)
	p := h.producer(d)
	var stopPublishing atomic.Bool
	var mu sync.Mutex
	var published []string
	var failed atomic.Int32
	var publishers sync.WaitGroup
	for _, queue := range queues {
		publishers.Go(func() {
			for i := 0; !stopPublishing.Load(); i++ {
				id := fmt.Sprintf("%s-%s-%d", name, queue, i)
				delay := time.Duration(0)
				if i%3 == 0 {
					delay = 300 * time.Millisecond
				}
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				err := h.publish(ctx, p, queue, id, delay)
				cancel()
				if err != nil {
					failed.Add(1)
				} else {
					mu.Lock()
					published = append(published, id)
					mu.Unlock()
				}
				time.Sleep(5 * time.Millisecond)
			}
		})
	}
	time.Sleep(time.Second)
	killedAt := time.Now()
	kill()
	eventually(t, 30*time.Second, "the failover", recovered)
	failoverTook := time.Since(killedAt)
	time.Sleep(time.Second)
	stopPublishing.Store(true)
	publishers.Wait()

	// Wait for the effects while they still come in.
	done, last, lastChange := 0, -1, time.Now()
	for done < len(published) && time.Since(lastChange) < 3*time.Second {
		done = 0
		for _, n := range h.effects(published) {
			if n > 0 {
				done++
			}
		}
		if done != last {
			last, lastChange = done, time.Now()
		}
		time.Sleep(100 * time.Millisecond)
	}

	exited := stop()
	var lost []string
	twice := 0
	for i, n := range h.effects(published) {
		switch {
		case n == 0:
			lost = append(lost, published[i])
		case n > 1:
			twice++
		}
	}
	outages := strings.Count(h.logs.String(), "failed; retrying")
	t.Logf("drill %s (wait_replicas %d): failover took %s; published %d, publishes failed %d, "+
		"lost %d, effect twice %d, steps retried %d", name, d.Replicas, failoverTook.Round(time.Millisecond),
		len(published), failed.Load(), len(lost), twice, outages)
	if len(lost) > 0 {
		t.Logf("drill %s: lost %v", name, lost[:min(len(lost), 20)])
	}
	if exited > 0 {
		t.Errorf("%d workers or promoters stopped during the failover", exited)
	}
	// Without WAIT the old primary may die with writes no replica has: a publish
	// (lost), or an ack with its done marker (the task runs again). Counted above.
	if d.Replicas > 0 && twice > 0 {
		t.Errorf("with wait_replicas %d, %d tasks had their effect more than once", d.Replicas, twice)
	}
	if d.Replicas > 0 && len(lost) > 0 {
		t.Errorf("with wait_replicas %d, %d tasks whose publish succeeded were lost", d.Replicas, len(lost))
	}
	if len(published) < 20 {
		t.Errorf("only %d tasks published: the drill exercised nothing", len(published))
	}
}

func TestSentinelRoundTripsAndFailover(t *testing.T) {
	g := startSentinelGroup(t)
	h := newHAEnv(t, g.url())
	stop := h.runWorkers([]string{"ha"}, Durability{})
	h.roundTrip("ha")
	if n := stop(); n > 0 {
		t.Fatalf("%d workers stopped", n)
	}

	g.settled(t)
	kill, failedOver, sameSince := g.killPrimary(t)
	// Both replicas: the sentinels promote the one whose offset they last saw
	// highest, which may be a second old. The new primary has one replica, so
	// every WAIT after the failover takes its whole timeout: keep it short.
	h.drill("sentinel-wait", []string{"ha"}, Durability{Replicas: 2, Timeout: 100 * time.Millisecond}, kill,
		failedOver)
	sameSince()
	g.settled(t)
	kill, failedOver, sameSince = g.killPrimary(t)
	h.drill("sentinel", []string{"ha"}, Durability{}, kill, failedOver)
	sameSince()
}

func TestClusterShardsRoundTripsDeadLetterCancelAndFailover(t *testing.T) {
	c := startCluster(t)
	h := newHAEnv(t, c.url())
	ctx := context.Background()

	// Three queues whose slots are on three different primaries; one Worker
	// consumes two of them at a time.
	var queues []string
	owners := map[*redisServer]bool{}
	for i := 0; len(queues) < 3; i++ {
		q := fmt.Sprintf("q%d", i)
		owner := c.primaryOf(h.keys.Queue(q).Stream(Normal))
		if owner == nil {
			t.Fatalf("no primary serves queue %s", q)
		}
		if !owners[owner] {
			owners[owner] = true
			queues = append(queues, q)
		}
	}

	stop := h.runWorkers(queues[:2], Durability{})
	h.roundTrip(queues[0])
	h.roundTrip(queues[1])

	p := h.producer(Durability{})
	if _, err := p.PublishTask(ctx, queues[1], "ha.nobody", nil); err != nil {
		t.Fatal(err)
	}
	dl := NewDeadLetters(h.client, h.prefix, h.scripts)
	eventually(t, 10*time.Second, "the dead letter", func() bool {
		entries, err := dl.List(ctx, queues[1], "", 10)
		return err == nil && len(entries) == 1 && entries[0].FailureClass() == ClassUnknownTaskType
	})
	if listed, err := dl.Queues(ctx); err != nil || len(listed) != 1 || listed[0] != queues[1] {
		t.Fatalf("dead-queues registry: %v %v", listed, err)
	}

	// A retry on the backoff tier (SADD <prefix>:queues, then retry.lua) and an
	// entry that is not due yet (SADD, then schedule.lua and the ack in one MULTI).
	flaky, err := p.PublishTask(ctx, queues[0], flakyTask, nil, WithTieredRetries())
	if err != nil {
		t.Fatal(err)
	}
	early, err := NewTask(ctx, effectTask, nil, WithDelay(300*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	fields, err := EncodeEntry(early, GzipMinBytes, DefaultLimits)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.client.XAdd(ctx, &redis.XAddArgs{Stream: h.keys.Queue(queues[1]).Stream(Normal),
		Values: fields}).Err(); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "the retried and the rescheduled task", func() bool {
		got := h.effects([]string{flaky.TaskID, early.TaskID})
		return got[0] == 1 && got[1] == 1
	})
	if out := h.logs.String(); !strings.Contains(out, "moved to the delayed set") ||
		!strings.Contains(out, "task failed; retrying") || strings.Contains(out, "CROSSSLOT") {
		t.Fatalf("expected a reschedule and a retry, no CROSSSLOT:\n%s", tail(out, 50))
	}

	later := "cancel-me-" + NewTraceID()[:6]
	if err := h.publish(ctx, p, queues[0], later, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if res, err := p.Cancel(ctx, later); err != nil || res != (CancelResult{CancelRemoved, queues[0]}) {
		t.Fatalf("cancel: %+v %v", res, err)
	}
	if n := stop(); n > 0 {
		t.Fatalf("%d workers stopped", n)
	}
	// The statistics of each queue are written in its slot (one MULTI per queue).
	if v := h.client.HGet(ctx, h.keys.Queue(queues[1]).Stats(), StatsField("ha.nobody", StatDead)).Val(); v != "1" {
		t.Fatalf("dead letters of ha.nobody counted: %q", v)
	}
	if v := h.client.HGet(ctx, h.keys.Queue(queues[0]).Stats(), StatsField(flakyTask, StatRetried)).Val(); v == "" || v == "0" {
		t.Fatalf("retries of %s counted: %q", flakyTask, v)
	}

	failoverOf := func(key string) (func(), func() bool) {
		old := c.primaryOf(key)
		return old.kill, func() bool {
			now := c.primaryOf(key)
			return c.healthy() && now != nil && now != old
		}
	}
	kill, recovered := failoverOf(h.keys.Queue(queues[0]).Stream(Normal))
	h.drill("cluster-wait", queues[:2], Durability{Replicas: 1, Timeout: 100 * time.Millisecond}, kill, recovered)
	kill, recovered = failoverOf(h.keys.Queue(queues[2]).Stream(Normal))
	h.drill("cluster", queues[1:], Durability{}, kill, recovered)
	if got := h.effects([]string{later}); got[0] != 0 {
		t.Fatalf("the cancelled task ran")
	}
}

func TestAnUnblockedWaitIsReArmed(t *testing.T) {
	e := newEnv(t)
	var ran atomic.Int32
	w := e.worker(func(c *Config) { c.Block = 2 * time.Second })
	w.Handle("t", func(context.Context, *Task) error { ran.Add(1); return nil })
	e.start(w)
	ctx := context.Background()
	var blocked string
	e.waitFor("the worker's blocking wait", func() bool {
		clients, _ := e.client.ClientList(ctx).Result()
		for _, line := range strings.Split(clients, "\n") {
			if strings.Contains(line, "cmd=xread ") && strings.Contains(line, "flags=b") {
				id, _, _ := strings.Cut(strings.TrimPrefix(line, "id="), " ")
				blocked = id
				return true
			}
		}
		return false
	})
	if err := e.client.Do(ctx, "CLIENT", "UNBLOCK", blocked, "ERROR").Err(); err != nil {
		t.Fatal(err)
	}
	e.waitFor("the wait armed again", func() bool {
		clients, _ := e.client.ClientList(ctx).Result()
		return strings.Contains(clients, "cmd=xread ")
	})
	e.publish(New("t", nil))
	e.waitFor("the task", func() bool { return ran.Load() == 1 })
	if strings.Contains(e.logs.String(), "read failed") {
		t.Fatalf("UNBLOCKED was logged as a failed read:\n%s", e.logs.String())
	}
}

func TestWaitingForMoreReplicasThanAnswerIsLoggedAndTheWritesStand(t *testing.T) {
	e := newEnv(t)
	d := Durability{Replicas: 1, Timeout: 20 * time.Millisecond}
	var ran atomic.Int32
	w := e.worker(func(c *Config) { c.Durability = d })
	w.Handle("t", func(context.Context, *Task) error { ran.Add(1); return nil })
	e.start(w)
	p := NewProducer(e.client, e.prefix, e.scripts)
	p.Durability, p.Log = d, slog.New(slog.NewJSONHandler(e.logs, nil))
	if _, err := p.PublishTask(context.Background(), e.queue, "t", nil, WithIdempotencyKey("k")); err != nil {
		t.Fatal(err)
	}
	// "task succeeded" is logged once the ack and its WAIT are done.
	e.waitFor("the task acknowledged", func() bool {
		return ran.Load() == 1 && e.drained() && strings.Contains(e.logs.String(), `"msg":"task succeeded"`)
	})
	if n := strings.Count(e.logs.String(), "fewer replicas than asked"); n < 4 {
		t.Fatalf("want the publish, the idempotency claim, its done marker and the ack logged as short of "+
			"replicas, got %d lines:\n%s", n, e.logs.String())
	}
	idem := fmt.Sprintf(`"key":%q`, e.keys.Idempotency("t", "k"))
	if n := strings.Count(e.logs.String(), idem); n != 2 {
		t.Fatalf("want the claim and the done marker of %s waited for, got %d lines:\n%s", idem, n, e.logs.String())
	}
}
