package envelope

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Language is written in liveness keys and dead-letter entries.
const Language = "go"

// HandlerFunc runs one attempt of a task. Return nil on success. An error is
// final unless the Envelope asks for automatic retries (x-retry-policy:
// tiered); then wrap it with Transient to retry it on the fast tier, with
// InvalidPayload or Reject to dead-letter it at once. ctx ends when timeout_ms
// passes, and carries the task's trace id (TraceIDFromContext), which
// PublishTask stamps on the tasks the handler publishes. A task that asks for
// a result (ext.celery.result) gets null; ResultHandlerFunc returns one.
type HandlerFunc func(ctx context.Context, t *Task) error

// Task is what a handler receives.
type Task struct {
	*Envelope
	Queue       string
	Stream      string
	EntryID     string
	Redelivered int // how many times the entry was taken back from a dead consumer
	Log         *slog.Logger
}

// DecodePayload unmarshals the payload into v.
func (t *Task) DecodePayload(v any) error { return json.Unmarshal(t.Payload, v) }

type handler struct {
	run      ResultHandlerFunc
	versions []int64
}

// Config configures a Worker. Zero fields take the protocol's defaults.
type Config struct {
	Prefix   string
	Queue    string
	Group    string
	Consumer string // unique per process and connection; default <host>-<pid>-<random>

	Lease    time.Duration // liveness lease (30 s)
	Block    time.Duration // longest wait for new entries (1 s)
	Prefetch int           // entries taken per read, at most exactly (1)

	Retry            RetryPolicy
	RetryConcurrency int           // concurrent retries per task type (5)
	SlotHold         time.Duration // retry slot expiry when timeout_ms is absent (15 min)
	MaxRedeliveries  int           // taken-over entries dead-lettered after this many (10)
	ForgetAfter      time.Duration // dead consumers holding nothing are forgotten once idle this long (1 h)

	IdemClaim   time.Duration // safety-net expiry of an idempotency claim (1 h, or timeout + lease)
	IdemDoneTTL time.Duration // how long the done marker is kept (24 h)
	DeferDelay  time.Duration // how far a busy idempotent task is pushed back (3 s)

	IsTransient   func(error) bool // default DefaultIsTransient
	Limits        Limits
	GzipMin       int           // default GzipMinBytes
	ExitAfterIdle time.Duration // stop after this long without entries (0: never)

	// Concurrency is how many tasks the Worker runs at once (1): it runs that
	// many consumers, "<Consumer>-<i>", each with its own liveness key and
	// Prefetch, sharing the handlers.
	Concurrency int

	// ResultBackend is the Redis of Celery's result backend, where the results
	// Celery callers ask for (ext.celery.result) are written. nil: they are not
	// written, which is logged once per task type.
	ResultBackend redis.UniversalClient

	Logger *slog.Logger
	// OnDuplicate is called when a task is acknowledged without running because
	// its idempotency key is already done.
	OnDuplicate func(ctx context.Context, t *Task)
}

func (c *Config) defaults() {
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.Group == "" {
		c.Group = DefaultGroup
	}
	if c.Consumer == "" {
		c.Consumer = NewConsumerName()
	}
	if c.Lease <= 0 {
		c.Lease = 30 * time.Second
	}
	if c.Block <= 0 {
		c.Block = time.Second
	}
	if c.Prefetch <= 0 {
		c.Prefetch = 1
	}
	if c.Retry.Backoff <= 0 {
		c.Retry.Backoff = DefaultRetryPolicy.Backoff
	}
	if c.Retry.MaxBackoff <= 0 {
		c.Retry.MaxBackoff = DefaultRetryPolicy.MaxBackoff
	}
	if c.Retry.FastRetries < 0 {
		c.Retry.FastRetries = 0
	}
	if c.RetryConcurrency <= 0 {
		c.RetryConcurrency = 5
	}
	if c.SlotHold <= 0 {
		c.SlotHold = 15 * time.Minute
	}
	if c.MaxRedeliveries < 0 {
		c.MaxRedeliveries = 0
	}
	if c.ForgetAfter <= 0 {
		c.ForgetAfter = time.Hour
	}
	if c.IdemClaim <= 0 {
		c.IdemClaim = time.Hour
	}
	if c.IdemDoneTTL <= 0 {
		c.IdemDoneTTL = 24 * time.Hour
	}
	if c.DeferDelay <= 0 {
		c.DeferDelay = 3 * time.Second
	}
	if c.IsTransient == nil {
		c.IsTransient = DefaultIsTransient
	}
	if c.Limits == (Limits{}) {
		c.Limits = DefaultLimits
	}
	if c.GzipMin == 0 {
		c.GzipMin = GzipMinBytes
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.NewJSONHandler(os.Stderr, nil))
	}
}

// NewConsumerName returns "<host>-<pid>-<random>" (never with a space: the
// idempotency holder "<consumer> <task_id>" relies on it).
func NewConsumerName() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%d-%s", hostname(), os.Getpid(), hex.EncodeToString(b[:]))
}

func hostname() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "localhost"
	}
	return strings.ReplaceAll(h, " ", "_")
}

// Worker consumes one queue (docs/protocol.md sections 5-10).
type Worker struct {
	cfg      Config
	client   redis.UniversalClient
	scripts  Scripts
	keys     KeySpace
	queue    QueueKeys
	handlers map[string]handler
	results  *results // shared by the consumers of one Worker
	log      *slog.Logger
	host     string
	pid      string

	stopOnce sync.Once
	stop     chan struct{} // closed by Shutdown
	runs     sync.WaitGroup
}

