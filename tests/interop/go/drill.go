package main

// The drill command: a Go worker of the fault drill (bench/drill, python -m bench
// drill --languages ...). It works the queues of --work with the drill handler of
// drill.effect, the task the drill's Celery producer publishes, and records what
// it does in the ledger Redis exactly as bench/drill/app.py does for Celery:
//
//	drill:<run>:deliveries  {"pid","t","task","order","host","redelivered"}  each start
//	drill:<run>:runs        {"pid","t","task","order","host","key"}          the body begins
//	drill:<run>:effects     {"pid","t","task","order","host"}  with HINCRBY drill:<run>:effect-count <order> 1, one MULTI
//	drill:<run>:outcomes    {"pid","t","task","state","host"[,"error"]}      returned or failure
//	drill:<run>:ready       {"pid","t","host"}                              once every worker runs
//
// The ledger and the run come from DRILL_LEDGER_URL and DRILL_RUN, the hostname from
// --hostname. The SDK's Worker makes the idempotency claim before it calls the
// handler, so a start and its run are recorded together; it writes the done marker
// and acknowledges after the handler returned, so the handler's outcome is
// "returned" (not yet settled) where Celery's is "success" (done marker written).

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"

	envelope "github.com/kombu-envelope/kombu-envelope/sdk/go"
)

// drillTask is the task type of the drill (bench/drill/app.py TASK).
const drillTask = "drill.effect"

// ledger appends the drill's records for one run.
type ledger struct {
	client *redis.Client
	run    string
	host   string
}

func (l *ledger) key(name string) string { return "drill:" + l.run + ":" + name }

func (l *ledger) record(fields map[string]any) string {
	fields["pid"], fields["t"], fields["host"] = os.Getpid(), float64(time.Now().UnixMicro())/1e6, l.host
	raw, _ := json.Marshal(fields) // plain values only
	return string(raw)
}

// add appends one record of kind.
func (l *ledger) add(ctx context.Context, kind string, fields map[string]any) error {
	return l.client.RPush(ctx, l.key(kind), l.record(fields)).Err()
}

// addEffect records the effect of order: its count and its record in one MULTI.
func (l *ledger) addEffect(ctx context.Context, task, order string) error {
	_, err := l.client.TxPipelined(ctx, func(pipe redis.Pipeliner) error {
		pipe.HIncrBy(ctx, l.key("effect-count"), order, 1)
		pipe.RPush(ctx, l.key("effects"), l.record(map[string]any{"task": task, "order": order}))
		return nil
	})
	return err
}

// drillHandler is drill.effect: it records the start and the run, works work_ms,
// records the effect, then the outcome.
func drillHandler(l *ledger) envelope.HandlerFunc {
	return func(ctx context.Context, t *envelope.Task) (err error) {
		var p struct {
			OrderID string `json:"order_id"`
			WorkMS  int64  `json:"work_ms"`
		}
		if err := t.DecodePayload(&p); err != nil || p.OrderID == "" || p.WorkMS < 0 {
			return envelope.InvalidPayload(fmt.Errorf("payload must hold order_id (a string) and work_ms (>= 0): %v", err))
		}
		defer func() {
			outcome := map[string]any{"task": t.TaskID, "state": "returned"}
			if err != nil {
				outcome["state"], outcome["error"] = "failure", err.Error()
			}
			if recErr := l.add(context.WithoutCancel(ctx), "outcomes", outcome); recErr != nil && err == nil {
				err = envelope.Transient(recErr)
			}
		}()
		var key any
		if t.IdempotencyKey != nil {
			key = *t.IdempotencyKey
		}
		if err := l.add(ctx, "deliveries", map[string]any{"task": t.TaskID, "order": p.OrderID,
			"redelivered": t.Redelivered > 0}); err != nil {
			return envelope.Transient(err)
		}
		if err := l.add(ctx, "runs", map[string]any{"task": t.TaskID, "order": p.OrderID, "key": key}); err != nil {
			return envelope.Transient(err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Duration(p.WorkMS) * time.Millisecond):
		}
		if err := l.addEffect(ctx, t.TaskID, p.OrderID); err != nil {
			return envelope.Transient(err)
		}
		return nil
	}
}

func drill(args []string) error {
	fs := flag.NewFlagSet("drill", flag.ContinueOnError)
	var c common
	c.registerRedis(fs)
	work := fs.String("work", "", "comma-separated queues to work (required)")
	hostname := fs.String("hostname", "", "the name the ledger records (required)")
	leaseMS := fs.Int64("lease-ms", 3000, "liveness lease")
	concurrency := fs.Int("concurrency", 2, "tasks run at once per queue")
	waitReplicas := fs.Int("wait-replicas", 0, "replicas each settled entry waits for (WAIT)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *work == "" || *hostname == "" {
		return errors.New("--work and --hostname are required")
	}
	ledgerURL, run := os.Getenv("DRILL_LEDGER_URL"), os.Getenv("DRILL_RUN")
	if ledgerURL == "" || run == "" {
		return errors.New("DRILL_LEDGER_URL and DRILL_RUN must be set")
	}
	scripts, err := envelope.LoadScripts(c.luaDir)
	if err != nil {
		return err
	}
	client, err := envelope.NewUniversalClient(c.redisURL)
	if err != nil {
		return err
	}
	defer client.Close()
	ledgerClient, err := envelope.NewClient(ledgerURL)
	if err != nil {
		return err
	}
	defer ledgerClient.Close()
	l := &ledger{client: ledgerClient, run: run, host: *hostname}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	ms := time.Millisecond
	var running sync.WaitGroup
	promoter := &envelope.Promoter{Client: client, Keys: envelope.KeySpace{Prefix: c.prefix},
		Scripts: scripts, Log: logger}
	running.Add(1)
	go func() { defer running.Done(); promoter.Run(ctx) }()
	for _, queue := range strings.Split(*work, ",") {
		w, err := envelope.NewWorker(client, scripts, envelope.Config{
			Prefix: c.prefix, Queue: queue, Lease: time.Duration(*leaseMS) * ms, Block: 500 * ms,
			Concurrency: *concurrency,
			Retry:       envelope.RetryPolicy{FastRetries: 2, Backoff: time.Second, MaxBackoff: 4 * time.Second},
			DeferDelay:  time.Second, Durability: envelope.Durability{Replicas: *waitReplicas},
			Logger: logger.With("queue", queue),
		})
		if err != nil {
			stop()
			running.Wait()
			return err
		}
		w.Handle(drillTask, drillHandler(l))
		running.Add(1)
		go func() {
			defer running.Done()
			if err := w.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
				logger.Error("worker stopped", "queue", queue, "error", err.Error())
			}
		}()
	}
	if err := l.add(ctx, "ready", map[string]any{}); err != nil {
		stop()
		running.Wait()
		return err
	}
	<-ctx.Done()
	running.Wait()
	return nil
}
