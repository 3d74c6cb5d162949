package envelope

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestConcurrencyRunsTasksAtOnceAndShutdownHandsPrefetchedEntriesBack(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	release := make(chan struct{})
	var mu sync.Mutex
	consumers := map[string]bool{}
	started := 0
	w := e.worker(func(c *Config) { c.Concurrency = 3; c.Prefetch = 2; c.Consumer = "pool" })
	w.Handle("jobs.wait", func(ctx context.Context, task *Task) error {
		pending, _ := e.client.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: task.Stream, Group: DefaultGroup,
			Start: task.EntryID, End: task.EntryID, Count: 1}).Result()
		mu.Lock()
		started++
		if len(pending) == 1 {
			consumers[pending[0].Consumer] = true
		}
		mu.Unlock()
		<-release
		return nil
	}, 1, 2)
	for range 6 {
		e.publish(New("jobs.wait", nil))
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	stopped := make(chan error, 1)
	go func() { stopped <- w.Run(runCtx) }()
	e.waitFor("three tasks to run at once", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return started == 3
	})
	time.Sleep(200 * time.Millisecond) // no fourth one starts while three run
	mu.Lock()
	if started != 3 || len(consumers) != 3 {
		t.Fatalf("started %d tasks on consumers %v, want 3 on 3", started, consumers)
	}
	mu.Unlock()

	shutdown := make(chan error, 1)
	go func() {
		sctx, scancel := context.WithTimeout(ctx, 10*time.Second)
		defer scancel()
		shutdown <- w.Shutdown(sctx)
	}()
	time.Sleep(100 * time.Millisecond)
	close(release) // the running tasks finish
	if err := <-shutdown; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if err := <-stopped; err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	if started != 3 {
		t.Fatalf("%d tasks started, want only the 3 running at shutdown", started)
	}
	mu.Unlock()
	if n, _ := e.client.XLen(ctx, e.q.Stream(Normal)).Result(); n != 3 {
		t.Fatalf("%d entries in the stream after shutdown, want the 3 prefetched ones back", n)
	}
	if p, _ := e.client.XPending(ctx, e.q.Stream(Normal), DefaultGroup).Result(); p.Count != 0 {
		t.Fatalf("%d entries still pending after shutdown", p.Count)
	}
	for i := range 3 {
		name := "pool-" + string(rune('0'+i))
		if n, _ := e.client.Exists(ctx, e.keys.Consumer(name)).Result(); n != 0 {
			t.Fatalf("liveness key of %s still there", name)
		}
	}
	if strings.Count(e.logs.String(), `"msg":"worker started","queue":"`+e.queue+`"`) != 1 ||
		!strings.Contains(e.logs.String(), `"serves":{"jobs.wait":[1,2]}`) {
		t.Fatalf("the start log does not say what the worker serves:\n%s", e.logs.String())
	}
}