// NewWorker returns a worker for cfg.Queue; register handlers, then Run it.
func NewWorker(client redis.UniversalClient, scripts Scripts, cfg Config) (*Worker, error) {
	if err := CheckQueueName(cfg.Queue); err != nil {
		return nil, err
	}
	if strings.ContainsAny(cfg.Consumer, " \t\r\n") {
		return nil, fmt.Errorf("consumer name %q must not contain spaces", cfg.Consumer)
	}
	cfg.defaults()
	return newWorker(client, scripts, cfg, map[string]handler{}, &results{backend: cfg.ResultBackend}), nil
}

func newWorker(client redis.UniversalClient, scripts Scripts, cfg Config, handlers map[string]handler,
	res *results) *Worker {
	keys := KeySpace{cfg.Prefix}
	return &Worker{
		cfg: cfg, client: client, scripts: scripts, keys: keys, queue: keys.Queue(cfg.Queue),
		handlers: handlers, results: res, stop: make(chan struct{}),
		log:  cfg.Logger.With("consumer", cfg.Consumer, "queue", cfg.Queue),
		host: hostname(), pid: strconv.Itoa(os.Getpid()),
	}
}

// serves maps the task types this worker runs to the payload versions each
// accepts, for its start log.
func (w *Worker) serves() map[string][]int64 {
	out := make(map[string][]int64, len(w.handlers))
	for taskType, h := range w.handlers {
		out[taskType] = slices.Sorted(slices.Values(h.versions))
	}
	return out
}

// Consumer is this worker's consumer name (with Concurrency > 1, the prefix of its consumers').
func (w *Worker) Consumer() string { return w.cfg.Consumer }

// Handle registers fn for taskType. versions lists the payload_version values
// it accepts (default: 1 only).
func (w *Worker) Handle(taskType string, fn HandlerFunc, versions ...int64) {
	w.HandleResult(taskType, func(ctx context.Context, t *Task) (any, error) { return nil, fn(ctx, t) },
		versions...)
}

// HandleResult registers fn for taskType, as Handle does; what fn returns is
// the result written for a Celery caller that asks for one (ext.celery.result,
// with Config.ResultBackend set).
func (w *Worker) HandleResult(taskType string, fn ResultHandlerFunc, versions ...int64) {
	if len(versions) == 0 {
		versions = []int64{1}
	}
	w.handlers[taskType] = handler{fn, versions}
}

// Run consumes until ctx ends, Shutdown is called or ExitAfterIdle passes,
// then shuts down cleanly: the tasks running finish, entries read but not
// started go back to their stream, and the liveness keys are deleted. With
// Concurrency > 1 it runs that many consumers and returns when all stopped.
func (w *Worker) Run(ctx context.Context) error {
	w.runs.Add(1)
	defer w.runs.Done()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-w.stop:
			cancel()
		case <-ctx.Done():
		}
	}()
	n := max(w.cfg.Concurrency, 1)
	ready := make(chan struct{}, n)
	var wg sync.WaitGroup
	wg.Go(func() { w.announce(ctx, ready) })
	if n == 1 {
		err := w.consume(ctx, ready)
		cancel()
		wg.Wait()
		return err
	}
	errs := make(chan error, n)
	var consumers sync.WaitGroup
	for i := range n {
		cfg := w.cfg
		cfg.Concurrency = 1
		cfg.Consumer = fmt.Sprintf("%s-%d", w.cfg.Consumer, i)
		child := newWorker(w.client, w.scripts, cfg, w.handlers, w.results)
		consumers.Go(func() { errs <- child.consume(ctx, ready) })
	}
	consumers.Wait()
	cancel()
	wg.Wait()
	close(errs)
	var all []error
	for err := range errs {
		all = append(all, err)
	}
	return errors.Join(all...)
}

// announce writes the start log, one line per Run, once the first consumer
// is ready: the queue, and each task type with its payload versions.
func (w *Worker) announce(ctx context.Context, ready <-chan struct{}) {
	select {
	case <-ready:
		w.cfg.Logger.Info("worker started", "queue", w.cfg.Queue, "consumer", w.cfg.Consumer,
			"concurrency", max(w.cfg.Concurrency, 1), "language", Language, "serves", w.serves())
	case <-ctx.Done():
	}
}

