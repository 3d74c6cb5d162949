package envelope

// Worker statistics (docs/protocol.md section 17) against a real Redis.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestHistogramBucketsAndSums(t *testing.T) {
	s := &Stats{Keys: KeySpace{"p"}}
	for _, d := range []time.Duration{-time.Second, 5 * time.Millisecond, 5*time.Millisecond + 1,
		2500 * time.Millisecond, time.Hour, time.Hour + time.Microsecond, 1499} {
		s.Observe("jobs", "t", HistogramRun, d)
	}
	want := map[string]int64{
		"t go run_le_0.005": 3, // -1 s counts as 0; 1499 ns too
		"t go run_le_0.01":  1,
		"t go run_le_2.5":   1,
		"t go run_le_3600":  1,
		"t go run_le_inf":   1,
		// 0 + 5000 + 5000 (rounded) + 2500000 + 3600e6 + 3600e6+1 + 1 (1.499 µs rounds to 1)
		"t go run_sum_us": 0 + 5000 + 5000 + 2_500_000 + 3_600_000_000 + 3_600_000_001 + 1,
	}
	got := s.Pending("jobs")
	if len(got) != len(want) {
		t.Fatalf("fields %v, want %v", got, want)
	}
	for f, n := range want {
		if got[f] != n {
			t.Fatalf("%s = %d, want %d (all: %v)", f, got[f], n, got)
		}
	}
	if statsFieldsPerType != 41 {
		t.Fatalf("a task type has %d fields, section 17 says 41", statsFieldsPerType)
	}
}

func TestStatsBufferIsBounded(t *testing.T) {
	s := &Stats{Keys: KeySpace{"p"}}
	for i := range maxStatsFields/5 + 1 {
		for _, name := range []string{StatSucceeded, StatFailed, StatRetried, StatDead, StatDuplicate} {
			s.Count("jobs", fmt.Sprintf("t%d", i), name)
		}
	}
	if n := len(s.Pending("jobs")); n != maxStatsFields {
		t.Fatalf("%d fields held, cap %d", n, maxStatsFields)
	}
	s.Count("jobs", "t0", StatSucceeded) // a field held still counts
	if s.Pending("jobs")[StatsField("t0", StatSucceeded)] != 2 {
		t.Fatal("a held field stopped counting at the cap")
	}
}

// A failed write keeps its increments, which the next write adds.
func TestAFailedStatsWriteIsKeptForTheNext(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	s := &Stats{Keys: e.keys}
	s.Count(e.queue, "jobs.run", StatSucceeded)
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	away := redis.NewClient(&redis.Options{Addr: "127.0.0.1:" + strconv.Itoa(port), MaxRetries: -1,
		DialTimeout: 200 * time.Millisecond})
	defer away.Close()
	if err := s.Flush(ctx, away); err == nil {
		t.Fatal("a write to no Redis succeeded")
	}
	s.Count(e.queue, "jobs.run", StatSucceeded)
	if err := s.Flush(ctx, e.client); err != nil {
		t.Fatal(err)
	}
	if got := e.client.HGetAll(ctx, e.q.Stats()).Val(); len(got) != 1 || got["jobs.run go succeeded"] != "2" {
		t.Fatalf("stats %v", got)
	}
	if len(s.Pending(e.queue)) != 0 {
		t.Fatal("written increments are still held")
	}
}

