package envelope_test

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	envelope "github.com/kombu-envelope/kombu-envelope/sdk/go"
)

// readmeExample is the example that opens README.md, between the markers;
// TestReadmeExampleIsTheOneInTheReadme keeps the two the same.
func readmeExample(ctx context.Context, redisURL string) error {
	// README example: begin
	client, err := envelope.NewUniversalClient(redisURL) // redis://, redis-sentinel://, redis-cluster://
	if err != nil {
		return err
	}
	producer := envelope.NewProducer(client, "envelope", envelope.DefaultScripts())
	if _, err := producer.PublishTask(ctx, "orders", "order.close", map[string]string{"order_id": "42"},
		envelope.WithIdempotencyKey("order:42"), envelope.WithPriority(9)); err != nil {
		return err
	}
	worker, err := envelope.NewWorker(client, envelope.DefaultScripts(), envelope.Config{Queue: "orders", Concurrency: 4})
	if err != nil {
		return err
	}
	worker.Handle("order.close", func(ctx context.Context, t *envelope.Task) error {
		// t.Log carries task_id and trace_id; an error retries or dead-letters the task.
		t.Log.Info("closing order", "payload", string(t.Payload))
		return nil
	}, 1) // the payload versions it accepts
	return worker.Run(ctx) // until ctx ends (SIGTERM) or worker.Shutdown(ctx)
	// README example: end
}

func TestReadmeExampleRunsAgainstRedis(t *testing.T) {
	// A private server of its own: the example uses the default prefix "envelope".
	url, stop, err := envelope.StartTestRedis()
	if err != nil {
		t.Skipf("no redis-server: %v", err)
	}
	defer stop()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ran := make(chan error, 1)
	go func() { ran <- readmeExample(ctx, url) }()

	client, err := envelope.NewClient(url)
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	done := envelope.KeySpace{Prefix: "envelope"}.Idempotency("order.close", "order:42")
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if n, _ := client.Exists(ctx, done).Result(); n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the example's task did not run")
		}
	}
	cancel()
	if err := <-ran; err != nil {
		t.Fatalf("the example failed: %v", err)
	}
	q := envelope.KeySpace{Prefix: "envelope"}.Queue("orders")
	for _, s := range q.TaskStreams() {
		if n, _ := client.XLen(context.Background(), s).Result(); n != 0 {
			t.Fatalf("%d entries left in %s", n, s)
		}
	}
}

func TestReadmeExampleIsTheOneInTheReadme(t *testing.T) {
	src, err := os.ReadFile("example_test.go")
	if err != nil {
		t.Fatal(err)
	}
	_, body, _ := strings.Cut(string(src), "\t// README example: begin\n")
	body, _, _ = strings.Cut(body, "\t// README example: end\n")
	var want strings.Builder
	for _, line := range strings.SplitAfter(body, "\n") {
		want.WriteString(strings.TrimPrefix(line, "\t"))
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "```go\n"+want.String()+"```\n") {
		t.Fatalf("README.md's example is not the one example_test.go runs; it should read:\n%s", want.String())
	}
}