// Shutdown stops Run as ending its ctx does (SIGTERM in a service): the
// running tasks finish, entries read but not started are handed back with
// requeue.lua, the liveness keys are deleted. It waits for that until ctx
// ends (then it returns ctx's error; the worker goes on stopping). A Worker
// that was shut down does not run again.
func (w *Worker) Shutdown(ctx context.Context) error {
	w.stopOnce.Do(func() { close(w.stop) })
	done := make(chan struct{})
	go func() { w.runs.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// consume is one consumer's loop; it signals ready once it consumes.
func (w *Worker) consume(ctx context.Context, ready chan<- struct{}) error {
	bg := context.Background()
	if err := w.scripts.Load(bg, w.client); err != nil {
		return err
	}
	if err := w.ensureGroups(bg); err != nil {
		return err
	}
	if err := w.renew(bg); err != nil {
		return fmt.Errorf("setting the liveness key: %w", err)
	}
	keeperCtx, stopKeeper := context.WithCancel(bg)
	var keeper sync.WaitGroup
	keeper.Add(1)
	go func() {
		defer keeper.Done()
		w.keepAlive(keeperCtx)
	}()
	w.log.Info("consumer started", "lease_ms", w.cfg.Lease.Milliseconds())
	ready <- struct{}{} // buffered for every consumer

	lastWork := time.Now()
	for ctx.Err() == nil {
		if w.cfg.ExitAfterIdle > 0 && time.Since(lastWork) > w.cfg.ExitAfterIdle {
			w.log.Info("idle; stopping", "idle_ms", w.cfg.ExitAfterIdle.Milliseconds())
			break
		}
		streams, err := w.read(bg)
		if err == nil && len(streams) == 0 {
			err = w.wait(ctx)
		}
		if err != nil {
			if strings.Contains(err.Error(), "NOGROUP") || strings.Contains(err.Error(), "no such key") {
				if err := w.ensureGroups(bg); err != nil {
					w.log.Warn("creating the consumer groups failed; retrying", "error", err.Error())
					sleep(ctx, time.Second)
				}
				continue
			}
			if ctx.Err() != nil {
				break
			}
			w.log.Warn("read failed; retrying", "error", err.Error())
			sleep(ctx, time.Second)
			continue
		}
		if len(streams) > 0 {
			lastWork = time.Now()
			w.processBatch(ctx, streams) // entries left when ctx ends stay pending: put back below
			lastWork = time.Now()
		}
	}
	returned := w.requeueOwnPending(bg)
	stopKeeper()
	keeper.Wait()
	if err := w.client.Del(bg, w.keys.Consumer(w.cfg.Consumer)).Err(); err != nil {
		w.log.Warn("could not delete the liveness key", "error", err.Error())
	}
	w.log.Info("worker stopped", "requeued", returned)
	return nil
}

func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

func (w *Worker) ensureGroups(ctx context.Context) error {
	for _, stream := range w.queue.TaskStreams() {
		err := w.client.XGroupCreateMkStream(ctx, stream, w.cfg.Group, "0").Err()
		if err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") {
			return fmt.Errorf("XGROUP CREATE %s: %w", stream, err)
		}
	}
	return nil
}

// read takes at most exactly Prefetch new entries with read.lua, most urgent
// stream first, without blocking.
func (w *Worker) read(ctx context.Context) ([]redis.XStream, error) {
	res, err := w.scripts.Get("read").Run(ctx, w.client, w.queue.TaskStreams(),
		w.cfg.Group, w.cfg.Consumer, w.cfg.Prefetch).Result()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return parseStreams(res)
}

// wait blocks up to Block until one of the task streams has entries the group
// has not delivered yet. It takes none (XREAD from the group's last-delivered
// ids, not XREADGROUP), so the next read.lua takes exactly Prefetch entries
// whatever the Redis version and however many streams have entries.
func (w *Worker) wait(ctx context.Context) error {
	streams := w.queue.TaskStreams()
	cmds := make([]*redis.XInfoGroupsCmd, len(streams))
	_, err := w.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, s := range streams {
			cmds[i] = p.XInfoGroups(ctx, s)
		}
		return nil
	})
	if err != nil {
		return err
	}
	args := slices.Clone(streams)
	for i, cmd := range cmds {
		last := ""
		for _, g := range cmd.Val() {
			if g.Name == w.cfg.Group {
				last = g.LastDeliveredID
			}
		}
		if last == "" {
			return fmt.Errorf("NOGROUP: group %s is missing on %s", w.cfg.Group, streams[i])
		}
		args = append(args, last)
	}
	err = w.client.XRead(ctx, &redis.XReadArgs{Streams: args, Count: 1, Block: w.cfg.Block}).Err()
	if errors.Is(err, redis.Nil) || (err != nil && ctx.Err() != nil) {
		return nil
	}
	return err
}

// parseStreams reads the XREADGROUP-shaped reply of read.lua.
func parseStreams(reply any) ([]redis.XStream, error) {
	bad := func() ([]redis.XStream, error) { return nil, fmt.Errorf("read.lua: unexpected reply %v", reply) }
	list, ok := reply.([]any)
	if !ok {
		return bad()
	}
	var out []redis.XStream
	for _, item := range list {
		pair, ok := item.([]any)
		if !ok || len(pair) != 2 {
			return bad()
		}
		name, ok := pair[0].(string)
		entries, ok2 := pair[1].([]any)
		if !ok || !ok2 {
			return bad()
		}
		s := redis.XStream{Stream: name}
		for _, raw := range entries {
			entry, ok := raw.([]any)
			if !ok || len(entry) != 2 {
				return bad()
			}
			id, _ := entry[0].(string)
			values := map[string]any{}
			if flat, ok := entry[1].([]any); ok {
				for i := 0; i+1 < len(flat); i += 2 {
					if k, ok := flat[i].(string); ok {
						values[k] = flat[i+1]
					}
				}
			}
			s.Messages = append(s.Messages, redis.XMessage{ID: id, Values: values})
		}
		out = append(out, s)
	}
	return out, nil
}

// --- liveness and takeover -------------------------------------------------------

func (w *Worker) renew(ctx context.Context) error {
	value := fmt.Sprintf("%s %s %s", w.host, w.pid, Language)
	return w.client.Set(ctx, w.keys.Consumer(w.cfg.Consumer), value, w.cfg.Lease).Err()
}

// keepAlive renews the liveness key every lease/3, whatever the tasks do, and
// takes over the entries of dead consumers.
func (w *Worker) keepAlive(ctx context.Context) {
	ticker := time.NewTicker(w.cfg.Lease / 3)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
		if err := w.renew(ctx); err != nil && ctx.Err() == nil {
			w.log.Warn("liveness renewal failed", "error", err.Error())
			continue
		}
		if n, err := w.TakeOverDeadConsumers(ctx); err != nil && ctx.Err() == nil {
			w.log.Warn("takeover failed", "error", err.Error())
		} else if n > 0 {
			w.log.Warn("took over entries of dead consumers", "entries", n)
		}
	}
}

// TakeOverDeadConsumers puts back the entries held by consumers whose liveness
// key is gone and that were idle for a lease, and forgets dead consumers that
// hold nothing and were idle for ForgetAfter; it returns how many entries it
// moved (requeued or dead-lettered).
func (w *Worker) TakeOverDeadConsumers(ctx context.Context) (int, error) {
	moved := 0
	for _, stream := range w.queue.TaskStreams() {
		summary, err := w.client.XPending(ctx, stream, w.cfg.Group).Result()
		if err != nil {
			if strings.Contains(err.Error(), "NOGROUP") || errors.Is(err, redis.Nil) {
				continue
			}
			return moved, err
		}
		for owner := range summary.Consumers {
			if owner == w.cfg.Consumer {
				continue
			}
			alive, err := w.client.Exists(ctx, w.keys.Consumer(owner)).Result()
			if err != nil {
				return moved, err
			}
			if alive == 1 {
				continue
			}
			n, err := w.takeOver(ctx, stream, owner)
			moved += n
			if err != nil {
				return moved, err
			}
		}
		if err := w.forgetDeadConsumers(ctx, stream); err != nil {
			return moved, err
		}
	}
	return moved, nil
}