func TestWorkerStatisticsOfAKnownWorkload(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	w := e.worker(nil)
	w.Handle("jobs.ok", func(ctx context.Context, task *Task) error { return nil })
	var flaked atomic.Bool
	w.Handle("jobs.flaky", func(ctx context.Context, task *Task) error {
		if !flaked.Swap(true) {
			return Transient(errors.New("connection reset"))
		}
		return nil
	})
	w.Handle("jobs.bad", func(ctx context.Context, task *Task) error { return Reject(errors.New("not ours")) })
	w.Handle("jobs.once", func(ctx context.Context, task *Task) error { return nil })
	e.publish(New("jobs.ok", nil))
	e.publish(New("jobs.ok", nil))
	e.publish(tiered(New("jobs.flaky", nil)))
	e.publish(New("jobs.bad", nil))
	for range 2 { // the second one finds the key done
		once := New("jobs.once", nil)
		key := "order-1"
		once.IdempotencyKey = &key
		e.publish(once)
	}
	e.client.XAdd(ctx, &redis.XAddArgs{Stream: e.q.Stream(Normal), Values: []any{"v", "1", "body", "{"}})

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }()
	e.waitFor("two dead letters", func() bool { return len(e.dead()) == 2 })
	e.waitFor("the queue to drain", e.drained)
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	got := e.client.HGetAll(ctx, e.q.Stats()).Val()
	counters := map[string]string{}
	ran := map[string]int64{} // task type -> attempts per histogram bucket total
	for field, value := range got {
		parts := strings.Split(field, " ")
		if len(parts) != 3 || parts[1] != Language {
			t.Fatalf("field %q", field)
		}
		name := parts[2]
		switch {
		case strings.HasPrefix(name, "run_le_"), strings.HasPrefix(name, "wait_le_"):
			le := name[strings.LastIndex(name, "_")+1:]
			if !validBound(le) {
				t.Fatalf("bucket %q", field)
			}
			n, _ := strconv.ParseInt(value, 10, 64)
			ran[parts[0]+" "+name[:strings.Index(name, "_")]] += n
		case name == "run_sum_us", name == "wait_sum_us":
			if n, err := strconv.ParseInt(value, 10, 64); err != nil || n < 0 {
				t.Fatalf("%s = %q", field, value)
			}
		default:
			counters[field] = value
		}
	}
	wantCounters := map[string]string{
		"jobs.ok go succeeded": "2", "jobs.flaky go failed": "1", "jobs.flaky go retried": "1",
		"jobs.flaky go succeeded": "1", "jobs.bad go failed": "1", "jobs.bad go dead": "1",
		"jobs.once go succeeded": "1", "jobs.once go duplicate": "1", "- go dead": "1",
	}
	if !maps.Equal(counters, wantCounters) {
		t.Fatalf("counters %v, want %v", counters, wantCounters)
	}
	wantRan := map[string]int64{"jobs.ok run": 2, "jobs.ok wait": 2, "jobs.flaky run": 2, "jobs.flaky wait": 2,
		"jobs.bad run": 1, "jobs.bad wait": 1, "jobs.once run": 1, "jobs.once wait": 1}
	if len(ran) != len(wantRan) {
		t.Fatalf("observations %v, want %v", ran, wantRan)
	}
	for k, n := range wantRan {
		if ran[k] != n {
			t.Fatalf("observations %v, want %v", ran, wantRan)
		}
		if _, ok := got[strings.Replace(k, " ", " go ", 1)+"_sum_us"]; !ok {
			t.Fatalf("no sum for %s in %v", k, got)
		}
	}
	if ttl := e.client.PTTL(ctx, e.q.Stats()).Val(); ttl < StatsKeep-time.Hour {
		t.Fatalf("stats kept %v", ttl)
	}
}

// With no renewal before it stops, the worker writes its counts when it stops.
func TestAStoppingWorkerWritesItsStatistics(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	w := e.worker(func(c *Config) { c.Lease = time.Minute })
	w.Handle("jobs.ok", func(ctx context.Context, task *Task) error { return nil })
	e.publish(New("jobs.ok", nil))
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }()
	e.waitFor("the queue to drain", e.drained)
	if n := e.client.Exists(ctx, e.q.Stats()).Val(); n != 0 {
		t.Fatal("written before any renewal")
	}
	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if v := e.client.HGet(ctx, e.q.Stats(), "jobs.ok go succeeded").Val(); v != "1" {
		t.Fatalf("succeeded = %q", v)
	}
}

func validBound(le string) bool {
	if le == "inf" {
		return true
	}
	for _, b := range statsBuckets {
		if b.name == le {
			return true
		}
	}
	return false
}
