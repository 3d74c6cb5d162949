package main

// The matrix command: one long-lived Go process of the cross-language matrix
// (tests/test_matrix.py). It works the queues named by --work with the matrix
// handler and answers JSON-line commands on stdin, one JSON line each on stdout:
//
//	{"id": 1, "op": "publish", "queue": Q, "tasks": [TASK, ...]}  -> {"id": 1, "ok": true, "task_ids": [...]}
//	{"id": 2, "op": "replay", "queue": Q, "entry_id": E, "payload": {...}} -> {"id": 2, "ok": true, "entry_id": NEW}
//	{"id": 3, "op": "consume", "queue": Q}                         -> {"id": 3, "ok": true}
//	{"id": 4, "op": "cancel", "task_ids": [...]}                   -> {"id": 4, "ok": true, "outcomes": [{"outcome", "queue"}, ...]}
//
// TASK is {"task_id", "task_type", "payload", "schedule_time", "expires",
// "max_retries" (absent: 3, null: unlimited), "retry_policy", "idempotency_key",
// "ordering_key", "headers" (string values, e.g. traceparent and tracestate)};
// a member it does not know fails the command rather than being dropped.
// The workers also run limits.task (docs/protocol.md section 19's matrix case):
// {"sleep_ms": N} sleeps N ms and appends {"language", "task_id", "start_ms",
// "end_ms"} (unix ms, fractional) to <prefix>:mx:spans; --concurrency runs
// that many consumers per queue (default 1), so several can run at once.
// A failed command answers {"id": N, "ok": false, "error": "..."}; the process
// ends when stdin closes or on SIGTERM. Workers write the results Celery callers
// ask for to the Redis of --results.