// deadLetterWho are the failure fields requeue.lua adds to a redelivery_limit
// dead-letter entry (docs/protocol.md sections 5 and 7); consumer is the one
// that died holding the entry.
func (w *Worker) deadLetterWho(owner string) []any {
	now := Now().String()
	return []any{"queue", w.cfg.Queue, "language", Language, "host", w.host, "pid", w.pid,
		"consumer", owner, "first_failure_at", now, "last_failure_at", now}
}

func (w *Worker) takeOver(ctx context.Context, stream, owner string) (int, error) {
	const batch = 100
	pending, err := w.client.XPendingExt(ctx, &redis.XPendingExtArgs{
		Stream: stream, Group: w.cfg.Group, Idle: w.cfg.Lease, Start: "-", End: "+",
		Count: batch, Consumer: owner,
	}).Result()
	if err != nil {
		return 0, err
	}
	moved := 0
	for _, p := range pending {
		args := append([]any{w.cfg.Group, p.ID, owner, w.cfg.Lease.Milliseconds(), 1,
			w.cfg.MaxRedeliveries, Now().String()}, w.deadLetterWho(owner)...)
		res, err := w.scripts.Get("requeue").Run(ctx, w.client,
			[]string{stream, stream, w.queue.Dead()}, args...).Text()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			return moved, err
		}
		moved++
		if strings.HasPrefix(res, "dead:") {
			if err := w.client.SAdd(ctx, w.keys.DeadQueues(), w.cfg.Queue).Err(); err != nil {
				return moved, err
			}
			deadID := strings.TrimPrefix(res, "dead:")
			w.log.Error("entry of a dead consumer dead-lettered: redelivery limit reached",
				"outcome", "dead", "failure_class", ClassRedeliveryLimit, "owner", owner,
				"stream", stream, "entry_id", p.ID, "dead_id", deadID)
			w.failRedelivered(ctx, deadID)
			continue
		}
		w.log.Warn("took over entry of dead consumer", "owner", owner, "stream", stream,
			"entry_id", p.ID, "new_id", res)
	}
	return moved, nil
}

// failRedelivered writes the FAILURE result of a task requeue.lua dead-lettered
// as redelivery_limit, reading the task back from its dead-letter entry (the
// script moved it atomically, so the result follows the move).
func (w *Worker) failRedelivered(ctx context.Context, deadID string) {
	msgs, err := w.client.XRange(ctx, w.queue.Dead(), deadID, deadID).Result()
	if err != nil || len(msgs) != 1 {
		w.log.Warn("reading a dead-letter entry back for its result failed", "dead_id", deadID, "error", fmt.Sprint(err))
		return
	}
	fields := textFields(msgs[0].Values)
	raw := map[string]string{}
	for k, v := range fields {
		if name, ok := strings.CutPrefix(k, "raw."); ok {
			raw[name] = v
		}
	}
	env, err := DecodeEntry(raw, w.cfg.Limits)
	if err != nil {
		return // malformed: no task to write a result for
	}
	log := w.log.With("task_id", env.TaskID, "trace_id", env.TraceID, "task_type", env.TaskType)
	w.results.write(ctx, log, env, failed(failure{class: ClassRedeliveryLimit, reason: fields["reason"]}))
}

// forgetDeadConsumers removes from the group, with forget_consumer.lua (which
// re-checks atomically that the consumer holds nothing and is idle long
// enough), the consumers of stream without a liveness key that were idle for
// ForgetAfter. Never a bare XGROUP DELCONSUMER: it would drop entries such a
// consumer read in the meantime.
func (w *Worker) forgetDeadConsumers(ctx context.Context, stream string) error {
	idle := max(w.cfg.ForgetAfter, w.cfg.Lease)
	consumers, err := w.client.XInfoConsumers(ctx, stream, w.cfg.Group).Result()
	if err != nil {
		if strings.Contains(err.Error(), "NOGROUP") || strings.Contains(err.Error(), "no such key") {
			return nil
		}
		return err
	}
	for _, c := range consumers {
		if c.Name == w.cfg.Consumer || c.Pending > 0 || c.Idle < idle {
			continue
		}
		alive, err := w.client.Exists(ctx, w.keys.Consumer(c.Name)).Result()
		if err != nil {
			return err
		}
		if alive == 1 {
			continue
		}
		forgotten, err := w.scripts.Get("forget_consumer").Run(ctx, w.client, []string{stream},
			w.cfg.Group, c.Name, idle.Milliseconds()).Int()
		if err != nil {
			return err
		}
		if forgotten == 1 {
			w.log.Info("forgot a dead consumer that held nothing", "stream", stream, "owner", c.Name,
				"idle_ms", c.Idle.Milliseconds())
		}
	}
	return nil
}

