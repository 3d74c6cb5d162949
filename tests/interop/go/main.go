// Command envelope-peer is a Go producer and worker for kombu-envelope queues.
//
//	envelope-peer produce --redis URL --queue Q --task-type T --payload JSON [...]
//	envelope-peer produce-malformed --redis URL --queue Q --kind badjson|missingbody|badversion|badgzip|invalid
//	envelope-peer worker --redis URL --queue Q [--lease-ms N --backoff-ms N ...]
//	envelope-peer matrix --redis URL --prefix P [--work Q1,Q2,...] [--concurrency N]   (see matrix.go)
//	envelope-peer drill --redis URL --prefix P --work Q1,... --hostname H   (see drill.go)
//
// Run a sub-command with -h for its flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	envelope "github.com/kombu-envelope/kombu-envelope/sdk/go"
)

const usage = `usage: envelope-peer <command> [flags]

commands:
  produce            publish tasks (prints one task_id per line)
  produce-malformed  add a broken entry to a task stream (prints its entry id)
  worker             consume a queue with the built-in handlers
  matrix             work queues with the matrix handler; JSON-line commands on stdin
  drill              work queues with the fault drill's handler (bench/drill)

Run "envelope-peer <command> -h" for the flags of a command.
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch cmd, args := os.Args[1], os.Args[2:]; cmd {
	case "produce":
		err = produce(args)
	case "produce-malformed":
		err = produceMalformed(args)
	case "worker":
		err = worker(args)
	case "matrix":
		err = matrix(args)
	case "drill":
		err = drill(args)
	case "-h", "--help", "help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "unknown command %q\n\n%s", cmd, usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "envelope-peer: %v\n", err)
		os.Exit(1)
	}
}

// common are the flags every command takes.
type common struct {
	redisURL, prefix, queue, luaDir string
}

func (c *common) register(fs *flag.FlagSet) {
	c.registerRedis(fs)
	fs.StringVar(&c.queue, "queue", "", "queue name (required)")
}

// registerRedis registers the flags of the connection: --redis, --prefix and --lua-dir.
func (c *common) registerRedis(fs *flag.FlagSet) {
	def := os.Getenv("ENVELOPE_REDIS_URL")
	if def == "" {
		def = "redis://127.0.0.1:6379/0"
	}
	fs.StringVar(&c.redisURL, "redis", def, "Redis URL (default $ENVELOPE_REDIS_URL)")
	fs.StringVar(&c.prefix, "prefix", envelope.DefaultPrefix, "key prefix")
	fs.StringVar(&c.luaDir, "lua-dir", "", "directory of the protocol's Lua scripts (default $"+
		envelope.ScriptDirEnv+", else the scripts embedded in the SDK)")
}

func (c *common) connect() (*redis.Client, envelope.Scripts, error) {
	if err := envelope.CheckQueueName(c.queue); err != nil {
		return nil, nil, err
	}
	scripts, err := envelope.LoadScripts(c.luaDir)
	if err != nil {
		return nil, nil, err
	}
	client, err := envelope.NewClient(c.redisURL)
	if err != nil {
		return nil, nil, err
	}
	return client, scripts, nil
}

func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	return nil
}

// --- produce --------------------------------------------------------------------------

func produce(args []string) error {
	fs := flag.NewFlagSet("produce", flag.ContinueOnError)
	var c common
	c.register(fs)
	taskType := fs.String("task-type", "", "task_type (required)")
	payload := fs.String("payload", "{}", "payload, a JSON object")
	delayMS := fs.Int64("delay-ms", 0, "run this many milliseconds from now")
	scheduleTime := fs.String("schedule-time", "", "run at this RFC 3339 time (its offset is kept)")
	idemKey := fs.String("idempotency-key", "", "idempotency_key")
	traceID := fs.String("trace-id", "", "trace_id (default: a new one per task)")
	taskID := fs.String("task-id", "", "task_id (only with --count 1)")
	maxRetries := fs.String("max-retries", "", `max_retries: an integer, or "null" for unlimited (default 3)`)
	retryPolicy := fs.String("retry-policy", "", `"tiered": failures are retried automatically (header x-retry-policy)`)
	priority := fs.Int("priority", envelope.PriorityDefault, "priority 0-255, higher is more urgent")
	timeoutMS := fs.Int64("timeout-ms", 0, "timeout_ms of each attempt (0: none)")
	payloadVersion := fs.Int64("payload-version", 1, "payload_version")
	count := fs.Int("count", 1, "how many tasks to publish")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *taskType == "" {
		return errors.New("--task-type is required")
	}
	if *delayMS != 0 && *scheduleTime != "" {
		return errors.New("give --delay-ms or --schedule-time, not both")
	}
	if *taskID != "" && *count != 1 {
		return errors.New("--task-id needs --count 1")
	}
	body, err := envelope.ParseJSON([]byte(*payload))
	if err != nil || body.Kind != envelope.Object {
		return fmt.Errorf("--payload must be a JSON object: %v", err)
	}
	client, scripts, err := c.connect()
	if err != nil {
		return err
	}
	defer client.Close()
	p := envelope.NewProducer(client, c.prefix, scripts)
	ctx := context.Background()
	for i := 0; i < *count; i++ {
		e := envelope.New(*taskType, envelope.AppendCanonical(nil, body))
		if *taskID != "" {
			e.TaskID = *taskID
		}
		if *traceID != "" {
			e.TraceID = *traceID
		}
		e.Priority = *priority
		e.PayloadVersion = *payloadVersion
		if *idemKey != "" {
			e.IdempotencyKey = idemKey
		}
		if *timeoutMS != 0 {
			e.TimeoutMS = timeoutMS
		}
		if *retryPolicy != "" {
			e.Headers[envelope.HeaderRetryPolicy] = *retryPolicy
		}
		switch strings.ToLower(*maxRetries) {
		case "":
		case "null", "none", "unlimited":
			e.MaxRetries = nil
		default:
			n, err := strconv.ParseInt(*maxRetries, 10, 64)
			if err != nil {
				return fmt.Errorf("--max-retries: %w", err)
			}
			e.MaxRetries = &n
		}
		switch {
		case *scheduleTime != "":
			t, err := envelope.ParseTimestamp(*scheduleTime)
			if err != nil {
				return fmt.Errorf("--schedule-time: %w", err)
			}
			e.ScheduleTime = &t
		case *delayMS != 0:
			t := envelope.NewTimestamp(time.Now().Add(time.Duration(*delayMS) * time.Millisecond).UTC())
			e.ScheduleTime = &t
		}
		if _, err := p.Publish(ctx, c.queue, e); err != nil {
			return err
		}
		fmt.Println(e.TaskID)
	}
	return nil
}

// --- produce-malformed -------------------------------------------------------------------

func produceMalformed(args []string) error {
	fs := flag.NewFlagSet("produce-malformed", flag.ContinueOnError)
	var c common
	c.register(fs)
	kind := fs.String("kind", "", "badjson | missingbody | badversion | badgzip | invalid")
	bucket := fs.String("bucket", string(envelope.Normal), "high | normal | low")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	valid := string(envelope.New("order.close_timeout", []byte(`{"order_id":"0"}`)).JSON())
	var fields []string
	switch *kind {
	case "badjson":
		fields = []string{"v", "1", "enc", "json", "body", `{"task_type": "order.close_timeout",`}
	case "missingbody":
		fields = []string{"v", "1", "enc", "json"}
	case "badversion":
		fields = []string{"v", "99", "enc", "json", "body", valid}
	case "badgzip":
		fields = []string{"v", "1", "enc", "json+gzip", "body", valid}
	case "invalid":
		fields = []string{"v", "1", "enc", "json", "body",
			`{"task_id":"malformed-invalid","trace_id":"trace-malformed","task_type":"order.close_timeout",` +
				`"created_at":"2025-09-11T12:45:00","priority":300}`}
	default:
		return fmt.Errorf("unknown --kind %q", *kind)
	}
	client, _, err := c.connect()
	if err != nil {
		return err
	}
	defer client.Close()
	stream := envelope.KeySpace{Prefix: c.prefix}.Queue(c.queue).Stream(envelope.Bucket(*bucket))
	id, err := client.XAdd(context.Background(), &redis.XAddArgs{Stream: stream, Values: fields}).Result()
	if err != nil {
		return err
	}
	fmt.Println(id)
	return nil
}

// --- worker -------------------------------------------------------------------------------

func worker(args []string) error {
	fs := flag.NewFlagSet("worker", flag.ContinueOnError)
	var c common
	c.register(fs)
	group := fs.String("group", envelope.DefaultGroup, "consumer group")
	consumer := fs.String("consumer", "", "consumer name (default <host>-<pid>-<random>; only with --concurrency 1)")
	leaseMS := fs.Int64("lease-ms", 30000, "liveness lease")
	blockMS := fs.Int64("block-ms", 1000, "longest wait for new entries")
	prefetch := fs.Int("prefetch", 1, "entries taken per read (read.lua: at most exactly this many)")
	backoffMS := fs.Int64("backoff-ms", 30000, "first backoff delay")
	maxBackoffMS := fs.Int64("max-backoff-ms", 3600000, "longest backoff delay")
	fastRetries := fs.Int("fast-retries", 2, "transient failures retried at once")
	retryConcurrency := fs.Int("retry-concurrency", 5, "retries of one task type running at once")
	maxRedeliveries := fs.Int("max-redeliveries", 10, "dead-letter an entry after its consumer died this many times")
	deferMS := fs.Int64("defer-ms", 3000, "how far a busy idempotent task is pushed back")
	idleMS := fs.Int64("exit-after-idle-ms", 0, "stop after this long without entries (0: never)")
	concurrency := fs.Int("concurrency", 1, "workers (consumers) in this process")
	promote := fs.Bool("promote", true, "also run a delayed-task promoter in this process")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *concurrency < 1 || (*consumer != "" && *concurrency != 1) {
		return errors.New("--concurrency must be >= 1, and 1 when --consumer is given")
	}
	client, scripts, err := c.connect()
	if err != nil {
		return err
	}
	defer client.Close()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	ms := func(n int64) time.Duration { return time.Duration(n) * time.Millisecond }

	var promoter sync.WaitGroup
	promoteCtx, stopPromoter := context.WithCancel(context.Background())
	defer func() { stopPromoter(); promoter.Wait() }()
	if *promote {
		p := &envelope.Promoter{Client: client, Keys: envelope.KeySpace{Prefix: c.prefix},
			Scripts: scripts, Log: logger}
		promoter.Add(1)
		go func() { defer promoter.Done(); p.Run(promoteCtx) }()
	}

	w, err := envelope.NewWorker(client, scripts, envelope.Config{
		Prefix: c.prefix, Queue: c.queue, Group: *group, Consumer: *consumer,
		Lease: ms(*leaseMS), Block: ms(*blockMS), Prefetch: *prefetch, Concurrency: *concurrency,
		Retry: envelope.RetryPolicy{FastRetries: *fastRetries, Backoff: ms(*backoffMS),
			MaxBackoff: ms(*maxBackoffMS)},
		RetryConcurrency: *retryConcurrency, MaxRedeliveries: *maxRedeliveries,
		DeferDelay: ms(*deferMS), ExitAfterIdle: ms(*idleMS), Logger: logger,
		OnDuplicate: func(ctx context.Context, t *envelope.Task) {
			client.RPush(ctx, c.prefix+":effects:duplicates", envelope.Language+":"+t.TaskID)
		},
	})
	if err != nil {
		return err
	}
	registerBuiltins(w, client, c.prefix)
	return w.Run(ctx)
}

// --- built-in handlers ---------------------------------------------------------------------

// TestFailure is the error of test.fail: not transient.
type TestFailure struct{ TaskID string }

func (e *TestFailure) Error() string         { return "test.fail always fails (task " + e.TaskID + ")" }
func (e *TestFailure) ExceptionType() string { return "TestFailure" }

// TestTransient is the error of test.transient.
type TestTransient struct{ TaskID string }

func (e *TestTransient) Error() string         { return "test.transient: a transient failure" }
func (e *TestTransient) Transient() bool       { return true }
func (e *TestTransient) ExceptionType() string { return "TestTransient" }

func registerBuiltins(w *envelope.Worker, client *redis.Client, prefix string) {
	w.Handle("order.close_timeout", func(ctx context.Context, t *envelope.Task) error {
		p, err := envelope.ParseJSON(t.Payload)
		if err != nil {
			return envelope.InvalidPayload(err)
		}
		id := p.Get("order_id")
		if id == nil || (id.Kind != envelope.String && id.Kind != envelope.Number) {
			return envelope.InvalidPayload(errors.New("payload.order_id (string or number) is required"))
		}
		_, err = client.TxPipelined(ctx, func(pipe redis.Pipeliner) error {
			pipe.Incr(ctx, prefix+":effects:order.close_timeout:"+id.Text)
			pipe.RPush(ctx, prefix+":effects:log", envelope.Language+":"+t.TaskID)
			return nil
		})
		if err != nil {
			return envelope.Transient(err)
		}
		t.Log.Info("order closed", "order_id", id.Text)
		return nil
	})
	w.Handle("test.fail", func(ctx context.Context, t *envelope.Task) error {
		return &TestFailure{t.TaskID}
	})
	w.Handle("test.transient", func(ctx context.Context, t *envelope.Task) error {
		return &TestTransient{t.TaskID}
	})
	w.Handle("test.sleep", func(ctx context.Context, t *envelope.Task) error {
		var p struct {
			MS int64 `json:"ms"`
		}
		if err := t.DecodePayload(&p); err != nil {
			return envelope.InvalidPayload(err)
		}
		timer := time.NewTimer(time.Duration(p.MS) * time.Millisecond)
		defer timer.Stop()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-timer.C:
			return nil
		}
	})
}