import (
	"bufio"
	"bytes"
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

// matrixTask is one task of a publish command.
type matrixTask struct {
	TaskID         string            `json:"task_id"`
	TaskType       string            `json:"task_type"`
	Payload        json.RawMessage   `json:"payload"`
	ScheduleTime   string            `json:"schedule_time"`
	Expires        string            `json:"expires"`
	MaxRetries     json.RawMessage   `json:"max_retries"` // empty: absent; "null": unlimited
	RetryPolicy    string            `json:"retry_policy"`
	IdempotencyKey string            `json:"idempotency_key"`
	OrderingKey    string            `json:"ordering_key"`
	Headers        map[string]string `json:"headers"`
}

// UnmarshalJSON refuses members it does not know, so that a field the suite
// sends never silently misses the Envelope.
func (t *matrixTask) UnmarshalJSON(data []byte) error {
	type plain matrixTask
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	return dec.Decode((*plain)(t))
}

// matrixCommand is one line of stdin.
type matrixCommand struct {
	ID      int64           `json:"id"`
	Op      string          `json:"op"`
	Queue   string          `json:"queue"`
	Tasks   []matrixTask    `json:"tasks"`
	EntryID string          `json:"entry_id"`
	TaskIDs []string        `json:"task_ids"`
	Payload json.RawMessage `json:"payload"`
}

// matrixPeer holds the process's connection, producer and workers.
type matrixPeer struct {
	client   *redis.Client
	results  *redis.Client
	scripts  envelope.Scripts
	prefix   string
	producer *envelope.Producer
	dead     *envelope.DeadLetters
	logger   *slog.Logger
	ctx      context.Context
	workers  sync.WaitGroup
	// concurrency is the consumers of each queue's worker (--concurrency).
	concurrency int
}

func matrix(args []string) error {
	fs := flag.NewFlagSet("matrix", flag.ContinueOnError)
	var c common
	c.registerRedis(fs)
	work := fs.String("work", "", "comma-separated queues to work")
	resultsURL := fs.String("results", "", "Redis URL of Celery's result backend (default --redis)")
	concurrency := fs.Int("concurrency", 1, "consumers of each queue's worker (tasks run at once)")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *concurrency < 1 {
		return errors.New("--concurrency must be >= 1")
	}
	scripts, err := envelope.LoadScripts(c.luaDir)
	if err != nil {
		return err
	}
	client, err := envelope.NewClient(c.redisURL)
	if err != nil {
		return err
	}
	defer client.Close()
	results := client
	if *resultsURL != "" {
		if results, err = envelope.NewClient(*resultsURL); err != nil {
			return err
		}
		defer results.Close()
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	m := &matrixPeer{
		client: client, results: results, scripts: scripts, prefix: c.prefix, ctx: ctx,
		producer: envelope.NewProducer(client, c.prefix, scripts),
		dead:     envelope.NewDeadLetters(client, c.prefix, scripts),
		logger:   slog.New(slog.NewJSONHandler(os.Stderr, nil)), concurrency: *concurrency,
	}
	promoter := &envelope.Promoter{Client: client, Keys: envelope.KeySpace{Prefix: c.prefix},
		Scripts: scripts, Log: m.logger}
	m.workers.Add(1)
	go func() { defer m.workers.Done(); promoter.Run(ctx) }()
	if *work != "" {
		for _, queue := range strings.Split(*work, ",") {
			if err := m.consume(queue); err != nil {
				return err
			}
		}
	}
	out := json.NewEncoder(os.Stdout)
	if err := out.Encode(map[string]any{"ready": true, "language": envelope.Language}); err != nil {
		return err
	}
	lines := make(chan []byte)
	go func() {
		defer close(lines)
		scanner := bufio.NewScanner(os.Stdin)
		scanner.Buffer(make([]byte, 1<<20), 16<<20)
		for scanner.Scan() {
			lines <- append([]byte(nil), scanner.Bytes()...)
		}
	}()
	for done := false; !done; {
		select {
		case <-ctx.Done():
			done = true
		case line, open := <-lines:
			if !open {
				done = true
				break
			}
			if err := out.Encode(m.answer(line)); err != nil {
				return err
			}
		}
	}
	stop()
	m.workers.Wait()
	return nil
}

// answer runs one command line and returns its reply.
func (m *matrixPeer) answer(line []byte) map[string]any {
	var cmd matrixCommand
	if err := json.Unmarshal(line, &cmd); err != nil {
		return map[string]any{"ok": false, "error": "command is not JSON or has an unknown member: " + err.Error()}
	}
	reply := map[string]any{"id": cmd.ID, "ok": true}
	var err error
	switch cmd.Op {
	case "publish":
		reply["task_ids"], err = m.publish(cmd.Queue, cmd.Tasks)
	case "replay":
		reply["entry_id"], err = m.replay(cmd.Queue, cmd.EntryID, cmd.Payload)
	case "consume":
		err = m.consume(cmd.Queue)
	case "cancel":
		reply["outcomes"], err = m.cancel(cmd.TaskIDs)
	default:
		err = fmt.Errorf("unknown op %q", cmd.Op)
	}
	if err != nil {
		return map[string]any{"id": cmd.ID, "ok": false, "error": err.Error()}
	}
	return reply
}

func (m *matrixPeer) publish(queue string, tasks []matrixTask) ([]string, error) {
	ids := make([]string, 0, len(tasks))
	for _, t := range tasks {
		e, err := t.envelope()
		if err != nil {
			return nil, err
		}
		if _, err := m.producer.Publish(m.ctx, queue, e); err != nil {
			return nil, err
		}
		ids = append(ids, e.TaskID)
	}
	return ids, nil
}

// envelope is the Envelope the task spec describes.
func (t matrixTask) envelope() (*envelope.Envelope, error) {
	payload := t.Payload
	if len(payload) == 0 {
		payload = []byte("{}")
	}
	body, err := envelope.ParseJSON(payload)
	if err != nil || body.Kind != envelope.Object {
		return nil, fmt.Errorf("payload must be a JSON object: %v", err)
	}
	// The headers first: a caller's traceparent gives the task its trace_id.
	headers := make([]envelope.PublishOption, 0, len(t.Headers))
	for name, value := range t.Headers {
		headers = append(headers, envelope.WithHeader(name, value))
	}
	e, err := envelope.NewTask(context.Background(), t.TaskType, envelope.AppendCanonical(nil, body), headers...)
	if err != nil {
		return nil, err
	}
	if t.TaskID != "" {
		e.TaskID = t.TaskID
	}
	if t.ScheduleTime != "" {
		when, err := envelope.ParseTimestamp(t.ScheduleTime)
		if err != nil {
			return nil, fmt.Errorf("schedule_time: %w", err)
		}
		e.ScheduleTime = &when
	}
	if t.Expires != "" {
		when, err := envelope.ParseTimestamp(t.Expires)
		if err != nil {
			return nil, fmt.Errorf("expires: %w", err)
		}
		e.Expires = &when
	}
	if len(t.MaxRetries) > 0 {
		var n *int64
		if err := json.Unmarshal(t.MaxRetries, &n); err != nil {
			return nil, fmt.Errorf("max_retries: %w", err)
		}
		e.MaxRetries = n
	}
	if t.RetryPolicy != "" {
		e.Headers[envelope.HeaderRetryPolicy] = t.RetryPolicy
	}
	if t.IdempotencyKey != "" {
		e.IdempotencyKey = &t.IdempotencyKey
	}
	if t.OrderingKey != "" {
		e.OrderingKey = &t.OrderingKey
	}
	return e, nil
}

// cancel answers each task's outcome and, for "removed", the queue (else null).
func (m *matrixPeer) cancel(taskIDs []string) ([]map[string]any, error) {
	outcomes := make([]map[string]any, 0, len(taskIDs))
	for _, id := range taskIDs {
		res, err := m.producer.Cancel(m.ctx, id)
		if err != nil {
			return nil, err
		}
		outcome := map[string]any{"outcome": string(res.Status), "queue": nil}
		if res.Queue != "" {
			outcome["queue"] = res.Queue
		}
		outcomes = append(outcomes, outcome)
	}
	return outcomes, nil
}

func (m *matrixPeer) replay(queue, id string, payload json.RawMessage) (string, error) {
	return m.dead.Replay(m.ctx, queue, id, envelope.ReplayOptions{
		Edit: func(e *envelope.Envelope) error {
			if len(payload) > 0 {
				e.Payload = payload
			}
			return nil
		},
		Operator: "matrix",
	})
}

// consume starts a worker on queue, in this process, until the process stops.
func (m *matrixPeer) consume(queue string) error {
	ms := time.Millisecond
	w, err := envelope.NewWorker(m.client, m.scripts, envelope.Config{
		Prefix: m.prefix, Queue: queue, Lease: 3000 * ms, Block: 200 * ms,
		Retry:      envelope.RetryPolicy{FastRetries: 2, Backoff: 200 * ms, MaxBackoff: 1000 * ms},
		DeferDelay: 300 * ms, Logger: m.logger.With("queue", queue), ResultBackend: m.results,
		Concurrency: m.concurrency,
	})
	if err != nil {
		return err
	}
	w.HandleResult("matrix.task", matrixHandler(m.client, m.prefix, m.producer))
	w.Handle("limits.task", limitsHandler(m.client, m.prefix))
	m.workers.Add(1)
	go func() {
		defer m.workers.Done()
		if err := w.Run(m.ctx); err != nil && !errors.Is(err, context.Canceled) {
			m.logger.Error("worker stopped", "queue", queue, "error", err.Error())
		}
	}()
	return nil
}

// MatrixFailure is the error of a matrix task asked to fail: not transient.
type MatrixFailure struct{ Attempt int64 }

func (e *MatrixFailure) Error() string {
	return fmt.Sprintf("matrix.task failed attempt %d", e.Attempt)
}
func (e *MatrixFailure) ExceptionType() string { return "MatrixFailure" }

// matrixNext is one task of a payload's "then": published after the effect.
type matrixNext struct {
	Queue  string       `json:"queue"`
	TaskID string       `json:"task_id"`
	Then   []matrixNext `json:"then"`
}

// checkNext checks each task of then (named name), and of the "then"s nested in it.
func checkNext(then []matrixNext, name string) error {
	for i, next := range then {
		if next.Queue == "" || next.TaskID == "" {
			return fmt.Errorf(`payload.%s must be a list of {"queue": non-empty string, `+
				`"task_id": non-empty string, "then": list}`, name)
		}
		if err := checkNext(next.Then, fmt.Sprintf("%s[%d].then", name, i)); err != nil {
			return err
		}
	}
	return nil
}

// matrixTrace is what a record of <prefix>:mx:trace:<task_id> holds.
type matrixTrace struct {
	Language    string  `json:"language"`
	Traceparent *string `json:"traceparent"`
	Tracestate  *string `json:"tracestate"`
	TraceID     string  `json:"trace_id"`
}

// header is the value of a header, nil when the Envelope has none.
func header(t *envelope.Task, name string) *string {
	if value, ok := t.Headers[name]; ok {
		return &value
	}
	return nil
}

// matrixHandler is matrix.task, the same in every language (tests/apps/matrix_app.py):
// it records the attempt in <prefix>:mx:attempts:<task_id> ("go:<retry_count>")
// and the trace headers it came with in <prefix>:mx:trace:<task_id> (JSON
// {"language", "traceparent", "tracestate", "trace_id"}); with "log" it then
// appends "start <task_id>" to <prefix>:mx:log:<log>; with hold_ms it records
// <prefix>:mx:started:<task_id> and waits; it fails while "fail" is true or for
// the first fail_times attempts, and otherwise (with "log", after appending
// "end <task_id>" to that list) records its effect in
// <prefix>:mx:effect:<task_id> ("go:<unix ms>"), publishes each task of "then"
// ({"queue", "task_id", "then"}) as a matrix.task whose payload's "then" is the
// nested one, with producer and the handler's ctx (so it continues the trace),
// and returns {"language": "go"}.
func matrixHandler(client *redis.Client, prefix string, producer *envelope.Producer) envelope.ResultHandlerFunc {
	return func(ctx context.Context, t *envelope.Task) (any, error) {
		var p struct {
			HoldMS    int64        `json:"hold_ms"`
			FailTimes int64        `json:"fail_times"`
			Fail      bool         `json:"fail"`
			Then      []matrixNext `json:"then"`
			Log       string       `json:"log"`
		}
		if err := t.DecodePayload(&p); err != nil {
			return nil, envelope.InvalidPayload(err)
		}
		if err := checkNext(p.Then, "then"); err != nil {
			return nil, envelope.InvalidPayload(err)
		}
		key := func(what string) string { return prefix + ":mx:" + what + ":" + t.TaskID }
		// logged appends "<what> <task_id>" to the payload's log, when it names one.
		logged := func(what string) error {
			if p.Log == "" {
				return nil
			}
			return client.RPush(ctx, prefix+":mx:log:"+p.Log, what+" "+t.TaskID).Err()
		}
		attempt, err := client.RPush(ctx, key("attempts"),
			fmt.Sprintf("%s:%d", envelope.Language, t.RetryCount)).Result()
		if err != nil {
			return nil, envelope.Transient(err)
		}
		if err := logged("start"); err != nil {
			return nil, envelope.Transient(err)
		}
		seen, err := json.Marshal(matrixTrace{Language: envelope.Language, TraceID: t.TraceID,
			Traceparent: header(t, envelope.HeaderTraceparent), Tracestate: header(t, envelope.HeaderTracestate)})
		if err != nil {
			return nil, err
		}
		if err := client.RPush(ctx, key("trace"), seen).Err(); err != nil {
			return nil, envelope.Transient(err)
		}
		if p.HoldMS > 0 {
			if err := client.RPush(ctx, key("started"), envelope.Language).Err(); err != nil {
				return nil, envelope.Transient(err)
			}
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(time.Duration(p.HoldMS) * time.Millisecond):
			}
		}
		if p.Fail || attempt <= p.FailTimes {
			return nil, &MatrixFailure{attempt}
		}
		if err := logged("end"); err != nil {
			return nil, envelope.Transient(err)
		}
		effect := fmt.Sprintf("%s:%d", envelope.Language, time.Now().UnixMilli())
		if err := client.RPush(ctx, key("effect"), effect).Err(); err != nil {
			return nil, envelope.Transient(err)
		}
		for _, next := range p.Then {
			then := next.Then
			if then == nil {
				then = []matrixNext{}
			}
			_, err := producer.PublishTask(ctx, next.Queue, "matrix.task",
				map[string]any{"then": then}, envelope.WithTaskID(next.TaskID))
			if err != nil {
				return nil, err
			}
		}
		return map[string]string{"language": envelope.Language}, nil
	}
}

// matrixSpan is one record of <prefix>:mx:spans: a run of limits.task.
type matrixSpan struct {
	Language string  `json:"language"`
	TaskID   string  `json:"task_id"`
	StartMS  float64 `json:"start_ms"`
	EndMS    float64 `json:"end_ms"`
}

// unixMS is t in fractional milliseconds since the epoch.
func unixMS(t time.Time) float64 { return float64(t.UnixMicro()) / 1000 }

// limitsHandler is limits.task, the same in every language: it sleeps
// payload.sleep_ms, then appends its span to <prefix>:mx:spans.
func limitsHandler(client *redis.Client, prefix string) envelope.HandlerFunc {
	return func(ctx context.Context, t *envelope.Task) error {
		start := time.Now()
		var p struct {
			SleepMS *int64 `json:"sleep_ms"`
		}
		if err := t.DecodePayload(&p); err != nil || p.SleepMS == nil || *p.SleepMS < 0 {
			return envelope.InvalidPayload(errors.New("payload.sleep_ms must be an integer >= 0"))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Duration(*p.SleepMS) * time.Millisecond):
		}
		record, err := json.Marshal(matrixSpan{Language: envelope.Language, TaskID: t.TaskID,
			StartMS: unixMS(start), EndMS: unixMS(time.Now())})
		if err != nil {
			return err
		}
		if err := client.RPush(ctx, prefix+":mx:spans", record).Err(); err != nil {
			return envelope.Transient(err)
		}
		return nil
	}
}