// requeueOwnPending puts back every entry this consumer read but did not settle.
func (w *Worker) requeueOwnPending(ctx context.Context) int {
	moved := 0
	for _, stream := range w.queue.TaskStreams() {
		pending, err := w.client.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: stream, Group: w.cfg.Group, Start: "-", End: "+", Count: 10000,
			Consumer: w.cfg.Consumer,
		}).Result()
		if err != nil {
			w.log.Warn("listing own pending entries failed", "stream", stream, "error", err.Error())
			continue
		}
		for _, p := range pending {
			err := w.scripts.Get("requeue").Run(ctx, w.client,
				[]string{stream, stream, w.queue.Dead()},
				w.cfg.Group, p.ID, "", 0, 0, 0, Now().String()).Err()
			if err != nil && !errors.Is(err, redis.Nil) {
				w.log.Warn("putting an entry back failed", "entry_id", p.ID, "error", err.Error())
				continue
			}
			moved++
			w.log.Info("put back an unstarted entry", "stream", stream, "entry_id", p.ID)
		}
	}
	return moved
}

// --- one entry -------------------------------------------------------------------

func textFields(values map[string]any) map[string]string {
	fields := make(map[string]string, len(values))
	for k, v := range values {
		switch s := v.(type) {
		case string:
			fields[k] = s
		case []byte:
			fields[k] = string(s)
		default:
			fields[k] = fmt.Sprint(v)
		}
	}
	return fields
}

// entry is an entry being handled and what is known about its failures.
type entry struct {
	stream, id string
	fields     map[string]string
	env        *Envelope
	log        *slog.Logger
}

// safely runs one entry's step; a panic is logged and the entry stays pending
// (it goes back to its stream when this consumer stops).
func (w *Worker) safely(entryID string, step func()) {
	defer func() {
		if r := recover(); r != nil {
			w.log.Error("internal error handling an entry", "entry_id", entryID, "panic", fmt.Sprint(r),
				"stack", string(debug.Stack()))
		}
	}()
	step()
}

// processBatch applies docs/protocol.md section 5.1 to the entries of one read:
// decode and validate (malformed entries are dead-lettered), move entries not
// due yet to the delayed set, look the task ids up in the cancel marks in one
// ZMSCORE, then handle each remaining entry in turn: a cancelled or expired
// one is acknowledged without running. It stops when ctx ends;
// entries not started stay pending.
func (w *Worker) processBatch(ctx context.Context, streams []redis.XStream) {
	bg := context.Background()
	var due []*entry
	for _, s := range streams {
		for _, m := range s.Messages {
			if ctx.Err() != nil {
				return
			}
			w.safely(m.ID, func() {
				if e := w.admit(bg, s.Stream, m); e != nil {
					due = append(due, e)
				}
			})
		}
	}
	cancelled := w.cancelledAmong(bg, due)
	for _, e := range due {
		if ctx.Err() != nil {
			return
		}
		w.safely(e.id, func() {
			switch {
			case cancelled[e.env.TaskID]:
				w.revoke(bg, e, revokedCancelled)
			case e.env.IsExpired(time.Now().UTC()):
				w.revoke(bg, e, revokedExpired)
			default:
				w.handle(bg, e)
			}
		})
	}
}

// admit decodes one entry (steps 1 and 2 of section 5.1). It returns the entry
// when it is due, nil when it was dead-lettered or moved to the delayed set.
func (w *Worker) admit(ctx context.Context, stream string, m redis.XMessage) *entry {
	fields := textFields(m.Values)
	env, err := DecodeEntry(fields, w.cfg.Limits)
	if err != nil {
		w.log.Error("malformed entry", "stream", stream, "entry_id", m.ID, "reason", err.Error())
		w.deadLetter(ctx, &entry{stream: stream, id: m.ID, fields: fields, log: w.log},
			failure{class: ClassMalformedEntry, reason: err.Error(), exceptionType: "MalformedEntry"})
		return nil
	}
	e := &entry{stream: stream, id: m.ID, fields: fields, env: env,
		log: w.log.With("task_id", env.TaskID, "trace_id", env.TraceID, "task_type", env.TaskType,
			"entry_id", m.ID)}
	if now := time.Now(); !env.IsDue(now) {
		w.reschedule(ctx, e, now)
		return nil
	}
	return e
}

// cancelledAmong looks the task ids of entries up in the cancel marks of every
// queue with one ZMSCORE (section 10). On an error nothing counts as cancelled.
func (w *Worker) cancelledAmong(ctx context.Context, entries []*entry) map[string]bool {
	if len(entries) == 0 {
		return nil
	}
	args := []any{"ZMSCORE", w.keys.Cancelled()}
	for _, e := range entries {
		args = append(args, e.env.TaskID)
	}
	res, err := w.client.Do(ctx, args...).Slice()
	if err != nil {
		w.log.Warn("cancel check failed; running the tasks", "error", err.Error())
		return nil
	}
	marked := map[string]bool{}
	for i, score := range res {
		if score != nil && i < len(entries) {
			marked[entries[i].env.TaskID] = true
		}
	}
	return marked
}

// revoke acknowledges a cancelled or expired task without running it (section
// 5.1, step 3), after writing its REVOKED result when one is asked for. The
// cancel mark stays: the same id published again is not run either.
func (w *Worker) revoke(ctx context.Context, e *entry, why string) {
	w.results.write(ctx, e.log, e.env, revoked(why))
	w.ack(ctx, e)
	if why == revokedExpired {
		e.log.Info("expired task acknowledged without running it", "outcome", "expired",
			"expires", e.env.Expires.String())
		return
	}
	e.log.Info("cancelled task acknowledged without running it", "outcome", "cancelled")
}

