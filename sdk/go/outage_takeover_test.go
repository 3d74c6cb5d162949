package envelope

import (
	"context"
	"fmt"
	"log/slog"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

// A restart longer than the lease expires every liveness key at once: the
// other consumer must not take over an entry whose consumer is alive and
// renews as soon as Redis answers again (docs/protocol.md section 5).
func TestNoTakeOverOfALiveConsumerRightAfterRedisRestarted(t *testing.T) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Skip("redis-server is not on PATH")
	}
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	aof := []string{"--appendonly", "yes", "--appendfsync", "always"}
	srv, err := startServer(port, nil, "", aof...)
	if err != nil {
		t.Fatal(err)
	}
	dir := srv.dir
	t.Cleanup(func() { srv.stop() })
	url := fmt.Sprintf("redis://%s/0", srv.addr())
	scripts, err := LoadScripts("")
	if err != nil {
		t.Fatal(err)
	}
	logs := &lockedBuffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("worker log:\n%s", tail(logs.String(), 80))
		}
	})
	const lease = 1500 * time.Millisecond
	release := make(chan struct{})
	started := make(chan string, 4)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	run := func(consumer string) {
		client, err := NewClient(url) // one client each, as two processes have
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { client.Close() })
		w, err := NewWorker(client, scripts, Config{Prefix: "restart", Queue: "jobs", Consumer: consumer,
			Lease: lease, Block: 100 * time.Millisecond, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
		if err != nil {
			t.Fatal(err)
		}
		w.Handle("jobs.block", func(ctx context.Context, task *Task) error {
			started <- consumer
			<-release
			return nil
		})
		wg.Go(func() { _ = w.Run(ctx) })
	}

	run("a")
	producer, err := NewClient(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { producer.Close() })
	if _, err := NewProducer(producer, "restart", scripts).Publish(ctx, "jobs", New("jobs.block", nil)); err != nil {
		t.Fatal(err)
	}
	if got := <-started; got != "a" {
		t.Fatalf("started by %s", got)
	}
	run("b")
	time.Sleep(lease) // b renews and looks for dead consumers a few times

	srv.kill()
	time.Sleep(lease + 200*time.Millisecond) // every liveness key expires meanwhile
	if srv, err = launchServer(bin, port, dir, nil, "", aof...); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * lease) // b renewed twice in a row several times over
	close(release)

	q := KeySpace{"restart"}.Queue("jobs")
	eventually(t, 10*time.Second, "the entry to be acknowledged", func() bool {
		n, err := producer.XLen(context.Background(), q.Stream(Normal)).Result()
		return err == nil && n == 0
	})
	select {
	case again := <-started:
		t.Fatalf("the task ran twice: %s started it again", again)
	case <-time.After(200 * time.Millisecond):
	}
	if strings.Contains(logs.String(), "took over entry of dead consumer") {
		t.Fatal("an entry of a live consumer was taken over")
	}
}