// handle applies steps 4 to 6 of section 5.1 to a due entry that is not
// cancelled: handler and payload_version, idempotency claim, retry slot, run.
func (w *Worker) handle(ctx context.Context, e *entry) {
	env := e.env
	h, ok := w.handlers[env.TaskType]
	if !ok {
		w.deadLetter(ctx, e, w.notRun(e, ClassUnknownTaskType,
			fmt.Sprintf("no handler for task_type %q in this worker", env.TaskType)))
		return
	}
	if !slices.Contains(h.versions, env.PayloadVersion) {
		w.deadLetter(ctx, e, w.notRun(e, ClassUnsupportedPayloadVersion,
			fmt.Sprintf("payload_version %d is not accepted (accepted: %v)", env.PayloadVersion, h.versions)))
		return
	}
	task := &Task{Envelope: env, Queue: w.cfg.Queue, Stream: e.stream, EntryID: e.id, Log: e.log}
	task.Redelivered, _ = strconv.Atoi(e.fields[FieldRedeliver])

	holder := ""
	if env.IdempotencyKey != nil {
		var proceed bool
		holder, proceed = w.claim(ctx, e, task)
		if !proceed {
			return
		}
	}

	if env.RetryCount > 0 && AsksForTiered(env) { // the cap belongs to the tiered policy
		slot := w.keys.Retrying(env.TaskType)
		hold := w.cfg.SlotHold
		if env.TimeoutMS != nil {
			hold = time.Duration(*env.TimeoutMS) * time.Millisecond
		}
		got, err := w.scripts.Get("retry_slot").Run(ctx, w.client, []string{slot},
			env.TaskID, w.cfg.RetryConcurrency, hold.Milliseconds()).Int()
		if err != nil {
			e.log.Warn("retry slot check failed; running anyway", "error", err.Error())
		} else if got == 0 {
			if holder != "" {
				w.finishIdem(ctx, e, holder, "release")
			}
			// The backoff tier with next = retry_count: the count does not change.
			delay := w.cfg.Retry.BackoffDelay(env.RetryCount, FastRetriesTaken(env))
			e.log.Info("retry slots of this task type are all taken; rescheduled",
				"delay_ms", delay.Milliseconds())
			w.replace(ctx, e, w.deferred(env, delay), delay)
			return
		} else {
			defer func() {
				if err := w.client.ZRem(context.Background(), slot, env.TaskID).Err(); err != nil {
					e.log.Warn("releasing the retry slot failed", "error", err.Error())
				}
			}()
		}
	}

	e.log.Info("task started", "retry_count", env.RetryCount, "redelivered", task.Redelivered)
	started := time.Now()
	value, err := w.run(h.run, task)
	elapsed := time.Since(started)
	var result json.RawMessage
	if err == nil && asksForResult(env) {
		result, err = encodeResult(value)
	}
	if err == nil {
		if holder != "" {
			w.finishIdem(ctx, e, holder, "done")
		}
		w.results.write(ctx, e.log, env, succeeded(result))
		w.ack(ctx, e)
		e.log.Info("task succeeded", "outcome", "success", "duration_ms", elapsed.Milliseconds(),
			"retry_count", env.RetryCount)
		return
	}
	if holder != "" {
		w.finishIdem(ctx, e, holder, "release")
	}
	w.fail(ctx, e, err, elapsed)
}

// firstFailure is when the task first failed: the x-first-failure-at header
// carried by retries, else now.
func firstFailure(env *Envelope, now time.Time) time.Time {
	if t, err := ParseTimestamp(env.Headers[HeaderFirstFailureAt]); err == nil {
		return t.Time
	}
	return now
}

// notRun describes a task dead-lettered before its handler ran.
func (w *Worker) notRun(e *entry, class, reason string) failure {
	now := time.Now()
	return failure{class: class, reason: reason, attempts: e.env.RetryCount + 1,
		firstFailure: firstFailure(e.env, now), lastFailure: now}
}

// claim applies docs/protocol.md section 9; it answers the holder and whether to run.
func (w *Worker) claim(ctx context.Context, e *entry, task *Task) (string, bool) {
	env := e.env
	key := w.keys.Idempotency(env.TaskType, *env.IdempotencyKey)
	holder := w.cfg.Consumer + " " + env.TaskID
	claimFor := w.cfg.IdemClaim
	if env.TimeoutMS != nil {
		claimFor = time.Duration(*env.TimeoutMS)*time.Millisecond + w.cfg.Lease
	}
	replace := ""
	for round := 0; round < 2; round++ {
		res, err := w.scripts.Get("idem_begin").Run(ctx, w.client, []string{key},
			holder, claimFor.Milliseconds(), replace).StringSlice()
		if err != nil || len(res) == 0 {
			e.log.Warn("idempotency claim failed; deferring", "error", fmt.Sprint(err))
			w.replace(ctx, e, w.deferred(env, w.cfg.DeferDelay), w.cfg.DeferDelay)
			return "", false
		}
		switch res[0] {
		case "acquired":
			return holder, true
		case "done":
			w.results.write(ctx, e.log, env, succeeded(nil))
			w.ack(ctx, e)
			e.log.Info("duplicate: the effect already happened; acknowledged without running",
				"outcome", "duplicate", "idempotency_key", *env.IdempotencyKey, "marker", res[1])
			if w.cfg.OnDuplicate != nil {
				w.cfg.OnDuplicate(ctx, task)
			}
			return "", false
		case "busy":
			other := res[1]
			owner := other
			if i := strings.LastIndexByte(other, ' '); i >= 0 {
				owner = other[:i]
			}
			alive, err := w.client.Exists(ctx, w.keys.Consumer(owner)).Result()
			if err == nil && alive == 0 && round == 0 {
				e.log.Warn("idempotency holder is dead; taking the claim over", "holder", other)
				replace = other
				continue
			}
			e.log.Info("another consumer runs this idempotency key; deferred",
				"holder", other, "delay_ms", w.cfg.DeferDelay.Milliseconds())
			w.replace(ctx, e, w.deferred(env, w.cfg.DeferDelay), w.cfg.DeferDelay)
			return "", false
		}
	}
	w.replace(ctx, e, w.deferred(env, w.cfg.DeferDelay), w.cfg.DeferDelay)
	return "", false
}

func (w *Worker) finishIdem(ctx context.Context, e *entry, holder, how string) {
	key := w.keys.Idempotency(e.env.TaskType, *e.env.IdempotencyKey)
	w.settle(e, "idem_finish "+how, func() error {
		n, err := w.scripts.Get("idem_finish").Run(ctx, w.client, []string{key},
			holder, how, w.cfg.IdemDoneTTL.Milliseconds(), Now().String()).Int()
		if err == nil && n == 0 {
			e.log.Warn("the idempotency claim had been taken over: the task may have run twice",
				"idempotency_key", *e.env.IdempotencyKey)
		}
		return err
	})
}

// run calls the handler with the attempt's deadline; a handler that outlives
// its deadline is abandoned (it should honour ctx) and the attempt times out.
func (w *Worker) run(fn ResultHandlerFunc, task *Task) (any, error) {
	ctx, cancel := ContextWithTraceID(context.Background(), task.TraceID), context.CancelFunc(func() {})
	if task.TimeoutMS != nil {
		ctx, cancel = context.WithTimeout(ctx, time.Duration(*task.TimeoutMS)*time.Millisecond)
	}
	defer cancel()
	type attempt struct {
		value any
		err   error
	}
	done := make(chan attempt, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				done <- attempt{err: &PanicError{Value: r, Stack: string(debug.Stack())}}
			}
		}()
		value, err := fn(ctx, task)
		done <- attempt{value, err}
	}()
	select {
	case a := <-done:
		if a.err != nil && task.TimeoutMS != nil && isTimeout(ctx, a.err) {
			return nil, &TimeoutError{TimeoutMS: *task.TimeoutMS, Err: a.err}
		}
		return a.value, a.err
	case <-ctx.Done():
		task.Log.Warn("attempt exceeded timeout_ms; abandoned", "timeout_ms", *task.TimeoutMS)
		return nil, &TimeoutError{TimeoutMS: *task.TimeoutMS, Err: ctx.Err()}
	}
}

// PanicError is a handler that panicked.
type PanicError struct {
	Value any
	Stack string
}

func (e *PanicError) Error() string { return fmt.Sprintf("panic: %v", e.Value) }

// TimeoutError is an attempt stopped at timeout_ms.
type TimeoutError struct {
	TimeoutMS int64
	Err       error
}

func (e *TimeoutError) Error() string {
	return fmt.Sprintf("attempt exceeded timeout_ms %d: %v", e.TimeoutMS, e.Err)
}
func (e *TimeoutError) Unwrap() error { return e.Err }

// ExceptionType names an error's type for the dead-letter entry: its
// ExceptionType() method if it has one, else its Go type.
func ExceptionType(err error) string {
	var named interface{ ExceptionType() string }
	if errors.As(err, &named) {
		return named.ExceptionType()
	}
	var perm *Permanent
	if errors.As(err, &perm) {
		err = perm.Err
	}
	var tr *transientError
	if errors.As(err, &tr) {
		err = tr.err
	}
	return fmt.Sprintf("%T", err)
}

func (w *Worker) fail(ctx context.Context, e *entry, err error, elapsed time.Duration) {
	env := e.env
	now := time.Now()
	first := firstFailure(env, now)
	f := failure{reason: err.Error(), message: err.Error(), exceptionType: ExceptionType(err),
		attempts: env.RetryCount + 1, firstFailure: first, lastFailure: now}
	var panicErr *PanicError
	if errors.As(err, &panicErr) {
		f.traceback = panicErr.Stack
	}
	var perm *Permanent
	if errors.As(err, &perm) {
		f.class = perm.Class
		e.log.Error("task failed permanently", "outcome", "dead", "error", err.Error())
		w.deadLetter(ctx, e, f)
		return
	}
	kind := KindTaskError
	var timeout *TimeoutError
	switch {
	case errors.As(err, &timeout):
		kind = KindTimeout
	case w.cfg.IsTransient(err):
		kind = KindTransient
	}
	d := w.cfg.Retry.Decide(env, kind)
	if d.Action == DeadLetter {
		f.class = d.Class
		f.reason = d.ExhaustedMsg + ": " + err.Error()
		e.log.Error("task failed; retries exhausted", "outcome", "dead", "failure_class", d.Class,
			"error", err.Error(), "attempts", f.attempts)
		w.deadLetter(ctx, e, f)
		return
	}
	next := NextAttempt(env, d, now)
	// The first failure's time travels with the retries (set on the first failure).
	if _, err := ParseTimestamp(next.Headers[HeaderFirstFailureAt]); err != nil {
		next.Headers[HeaderFirstFailureAt] = NewTimestamp(first.UTC()).String()
	}
	e.log.Warn("task failed; retrying", "outcome", "retry", "error", err.Error(),
		"retry_count", d.Next, "fast", d.Action == RetryNow, "delay_ms", d.Delay.Milliseconds(),
		"duration_ms", elapsed.Milliseconds())
	w.replace(ctx, e, next, d.Delay)
}

// deferred is env pushed back by delay, retry_count unchanged.
func (w *Worker) deferred(env *Envelope, delay time.Duration) *Envelope {
	n := env.Clone()
	n.ScheduleTime = scheduleAfter(time.Now(), delay)
	return n
}

// replace swaps the pending entry for next atomically with retry.lua. A
// delayed next attempt also registers the queue (SADD <prefix>:queues) in the
// same round trip.
func (w *Worker) replace(ctx context.Context, e *entry, next *Envelope, delay time.Duration) {
	enc, body, err := EncodeBody(next, w.cfg.GzipMin, w.cfg.Limits)
	if err != nil {
		w.deadLetter(ctx, e, failure{class: ClassTaskError, reason: "cannot write the next attempt: " + err.Error(),
			attempts: e.env.RetryCount + 1})
		return
	}
	due := int64(0)
	if next.ScheduleTime != nil && delay > 0 {
		due = next.ScheduleTime.UnixMilli()
	}
	bucket := BucketFor(next.Priority)
	w.settle(e, "retry.lua", func() error {
		var stored *redis.Cmd
		_, err := w.client.Pipelined(ctx, func(p redis.Pipeliner) error {
			if due > 0 {
				p.SAdd(ctx, w.keys.Queues(), w.cfg.Queue)
			}
			stored = w.scripts.Get("retry").Eval(ctx, p,
				[]string{e.stream, w.queue.Stream(bucket), w.queue.Delayed(), w.queue.DelayedData()},
				w.cfg.Group, e.id, next.TaskID, due, string(bucket), enc, string(body), w.keys.Wakeup())
			return nil
		})
		if err != nil && !errors.Is(err, redis.Nil) {
			return err
		}
		if errors.Is(stored.Err(), redis.Nil) {
			e.log.Warn("entry was no longer pending when replaced (taken over?)")
		}
		return nil
	})
}

// reschedule moves an entry that is not due yet to the delayed set, byte for
// byte, registering the queue for promotion in the same transaction.
func (w *Worker) reschedule(ctx context.Context, e *entry, now time.Time) {
	bucket := BucketFor(e.env.Priority)
	w.settle(e, "reschedule", func() error {
		_, err := w.client.TxPipelined(ctx, func(p redis.Pipeliner) error {
			StoreDelayed(ctx, p, w.scripts, w.keys, w.cfg.Queue, e.env.TaskID, e.env.DueMS(now), bucket,
				e.fields[FieldEncoding], []byte(e.fields[FieldBody]), "entry:"+e.id)
			p.XAck(ctx, e.stream, w.cfg.Group, e.id)
			p.XDel(ctx, e.stream, e.id)
			return nil
		})
		return err
	})
	e.log.Info("task not due yet; moved to the delayed set", "outcome", "scheduled",
		"schedule_time", e.env.ScheduleTime.String())
}

func (w *Worker) ack(ctx context.Context, e *entry) {
	w.settle(e, "ack", func() error {
		var acked *redis.IntCmd
		_, err := w.client.TxPipelined(ctx, func(p redis.Pipeliner) error {
			acked = p.XAck(ctx, e.stream, w.cfg.Group, e.id)
			p.XDel(ctx, e.stream, e.id)
			return nil
		})
		if err == nil && acked.Val() == 0 {
			e.log.Warn("ack answered 0: the entry was taken over while this consumer looked dead")
		}
		return err
	})
}

// failure describes a dead-letter entry (docs/protocol.md section 7); message
// is the handler error's message when one caused it.
type failure struct {
	class, reason, message, exceptionType, traceback string
	attempts                                         int64
	firstFailure, lastFailure                        time.Time
}

// deadLetterFields are the failure fields of a dead-letter entry, in order;
// dead_letter.lua appends the raw.* fields itself.
func (w *Worker) deadLetterFields(e *entry, f failure) []any {
	now := time.Now()
	if f.firstFailure.IsZero() {
		f.firstFailure = now
	}
	if f.lastFailure.IsZero() {
		f.lastFailure = now
	}
	fields := []any{
		"dlq", "1",
		"failure_class", f.class,
		"reason", f.reason,
		"queue", w.cfg.Queue,
		"dead_at", NewTimestamp(now.UTC()).String(),
		"language", Language,
		"host", w.host,
		"pid", w.pid,
		"consumer", w.cfg.Consumer,
		"first_failure_at", NewTimestamp(f.firstFailure.UTC()).String(),
		"last_failure_at", NewTimestamp(f.lastFailure.UTC()).String(),
	}
	if f.exceptionType != "" {
		fields = append(fields, "exception_type", f.exceptionType)
	}
	if f.traceback != "" {
		fields = append(fields, "traceback", f.traceback)
	}
	if f.attempts > 0 {
		fields = append(fields, "attempts", strconv.FormatInt(f.attempts, 10))
	}
	if e.env != nil {
		fields = append(fields, "task_id", e.env.TaskID, "task_type", e.env.TaskType)
	}
	return fields
}

// deadLetter moves the entry to the dead-letter stream with dead_letter.lua,
// after writing the FAILURE result of a decoded task that asks for one.
func (w *Worker) deadLetter(ctx context.Context, e *entry, f failure) {
	if e.env != nil {
		w.results.write(ctx, e.log, e.env, failed(f))
	}
	args := append([]any{w.cfg.Group, e.id}, w.deadLetterFields(e, f)...)
	var deadID string
	w.settle(e, "dead_letter.lua", func() error {
		id, err := w.scripts.Get("dead_letter").Run(ctx, w.client,
			[]string{e.stream, w.queue.Dead()}, args...).Text()
		if errors.Is(err, redis.Nil) {
			e.log.Warn("entry was no longer pending when dead-lettered (taken over?)")
			return nil
		}
		if err != nil {
			return err
		}
		deadID = id
		return w.client.SAdd(ctx, w.keys.DeadQueues(), w.cfg.Queue).Err()
	})
	e.log.Error("entry dead-lettered", "outcome", "dead", "failure_class", f.class,
		"reason", f.reason, "dead_id", deadID)
}

// settle runs a step that ends an entry's handling, retrying Redis errors for
// a while: an entry is never dropped, at worst it stays pending until this
// consumer stops and it is put back.
func (w *Worker) settle(e *entry, what string, step func() error) {
	if err := retryOutage(e.log, what, step); err != nil {
		e.log.Error("giving up on a step; the entry stays pending", "step", what, "error", err.Error())
	}
}

// retryOutage runs step, retrying its errors for about 15 s (Redis away or
// loading); it returns the last error.
func retryOutage(log *slog.Logger, what string, step func() error) error {
	delay := 100 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := step()
		if err == nil || attempt == 10 {
			return err
		}
		log.Warn("step failed; retrying", "step", what, "error", err.Error())
		time.Sleep(delay)
		delay = min(2*delay, 3*time.Second)
	}
}
