package envelope

import (
	"cmp"
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
	"go.opentelemetry.io/otel/trace"
)

// Language is written in liveness keys and dead-letter entries.
const Language = "go"

// HandlerFunc runs one attempt of a task. Return nil on success. An error is
// final unless the Envelope asks for automatic retries (x-retry-policy:
// tiered); then wrap it with Transient to retry it on the fast tier, with
// InvalidPayload or Reject to dead-letter it at once. ctx ends when timeout_ms
// passes, and carries the task's trace id (TraceIDFromContext) and its trace
// context (headers.traceparent, in a "process <queue>" span where
// OpenTelemetry is installed), which PublishTask stamps on the tasks the
// handler publishes. A task that asks for
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
	Prefix string
	Queue  string // the one queue consumed; or set Queues
	// Queues are the queues consumed, served in this order: an earlier queue
	// gets the credit first, a later one what is left (Celery's -Q order).
	Queues   []string
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
	Durability    Durability    // replicas each idempotency claim and settled entry (ack, retry, dead letter) waits for
	ExitAfterIdle time.Duration // stop after this long without entries (0: never)

	// Concurrency is how many tasks the Worker runs at once (1): it runs that
	// many consumers, "<Consumer>-<i>", each with its own liveness key and
	// Prefetch, sharing the handlers.
	Concurrency int

	// ResultBackend is the Redis of Celery's result backend, where the results
	// Celery callers ask for (ext.celery.result) are written. nil: they are not
	// written, which is logged once per task type.
	ResultBackend redis.UniversalClient

	// TaskRecordRetention is how long the record of a task that ended is kept
	// (docs/protocol.md section 14): 0 is DefaultTaskRecordRetention, NoTaskRecords
	// writes none.
	TaskRecordRetention time.Duration
	// SchemaCache is how long the payload schemas read are used (section 16): 0 is DefaultSchemaCache.
	SchemaCache time.Duration

	// TracerProvider makes the "process <queue>" spans (docs/protocol.md section
	// 18); nil: OpenTelemetry's global provider (no spans until an SDK is installed).
	TracerProvider trace.TracerProvider

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

// Worker consumes one or several queues (docs/protocol.md sections 5-10).
type Worker struct {
	cfg      Config
	client   redis.UniversalClient
	scripts  Scripts
	keys     KeySpace
	queues   []QueueKeys          // in the order they are served
	byStream map[string]QueueKeys // the queue of each task stream
	watch    *steadyWatch         // shared by the consumers of one Worker
	handlers map[string]handler
	results  *results        // shared by the consumers of one Worker
	schemas  *PayloadSchemas // shared by the consumers of one Worker
	records  records
	stats    *Stats // this consumer's, written with its renewals
	log      *slog.Logger
	host     string
	pid      string
	// startedAt is when this consumer started, for its announcement.
	startedAt time.Time

	stopOnce sync.Once
	stop     chan struct{} // closed by Shutdown
	runs     sync.WaitGroup

	// Idempotency keys (Redis keys) an attempt of this consumer claims, from just before
	// idem_begin.lua until the claim is settled (for an abandoned attempt, once its
	// handler returned). A claim is re-entrant for its holder, so this consumer defers
	// an attempt whose key is marked itself (docs/protocol.md section 9).
	claimedMu sync.Mutex
	claimed   map[string]bool
	abandoned sync.WaitGroup // abandoned attempts still running: the consumer stays alive

	limitStates map[string]limitState // by queue, from its last read (read and consume loop only)
	slots       heldSlots             // renewed by keepAlive
}

// NewWorker returns a worker for cfg.Queue or cfg.Queues; register handlers,
// then Run it. It adds a hook to client that counts its dials, to tell a
// renewal answered at once from one that waited for Redis.
func NewWorker(client redis.UniversalClient, scripts Scripts, cfg Config) (*Worker, error) {
	queues, err := cfg.queueNames()
	if err != nil {
		return nil, err
	}
	cfg.Queues = queues
	if strings.ContainsAny(cfg.Consumer, " \t\r\n") {
		return nil, fmt.Errorf("consumer name %q must not contain spaces", cfg.Consumer)
	}
	if cfg.Consumer == ParkedConsumer {
		return nil, fmt.Errorf("consumer name %q is reserved for the entries waiting for their limits", cfg.Consumer)
	}
	if err := cfg.Durability.check(client); err != nil {
		return nil, err
	}
	cfg.defaults()
	schemas := &PayloadSchemas{Client: client, Keys: KeySpace{cfg.Prefix}, Cache: cfg.SchemaCache, Log: cfg.Logger}
	return newWorker(client, scripts, cfg, map[string]handler{}, &results{backend: cfg.ResultBackend},
		schemas, watchClient(client, cfg.Lease/3)), nil
}

// queueNames are the queues of c, checked, in the order they are served.
func (c *Config) queueNames() ([]string, error) {
	names := c.Queues
	switch {
	case len(names) == 0:
		names = []string{c.Queue}
	case c.Queue != "":
		return nil, errors.New("config: set Queue (one queue) or Queues (several), not both")
	}
	seen := map[string]bool{}
	for _, q := range names {
		if err := CheckQueueName(q); err != nil {
			return nil, err
		}
		if seen[q] {
			return nil, fmt.Errorf("config: queue %q is listed twice in Queues", q)
		}
		seen[q] = true
	}
	return slices.Clone(names), nil
}

// queueAttr names the queues in logs: "queue" for one, "queues" for several.
func (c *Config) queueAttr() slog.Attr {
	if len(c.Queues) == 1 {
		return slog.String("queue", c.Queues[0])
	}
	return slog.Any("queues", c.Queues)
}

func newWorker(client redis.UniversalClient, scripts Scripts, cfg Config, handlers map[string]handler,
	res *results, schemas *PayloadSchemas, watch *steadyWatch) *Worker {
	keys := KeySpace{cfg.Prefix}
	w := &Worker{
		cfg: cfg, client: client, scripts: scripts, keys: keys, byStream: map[string]QueueKeys{}, watch: watch,
		handlers: handlers, results: res, schemas: schemas, records: newRecords(cfg.TaskRecordRetention),
		stats: &Stats{Keys: keys}, stop: make(chan struct{}), claimed: map[string]bool{},
		log:  cfg.Logger.With("consumer", cfg.Consumer, cfg.queueAttr()),
		host: hostname(), pid: strconv.Itoa(os.Getpid()), limitStates: map[string]limitState{},
	}
	for _, name := range cfg.Queues {
		q := keys.Queue(name)
		w.queues = append(w.queues, q)
		for _, stream := range q.TaskStreams() {
			w.byStream[stream] = q
		}
	}
	return w
}

// logFor is the log of what concerns queue q: it names q when the worker has several.
func (w *Worker) logFor(q QueueKeys) *slog.Logger {
	if len(w.queues) == 1 {
		return w.log
	}
	return w.log.With("queue", q.Queue)
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
		child := newWorker(w.client, w.scripts, cfg, w.handlers, w.results, w.schemas, w.watch)
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
// is ready: the queues, and each task type with its payload versions.
func (w *Worker) announce(ctx context.Context, ready <-chan struct{}) {
	select {
	case <-ready:
		w.cfg.Logger.Info("worker started", w.cfg.queueAttr(), "consumer", w.cfg.Consumer,
			"concurrency", max(w.cfg.Concurrency, 1), "language", Language, "serves", w.serves())
	case <-ctx.Done():
	}
}

// Shutdown stops Run as ending its ctx does (SIGTERM in a service): the
// running tasks finish, entries read but not started are handed back with
// requeue.lua, handlers abandoned at their timeout return, the liveness keys
// are deleted. It waits for that until ctx
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
	w.startedAt = time.Now()
	start := func() error {
		if err := w.scripts.Load(bg, w.client); err != nil {
			return err
		}
		if err := w.ensureGroups(bg); err != nil {
			return err
		}
		if err := w.renew(bg); err != nil {
			return fmt.Errorf("setting the liveness key: %w", err)
		}
		return nil
	}
	if err := retryOutage(ctx, w.client, w.log, "start", IsOutage, start); err != nil {
		return err
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

	waitCtx, stopWaits := context.WithCancel(ctx)
	waits := w.newWaits()
	lastWork := time.Now()
	recoverOwn := false // a read failed: its reply may have been lost with entries in it
	for ctx.Err() == nil {
		if w.cfg.ExitAfterIdle > 0 && time.Since(lastWork) > w.cfg.ExitAfterIdle {
			w.log.Info("idle; stopping", "idle_ms", w.cfg.ExitAfterIdle.Milliseconds())
			break
		}
		var streams []redis.XStream
		var err error
		if recoverOwn {
			streams, err = w.readOwnPending(bg)
			recoverOwn = err != nil
		}
		if len(streams) == 0 { // also after a failed recovery: the other queues are still read
			var readErr error
			streams, readErr = w.read(bg)
			err = cmp.Or(err, readErr)
		}
		if len(streams) > 0 { // even when another queue's read failed: these were taken
			lastWork = time.Now()
			w.processBatch(ctx, streams) // entries left when ctx ends stay pending: put back below
			lastWork = time.Now()
		}
		if err == nil && len(streams) == 0 {
			err = waits.any(waitCtx, w.pollAfter())
		}
		if err != nil && strings.HasPrefix(err.Error(), "UNBLOCKED") {
			continue // the wait took nothing (a stream was deleted, the server changed role): re-arm
		}
		if err != nil {
			recoverOwn = true
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
			w.log.Warn("read failed; retrying", "error", err.Error(), "outage", IsOutage(err))
			refreshRoutes(bg, w.client, err)
			sleep(ctx, 200*time.Millisecond)
		}
	}
	stopWaits()
	waits.running.Wait()
	returned := w.requeueOwnPending(bg)
	// An abandoned attempt still runs what it read: keep the liveness key (and its
	// idempotency claim) until it returns (docs/protocol.md section 8).
	w.abandoned.Wait()
	stopKeeper()
	keeper.Wait()
	w.flushStats(bg)
	if err := w.announceSelf(bg, true); err != nil {
		w.log.Warn("could not write the stopped announcement", "error", err.Error())
	}
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
	for _, q := range w.queues {
		for _, stream := range q.TaskStreams() {
			err := w.client.XGroupCreateMkStream(ctx, stream, w.cfg.Group, "0").Err()
			if err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") {
				return fmt.Errorf("XGROUP CREATE %s: %w", stream, err)
			}
		}
	}
	return nil
}

// read takes at most exactly Prefetch new entries with read.lua, queue by
// queue in the configured order with the credit left, most urgent stream first,
// without blocking, within the limits of the task types (section 19): the
// consumer runs one attempt at a time, so a read may hand out one entry of a
// limited type, and only while the batch is still empty (an entry read ahead
// never holds a slot). It remembers what each queue answered about its
// limits. A queue whose read fails (its node is away) does not keep the
// others from being read: read answers what it took and the first error.
func (w *Worker) read(ctx context.Context) ([]redis.XStream, error) {
	var out []redis.XStream
	var first error
	credit := w.cfg.Prefetch
	for _, q := range w.queues {
		if credit == 0 {
			break
		}
		startable := 0
		if credit == w.cfg.Prefetch {
			startable = 1
		}
		res, err := w.scripts.Get("read").Run(ctx, w.client, q.TaskStreams(),
			w.cfg.Group, w.cfg.Consumer, credit, w.cfg.Lease.Milliseconds(), startable).Result()
		var streams []redis.XStream
		var state limitState
		if err == nil {
			streams, state, err = parseRead(res)
		}
		if err != nil {
			first = cmp.Or(first, err)
			continue
		}
		w.limitStates[q.Queue] = state
		for _, s := range streams {
			credit -= len(s.Messages)
		}
		out = append(out, streams...)
	}
	return out, first
}

// readOwnPending takes back the entries this consumer read and has not
// settled (XREADGROUP from id 0, one call per queue): after a read whose reply
// was lost, they are pending to this consumer and nobody else would deliver
// them. Like read, it answers what it took and the first error.
func (w *Worker) readOwnPending(ctx context.Context) ([]redis.XStream, error) {
	var own []redis.XStream
	var first error
	for _, q := range w.queues {
		streams := q.TaskStreams()
		args := slices.Clone(streams)
		for range streams {
			args = append(args, "0")
		}
		res, err := w.client.XReadGroup(ctx, &redis.XReadGroupArgs{Group: w.cfg.Group, Consumer: w.cfg.Consumer,
			Streams: args, Count: int64(max(w.cfg.Prefetch, 100))}).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			first = cmp.Or(first, err)
			continue
		}
		for _, s := range res {
			s.Messages = slices.DeleteFunc(s.Messages, func(m redis.XMessage) bool { return len(m.Values) == 0 })
			if len(s.Messages) > 0 {
				w.logFor(q).Warn("delivering entries read before a lost reply", "stream", s.Stream,
					"entries", len(s.Messages))
				own = append(own, s)
			}
		}
	}
	return own, first
}

// wait blocks up to Block until one of q's task streams has entries the group
// has not delivered yet, or, while entries of q wait for a slot (freedAfter
// not empty), until a settle frees one (section 19). It takes none (XREAD from
// the group's last-delivered ids, not XREADGROUP), so the next read.lua takes
// exactly the credit whatever the Redis version and however many streams have
// entries; so the waits of several queues in flight at once take nothing from
// the credit either.
func (w *Worker) wait(ctx context.Context, q QueueKeys, freedAfter string) error {
	streams := q.TaskStreams()
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
	if freedAfter != "" {
		args = slices.Insert(args, len(streams), q.SlotFreed())
		args = append(args, freedAfter)
	}
	err = w.client.XRead(ctx, &redis.XReadArgs{Streams: args, Count: 1, Block: w.cfg.Block}).Err()
	if errors.Is(err, redis.Nil) || (err != nil && ctx.Err() != nil) {
		return nil
	}
	return err
}

// parseStreams reads the XREADGROUP-shaped reply of read.lua (the first part of its reply).
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

// renew sets the liveness key, then announces the consumer (section 15); a
// failed announcement is logged and does not fail the renewal.
func (w *Worker) renew(ctx context.Context) error {
	value := fmt.Sprintf("%s %s %s", w.host, w.pid, Language)
	if err := w.client.Set(ctx, w.keys.Consumer(w.cfg.Consumer), value, w.cfg.Lease).Err(); err != nil {
		return err
	}
	if err := w.announceSelf(ctx, false); err != nil {
		w.log.Warn("announcing the worker failed", "error", err.Error())
	}
	return nil
}

// renewEvery is the liveness renewal period, lease/3 (heartbeat_ms).
func (w *Worker) renewEvery() time.Duration { return w.cfg.Lease / 3 }

// flushStats writes the statistics held (section 17); a failed write is
// logged and kept for the next one.
func (w *Worker) flushStats(ctx context.Context) {
	if err := w.stats.Flush(ctx, w.client); err != nil {
		w.log.Warn("writing the worker statistics failed; they are kept for the next renewal", "error", err.Error())
	}
}

// keepAlive renews the liveness key every lease/3, whatever the tasks do, and
// writes the statistics held after each renewal; it takes over the entries of
// dead consumers once it renewed twice in a row with renewals answered at once
// (docs/protocol.md section 5): one that failed or waited for Redis starts the
// count again, and so does a takeover that did.
// After a failed renewal it tries again soon, so that its key is back as soon
// as Redis answers.
func (w *Worker) keepAlive(ctx context.Context) {
	interval := w.renewEvery()
	timer := time.NewTimer(interval)
	defer timer.Stop()
	renewed := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		steady := w.watch.begin()
		err := steady.check(func() error { return w.renew(ctx) })
		if ctx.Err() != nil {
			return
		}
		if err == nil || errors.Is(err, errWaited) {
			w.renewSlots(ctx)
		}
		switch {
		case err == nil:
			renewed++
		case errors.Is(err, errWaited):
			w.log.Info("liveness renewal waited for Redis; it does not count toward a takeover")
			renewed = 0
		default:
			w.log.Warn("liveness renewal failed", "error", err.Error())
			refreshRoutes(ctx, w.client, err)
			renewed = 0
			timer.Reset(max(interval/10, 10*time.Millisecond))
			continue
		}
		timer.Reset(interval)
		w.flushStats(ctx)
		if renewed < 2 {
			continue
		}
		n, err := w.takeOverDead(ctx, steady)
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case errors.Is(err, errWaited):
			w.log.Info("takeover stopped: a command waited for Redis, its liveness checks are not trusted")
			renewed = 0
		case err != nil:
			w.log.Warn("takeover failed", "error", err.Error())
			renewed = 0
		case n > 0:
			w.log.Warn("took over entries of dead consumers", "entries", n)
		}
	}
}

// TakeOverDeadConsumers puts back the entries held by consumers whose liveness
// key is gone and that were idle for a lease, and forgets dead consumers that
// hold nothing and were idle for ForgetAfter; it returns how many entries it
// moved (requeued or dead-lettered). Unlike the Worker's own takeovers it does
// not check that Redis was reachable for the last renewals: call it only when
// every live consumer has had a renewal interval to renew its key.
func (w *Worker) TakeOverDeadConsumers(ctx context.Context) (int, error) {
	return w.takeOverDead(ctx, steadySince{})
}

// takeOverDead is TakeOverDeadConsumers, stopped with errWaited as soon as one
// of its commands did not keep steady.
func (w *Worker) takeOverDead(ctx context.Context, steady steadySince) (int, error) {
	moved := 0
	for _, q := range w.queues {
		for _, stream := range q.TaskStreams() {
			var summary *redis.XPending
			err := steady.check(func() (err error) {
				summary, err = w.client.XPending(ctx, stream, w.cfg.Group).Result()
				return err
			})
			if err != nil {
				if strings.Contains(err.Error(), "NOGROUP") || errors.Is(err, redis.Nil) {
					continue
				}
				return moved, err
			}
			for owner := range summary.Consumers {
				if owner == w.cfg.Consumer || owner == ParkedConsumer { // parked entries wait, they are not abandoned
					continue
				}
				alive, err := w.exists(ctx, steady, w.keys.Consumer(owner))
				if err != nil {
					return moved, err
				}
				if alive {
					continue
				}
				n, err := w.takeOver(ctx, steady, q, stream, owner)
				moved += n
				if err != nil {
					return moved, err
				}
			}
			if err := w.forgetDeadConsumers(ctx, steady, stream); err != nil {
				return moved, err
			}
		}
	}
	return moved, nil
}

// exists is EXISTS key, as one command of a steady stretch.
func (w *Worker) exists(ctx context.Context, steady steadySince, key string) (bool, error) {
	var n int64
	err := steady.check(func() (err error) {
		n, err = w.client.Exists(ctx, key).Result()
		return err
	})
	return n == 1, err
}

// deadLetterWho are the failure fields requeue.lua adds to a redelivery_limit
// dead-letter entry (docs/protocol.md sections 5 and 7); consumer is the one
// that died holding the entry.
func (w *Worker) deadLetterWho(q QueueKeys, owner string) []any {
	now := Now().String()
	return []any{"queue", q.Queue, "language", Language, "host", w.host, "pid", w.pid,
		"consumer", owner, "first_failure_at", now, "last_failure_at", now}
}

// takeOver puts back (or dead-letters) owner's entries of one of q's streams.
func (w *Worker) takeOver(ctx context.Context, steady steadySince, q QueueKeys, stream, owner string) (int, error) {
	const batch = 100
	var pending []redis.XPendingExt
	err := steady.check(func() (err error) {
		pending, err = w.client.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: stream, Group: w.cfg.Group, Idle: w.cfg.Lease, Start: "-", End: "+",
			Count: batch, Consumer: owner,
		}).Result()
		return err
	})
	if err != nil || len(pending) == 0 {
		return 0, err
	}
	// requeue.lua may dead-letter an entry (redelivery_limit): list the queue first.
	if err := steady.check(func() error { return w.client.SAdd(ctx, w.keys.DeadQueues(), q.Queue).Err() }); err != nil {
		return 0, err
	}
	log := w.logFor(q)
	moved := 0
	for _, p := range pending {
		var rec *record
		if err := steady.check(func() (err error) { rec, err = w.entryRecord(ctx, q, stream, p.ID); return err }); err != nil {
			return moved, err
		}
		keys, args := rec.script([]string{stream, stream, q.Dead()},
			append([]any{w.cfg.Group, p.ID, owner, w.cfg.Lease.Milliseconds(), 1,
				w.cfg.MaxRedeliveries, recordTime(time.Now())}, w.deadLetterWho(q, owner)...), 7)
		var res string
		err := steady.check(func() (err error) {
			res, err = w.scripts.Get("requeue").Run(ctx, w.client, keys, args...).Text()
			if errors.Is(err, redis.Nil) {
				res, err = "", nil
			}
			return err
		})
		if err != nil {
			return moved, err
		}
		if res == "" {
			continue
		}
		moved++
		if strings.HasPrefix(res, "dead:") {
			deadID := strings.TrimPrefix(res, "dead:")
			log.Error("entry of a dead consumer dead-lettered: redelivery limit reached",
				"outcome", "dead", "failure_class", ClassRedeliveryLimit, "owner", owner,
				"stream", stream, "entry_id", p.ID, "dead_id", deadID)
			w.failRedelivered(ctx, q, deadID)
			continue
		}
		log.Warn("took over entry of dead consumer", "owner", owner, "stream", stream,
			"entry_id", p.ID, "new_id", res)
	}
	return moved, nil
}

// entryRecord is the record requeue.lua writes for the entry id of stream:
// the entry is read first to learn its task_id; nil when it cannot be decoded
// (or records are off). It answers Redis's error.
func (w *Worker) entryRecord(ctx context.Context, q QueueKeys, stream, id string) (*record, error) {
	if w.records.retention <= 0 {
		return nil, nil
	}
	msgs, err := w.client.XRange(ctx, stream, id, id).Result()
	if err != nil || len(msgs) != 1 {
		return nil, err
	}
	env, err := DecodeEntry(textFields(msgs[0].Values), w.cfg.Limits)
	if err != nil {
		return nil, nil
	}
	return w.records.requeueStep(q, env.TaskID), nil
}

// failRedelivered writes the FAILURE result of a task requeue.lua dead-lettered
// as redelivery_limit, reading the task back from its dead-letter entry (the
// script moved it atomically, so the result follows the move).
//
// It counts the dead letter under its task type ("-" when it cannot be read).
func (w *Worker) failRedelivered(ctx context.Context, q QueueKeys, deadID string) {
	taskType := UndecodedTaskType
	defer func() { w.stats.Count(q.Queue, taskType, StatDead) }()
	msgs, err := w.client.XRange(ctx, q.Dead(), deadID, deadID).Result()
	if err != nil || len(msgs) != 1 {
		w.logFor(q).Warn("reading a dead-letter entry back for its result failed", "dead_id", deadID, "error", fmt.Sprint(err))
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
	taskType = env.TaskType
	log := w.logFor(q).With("task_id", env.TaskID, "trace_id", env.TraceID, "task_type", env.TaskType)
	w.results.write(ctx, log, env, failed(failure{class: ClassRedeliveryLimit, reason: fields["reason"]}))
}

// forgetDeadConsumers removes from the group, with forget_consumer.lua (which
// re-checks atomically that the consumer holds nothing and is idle long
// enough), the consumers of stream without a liveness key that were idle for
// ForgetAfter. Never a bare XGROUP DELCONSUMER: it would drop entries such a
// consumer read in the meantime.
func (w *Worker) forgetDeadConsumers(ctx context.Context, steady steadySince, stream string) error {
	idle := max(w.cfg.ForgetAfter, w.cfg.Lease)
	var consumers []redis.XInfoConsumer
	err := steady.check(func() (err error) {
		consumers, err = w.client.XInfoConsumers(ctx, stream, w.cfg.Group).Result()
		return err
	})
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
		alive, err := w.exists(ctx, steady, w.keys.Consumer(c.Name))
		if err != nil {
			return err
		}
		if alive {
			continue
		}
		var forgotten int
		err = steady.check(func() (err error) {
			forgotten, err = w.scripts.Get("forget_consumer").Run(ctx, w.client, []string{stream},
				w.cfg.Group, c.Name, idle.Milliseconds()).Int()
			return err
		})
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
	for _, q := range w.queues {
		log := w.logFor(q)
		for _, stream := range q.TaskStreams() {
			pending, err := w.client.XPendingExt(ctx, &redis.XPendingExtArgs{
				Stream: stream, Group: w.cfg.Group, Start: "-", End: "+", Count: 10000,
				Consumer: w.cfg.Consumer,
			}).Result()
			if err != nil {
				log.Warn("listing own pending entries failed", "stream", stream, "error", err.Error())
				continue
			}
			for _, p := range pending {
				rec, err := w.entryRecord(ctx, q, stream, p.ID)
				if err != nil {
					log.Warn("reading an entry to put back failed; putting it back without its record",
						"entry_id", p.ID, "error", err.Error())
				}
				keys, args := rec.script([]string{stream, stream, q.Dead()},
					[]any{w.cfg.Group, p.ID, "", 0, 0, 0, recordTime(time.Now())}, 7)
				err = w.scripts.Get("requeue").Run(ctx, w.client, keys, args...).Err()
				if err != nil && !errors.Is(err, redis.Nil) {
					log.Warn("putting an entry back failed", "entry_id", p.ID, "error", err.Error())
					continue
				}
				moved++
				log.Info("put back an unstarted entry", "stream", stream, "entry_id", p.ID)
			}
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
	q          QueueKeys // the queue of the stream
	stream, id string
	fields     map[string]string
	env        *Envelope
	log        *slog.Logger
	slot       *slot // the concurrency slot it may hold, when its queue has limits
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
	defer w.slots.drop(heldMembers(streams)...)
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
	q := w.byStream[stream]
	log := w.logFor(q)
	env, err := DecodeEntry(fields, w.cfg.Limits)
	if err != nil {
		log.Error("malformed entry", "stream", stream, "entry_id", m.ID, "reason", err.Error())
		w.deadLetter(ctx, &entry{q: q, stream: stream, id: m.ID, fields: fields, log: log},
			failure{class: ClassMalformedEntry, reason: err.Error(), exceptionType: "MalformedEntry"})
		return nil
	}
	e := &entry{q: q, stream: stream, id: m.ID, fields: fields, env: env,
		log: log.With("task_id", env.TaskID, "trace_id", env.TraceID, "task_type", env.TaskType,
			"entry_id", m.ID)}
	w.holdSlot(e)
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
	reason := "cancelled"
	if why == revokedExpired {
		reason = "expired"
	}
	w.ack(ctx, e, StateCancelled, reason)
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
	if !w.payloadFits(ctx, e) {
		return
	}
	task := &Task{Envelope: env, Queue: e.q.Queue, Stream: e.stream, EntryID: e.id, Log: e.log}
	task.Redelivered, _ = strconv.Atoi(e.fields[FieldRedeliver])

	holder, keepMark := "", false
	if env.IdempotencyKey != nil {
		var proceed bool
		holder, proceed = w.claim(ctx, e, task)
		if !proceed {
			return
		}
		// Every way out below settles the claim first; an abandoned attempt keeps its mark
		// until its handler returned (finishIdemWhenReturned clears it).
		defer func() {
			if !keepMark {
				w.unmark(w.idemKey(env))
			}
		}()
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
			w.deferTask(ctx, e, delay)
			return
		} else {
			defer func() {
				if err := w.client.ZRem(context.Background(), slot, env.TaskID).Err(); err != nil {
					e.log.Warn("releasing the retry slot failed", "error", err.Error())
				}
			}()
		}
	}

	w.recordStart(ctx, e)
	e.log.Info("task started", "retry_count", env.RetryCount, "redelivered", task.Redelivered)
	started := time.Now()
	w.stats.Observe(e.q.Queue, env.TaskType, HistogramWait, started.Sub(waitStart(env)))
	value, late, err := w.run(h.run, task)
	elapsed := time.Since(started)
	w.stats.Observe(e.q.Queue, env.TaskType, HistogramRun, elapsed)
	var result json.RawMessage
	if err == nil && asksForResult(env) {
		result, err = encodeResult(value)
	}
	if err == nil {
		w.stats.Count(e.q.Queue, env.TaskType, StatSucceeded)
		if holder != "" {
			w.finishIdem(ctx, e, holder, "done")
		}
		w.results.write(ctx, e.log, env, succeeded(result))
		w.ack(ctx, e, StateSucceeded, "")
		e.log.Info("task succeeded", "outcome", "success", "duration_ms", elapsed.Milliseconds(),
			"retry_count", env.RetryCount)
		return
	}
	switch {
	case holder != "" && late != nil:
		keepMark = true
		w.finishIdemWhenReturned(e, holder, late)
	case late != nil: // no claim to keep, but the consumer stays alive until it returns
		w.abandoned.Add(1)
		go func() { defer w.abandoned.Done(); <-late }()
	case holder != "":
		w.finishIdem(ctx, e, holder, "release")
	}
	w.stats.Count(e.q.Queue, env.TaskType, StatFailed)
	w.fail(ctx, e, err, elapsed)
}

// payloadFits checks e's payload against its schema (section 16) and
// dead-letters it as invalid_payload, unrun and not retried, when it breaks it.
// A schema that cannot be read is logged and the task runs unchecked.
func (w *Worker) payloadFits(ctx context.Context, e *entry) bool {
	found, err := w.schemas.Violations(ctx, e.env)
	if err != nil {
		e.log.Warn("payload schema check failed; running the task unchecked", "error", err.Error())
		return true
	}
	if len(found) == 0 {
		return true
	}
	w.stats.Count(e.q.Queue, e.env.TaskType, StatFailed)
	w.deadLetter(ctx, e, w.notRun(e, ClassInvalidPayload, SchemaDeadLetterReason(found)))
	return false
}

// recordStart writes the task record of a start: state running, attempts + 1
// and who runs it, in one MULTI. A failed write is logged; the task runs.
func (w *Worker) recordStart(ctx context.Context, e *entry) {
	rec := w.records.activeStep(e.q, e.env.TaskID, time.Time{}, map[string]string{
		"started_at": recordTime(time.Now()), "worker": w.cfg.Consumer, "language": Language,
		"host": w.host, "pid": w.pid})
	if rec == nil {
		return
	}
	_, err := w.client.TxPipelined(ctx, func(p redis.Pipeliner) error {
		rec.hset(ctx, p, StateRunning, true)
		return nil
	})
	if err != nil {
		e.log.Warn("writing the task record of the start failed", "error", err.Error())
	}
}

// finishIdemWhenReturned keeps (renews) the idempotency claim of an abandoned attempt
// and its mark until its handler really returns, then settles it and clears the mark
// (docs/protocol.md section 8): a retry meanwhile is deferred, so the effect the
// abandoned code may still have happens once.
func (w *Worker) finishIdemWhenReturned(e *entry, holder string, late <-chan handlerReturn) {
	key := w.idemKey(e.env)
	w.abandoned.Add(1)
	go func() {
		defer w.abandoned.Done()
		defer w.unmark(key)
		claimFor := w.claimTime(e.env)
		renew := time.NewTicker(claimFor / 3)
		defer renew.Stop()
		var o handlerReturn
		for waiting := true; waiting; {
			select {
			case o = <-late:
				waiting = false
			case <-renew.C: // idem_begin is re-entrant for its holder: it extends the claim
				res, err := w.scripts.Get("idem_begin").Run(context.Background(), w.client,
					[]string{key}, holder, claimFor.Milliseconds(), "").StringSlice()
				if err == nil && len(res) > 0 && res[0] != "acquired" {
					e.log.Warn("an abandoned attempt lost its idempotency claim", "claim", res)
				}
			}
		}
		how := "release"
		if o.err == nil {
			how = "done"
		}
		e.log.Info("an abandoned attempt returned; settling its idempotency claim", "claim", how)
		w.finishIdem(context.Background(), e, holder, how)
	}()
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
// The key stays marked when it runs: the caller clears the mark once the claim is settled.
func (w *Worker) claim(ctx context.Context, e *entry, task *Task) (holder string, run bool) {
	env := e.env
	key := w.idemKey(env)
	holder = w.cfg.Consumer + " " + env.TaskID
	claimFor := w.claimTime(env)
	if !w.mark(key) {
		e.log.Info("another attempt of this consumer holds the idempotency key; deferred",
			"delay_ms", w.cfg.DeferDelay.Milliseconds())
		w.deferTask(ctx, e, w.cfg.DeferDelay)
		return "", false
	}
	defer func() {
		if !run { // no claim of this attempt is left to settle
			w.unmark(key)
		}
	}()
	replace := ""
	for round := 0; round < 2; round++ {
		// With Durability the claim waits for replicas, like the settle steps: a
		// failover that lost the claim and the delivery would run the task again.
		var res []string
		err := w.cfg.Durability.write(ctx, w.client, key, e.log, func(c redis.Cmdable) error {
			var err error
			res, err = w.scripts.Get("idem_begin").Run(ctx, c, []string{key},
				holder, claimFor.Milliseconds(), replace).StringSlice()
			return err
		})
		if err != nil || len(res) == 0 {
			e.log.Warn("idempotency claim failed; releasing it and deferring", "error", fmt.Sprint(err))
			w.releaseFailedClaim(ctx, e, holder)
			w.deferTask(ctx, e, w.cfg.DeferDelay)
			return "", false
		}
		switch res[0] {
		case "acquired":
			return holder, true
		case "done":
			w.results.write(ctx, e.log, env, succeeded(nil))
			w.ack(ctx, e, StateSucceeded, "duplicate")
			w.stats.Count(e.q.Queue, env.TaskType, StatDuplicate)
			e.log.Info("duplicate: the effect already happened; acknowledged without running",
				"outcome", "duplicate", "idempotency_key", *env.IdempotencyKey, "marker", res[1])
			if w.cfg.OnDuplicate != nil {
				w.cfg.OnDuplicate(ctx, task)
			}
			return "", false
		case "busy":
			other := res[1]
			// The consumer is the holder's first word (protocol.md section 9: a Celery
			// worker's holder names the entry too).
			owner, _, _ := strings.Cut(other, " ")
			if round == 0 && w.holderGone(ctx, e, owner) {
				e.log.Warn("idempotency holder is dead; taking the claim over", "holder", other)
				replace = other
				continue
			}
			e.log.Info("another consumer runs this idempotency key; deferred",
				"holder", other, "delay_ms", w.cfg.DeferDelay.Milliseconds())
			w.deferTask(ctx, e, w.cfg.DeferDelay)
			return "", false
		}
	}
	w.deferTask(ctx, e, w.cfg.DeferDelay)
	return "", false
}

// finishIdem settles the claim of an attempt that ran or may still run: done or release.
func (w *Worker) finishIdem(ctx context.Context, e *entry, holder, how string) {
	w.settle(e, "idem_finish "+how, w.idemFinish(ctx, e, holder, how, true))
}

// releaseFailedClaim releases the claim of an attempt whose idem_begin.lua failed: it
// may have landed all the same (its reply was lost). An answer 0 means it never did;
// a release Redis refuses, not away, is logged and the claim left to expire.
func (w *Worker) releaseFailedClaim(ctx context.Context, e *entry, holder string) {
	err := retryOutage(ctx, w.client, e.log, "idem_finish release", IsOutage,
		w.idemFinish(ctx, e, holder, "release", false))
	if err != nil {
		e.log.Error("releasing the failed idempotency claim failed; it is left to expire",
			"error", err.Error())
	}
}

// idemFinish is the step of idem_finish.lua how for the holder's claim, followed by the
// Durability WAIT; with takenOver it logs an answer 0 as the takeover it then is.
func (w *Worker) idemFinish(ctx context.Context, e *entry, holder, how string, takenOver bool) func() error {
	key := w.idemKey(e.env)
	return func() error {
		return w.cfg.Durability.write(ctx, w.client, key, e.log, func(c redis.Cmdable) error {
			n, err := w.scripts.Get("idem_finish").Run(ctx, c, []string{key},
				holder, how, w.cfg.IdemDoneTTL.Milliseconds(), Now().String()).Int()
			if err == nil && n == 0 && takenOver {
				e.log.Warn("the idempotency claim had been taken over: the task may have run twice",
					"idempotency_key", *e.env.IdempotencyKey)
			}
			return err
		})
	}
}

// holderGone looks whether the liveness key of owner, the holder of a busy
// claim, is gone, and if so looks again one renewal interval later: a live
// holder whose key expired during an outage renews it within that interval
// (docs/protocol.md section 9). Yes only when both looks found no key and
// neither waited for Redis.
func (w *Worker) holderGone(ctx context.Context, e *entry, owner string) bool {
	steady := w.watch.begin()
	key := w.keys.Consumer(owner)
	if alive, err := w.exists(ctx, steady, key); err != nil || alive {
		return false
	}
	e.log.Info("the idempotency holder's liveness key is gone; looking again in one renewal interval",
		"holder_consumer", owner)
	sleep(ctx, w.cfg.Lease/3)
	alive, err := w.exists(ctx, steady, key)
	return err == nil && !alive
}

// claimTime is how long an idempotency claim of env lasts unless renewed.
func (w *Worker) claimTime(env *Envelope) time.Duration {
	if env.TimeoutMS != nil {
		return time.Duration(*env.TimeoutMS)*time.Millisecond + w.cfg.Lease
	}
	return w.cfg.IdemClaim
}

// idemKey is the Redis key of env's idempotency key.
func (w *Worker) idemKey(env *Envelope) string {
	return w.keys.Idempotency(env.TaskType, *env.IdempotencyKey)
}

// mark marks key claimed by an attempt of this consumer; false when one already had.
func (w *Worker) mark(key string) bool {
	w.claimedMu.Lock()
	defer w.claimedMu.Unlock()
	if w.claimed[key] {
		return false
	}
	w.claimed[key] = true
	return true
}

// unmark clears the mark of key once its claim is settled.
func (w *Worker) unmark(key string) {
	w.claimedMu.Lock()
	defer w.claimedMu.Unlock()
	delete(w.claimed, key)
}

// handlerReturn is what a handler returned.
type handlerReturn struct {
	value any
	err   error
}

// run calls the handler in the task's trace context and "process <queue>" span,
// with the attempt's deadline; a handler that outlives its deadline is
// abandoned (it should honour ctx) and the attempt times out: run returns at
// once, and late receives the handler's outcome when it ends.
func (w *Worker) run(fn ResultHandlerFunc, task *Task) (value any, late <-chan handlerReturn, err error) {
	ctx, span := startProcess(runningTaskContext(ContextWithTraceID(context.Background(), task.TraceID),
		task.Envelope), w.cfg.TracerProvider, task)
	defer func() { endSpan(span, err) }()
	cancel := context.CancelFunc(func() {})
	if task.TimeoutMS != nil {
		ctx, cancel = context.WithTimeout(ctx, time.Duration(*task.TimeoutMS)*time.Millisecond)
	}
	defer cancel()
	done := make(chan handlerReturn, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				done <- handlerReturn{err: &PanicError{Value: r, Stack: string(debug.Stack())}}
			}
		}()
		value, err := fn(ctx, task)
		done <- handlerReturn{value, err}
	}()
	select {
	case o := <-done:
		if o.err != nil && task.TimeoutMS != nil && isTimeout(ctx, o.err) {
			return nil, nil, &TimeoutError{TimeoutMS: *task.TimeoutMS, Err: o.err}
		}
		return o.value, nil, o.err
	case <-ctx.Done():
		task.Log.Warn("attempt exceeded timeout_ms; abandoned", "timeout_ms", *task.TimeoutMS)
		return nil, done, &TimeoutError{TimeoutMS: *task.TimeoutMS, Err: ctx.Err()}
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
	if w.replace(ctx, e, next, d.Delay, StateRetrying, recordError(ExceptionType(err), err.Error())) {
		w.stats.Count(e.q.Queue, env.TaskType, StatRetried)
	}
}

// deferTask hands e back to run delay later, retry_count unchanged (a deferral).
func (w *Worker) deferTask(ctx context.Context, e *entry, delay time.Duration) {
	next := e.env.Clone()
	next.ScheduleTime = scheduleAfter(time.Now(), delay)
	w.replace(ctx, e, next, delay, StateScheduled, "")
}

// replace swaps the pending entry for next atomically with retry.lua. A
// delayed next attempt registers the queue (SADD <prefix>:queues) first. The
// record gets state (retrying or scheduled; retry.lua writes queued when due
// now) and errText, the failure that caused a retry. It reports whether
// retry.lua wrote next.
func (w *Worker) replace(ctx context.Context, e *entry, next *Envelope, delay time.Duration, state, errText string) bool {
	enc, body, err := EncodeBody(next, w.cfg.GzipMin, w.cfg.Limits)
	if err != nil {
		w.deadLetter(ctx, e, failure{class: ClassTaskError, reason: "cannot write the next attempt: " + err.Error(),
			attempts: e.env.RetryCount + 1})
		return false
	}
	due := int64(0)
	if next.ScheduleTime != nil && delay > 0 {
		due = next.ScheduleTime.UnixMilli()
	}
	bucket := BucketFor(next.Priority)
	fields := map[string]string{"state": state, "retry_count": strconv.FormatInt(next.RetryCount, 10)}
	var dueAt time.Time
	if due > 0 {
		dueAt = next.ScheduleTime.Time
		fields["due_at"] = recordTime(dueAt)
	}
	if errText != "" {
		fields["error"] = errText
	}
	keys, args := w.records.activeStep(e.q, next.TaskID, dueAt, fields).script(
		[]string{e.stream, e.q.Stream(bucket), e.q.Delayed(), e.q.DelayedData()},
		[]any{w.cfg.Group, e.id, next.TaskID, due, string(bucket), enc, string(body), w.keys.Wakeup()}, 8)
	written := false
	w.settle(e, "retry.lua", func() error {
		if due > 0 { // the registry first, on its own (docs/protocol.md section 2)
			if err := w.client.SAdd(ctx, w.keys.Queues(), e.q.Queue).Err(); err != nil {
				return err
			}
		}
		return w.cfg.Durability.write(ctx, w.client, e.stream, e.log, func(c redis.Cmdable) error {
			err := w.scripts.Get("retry").Run(ctx, c, keys, args...).Err()
			if errors.Is(err, redis.Nil) {
				e.log.Warn("entry was no longer pending when replaced (taken over?)")
				return nil
			}
			written = err == nil
			return err
		})
	})
	return written
}

// reschedule moves an entry that is not due yet to the delayed set, byte for
// byte: SADD <prefix>:queues first, then schedule.lua and the acknowledgement
// in one MULTI (they touch one queue's keys).
func (w *Worker) reschedule(ctx context.Context, e *entry, now time.Time) {
	bucket := BucketFor(e.env.Priority)
	fields := published(e.env, e.q.Queue)
	fields["due_at"] = recordTime(e.env.ScheduleTime.Time)
	rec := w.records.activeStep(e.q, e.env.TaskID, e.env.ScheduleTime.Time, fields)
	w.settle(e, "reschedule", func() error {
		if err := w.client.SAdd(ctx, w.keys.Queues(), e.q.Queue).Err(); err != nil {
			return err
		}
		return w.cfg.Durability.write(ctx, w.client, e.stream, e.log, func(c redis.Cmdable) error {
			cmds, err := c.TxPipelined(ctx, func(p redis.Pipeliner) error {
				storeDelayed(ctx, p, w.scripts, w.keys, e.q.Queue, e.env.TaskID, e.env.DueMS(now), bucket,
					e.fields[FieldEncoding], []byte(e.fields[FieldBody]), "entry:"+e.id, rec)
				p.XAck(ctx, e.stream, w.cfg.Group, e.id)
				p.XDel(ctx, e.stream, e.id)
				e.freeSlot(ctx, p)
				return nil
			})
			return withoutFreedNil(cmds, err)
		})
	})
	e.log.Info("task not due yet; moved to the delayed set", "outcome", "scheduled",
		"schedule_time", e.env.ScheduleTime.String())
}

// ack acknowledges a task that ended in state (succeeded or cancelled, with
// reason: "" for a plain success), writing its record in the same MULTI. Such
// a task is settled for good: a keyed one moves its ordering key on in that
// MULTI, and the promoters are woken to release the key's next task
// (docs/protocol.md section 20).
func (w *Worker) ack(ctx context.Context, e *entry, state, reason string) {
	fields := map[string]string{"finished_at": recordTime(time.Now())}
	if reason != "" {
		fields["reason"] = reason
	}
	rec := w.records.finalStep(e.q, e.env.TaskID, fields)
	w.settle(e, "ack", func() error {
		return w.cfg.Durability.write(ctx, w.client, e.stream, e.log, func(c redis.Cmdable) error {
			var acked *redis.IntCmd
			cmds, err := c.TxPipelined(ctx, func(p redis.Pipeliner) error {
				acked = p.XAck(ctx, e.stream, w.cfg.Group, e.id)
				p.XDel(ctx, e.stream, e.id)
				e.freeSlot(ctx, p)
				rec.hset(ctx, p, state, false)
				if key := e.env.OrderingKey; key != nil {
					p.LRem(ctx, e.q.Order(*key), 1, e.env.TaskID)
					p.RPush(ctx, e.q.OrderAdvanced(), *key)
				}
				return nil
			})
			err = withoutFreedNil(cmds, err)
			if err == nil && acked.Val() == 0 {
				e.log.Warn("ack answered 0: the entry was taken over while this consumer looked dead")
			}
			return err
		})
	})
	if e.env.OrderingKey == nil {
		return
	}
	// Best effort: a promoter that misses it looks again within its MaxIdle.
	if err := w.client.Publish(ctx, w.keys.Wakeup(), 0).Err(); err != nil {
		e.log.Warn("waking the promoters failed; they release the next task of the key when they look again",
			"error", err.Error())
	}
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
		"queue", e.q.Queue,
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

// deadLetter writes the FAILURE result of a decoded task that asks for one,
// then SADD <prefix>:dead-queues, then moves the entry to the dead-letter
// stream with dead_letter.lua.
func (w *Worker) deadLetter(ctx context.Context, e *entry, f failure) {
	if e.env != nil {
		w.results.write(ctx, e.log, e.env, failed(f))
	}
	keys, args := []string{e.stream, e.q.Dead()}, append([]any{w.cfg.Group, e.id}, w.deadLetterFields(e, f)...)
	if e.env != nil {
		errText := recordError(f.class, f.reason)
		if f.exceptionType != "" && f.message != "" {
			errText = recordError(f.exceptionType, f.message)
		}
		keys, args = w.records.finalStep(e.q, e.env.TaskID,
			map[string]string{"finished_at": recordTime(time.Now()), "error": errText}).script(keys, args, 2)
	}
	var deadID string
	w.settle(e, "dead_letter.lua", func() error {
		// The registry first, on its own (docs/protocol.md sections 2 and 7).
		if err := w.client.SAdd(ctx, w.keys.DeadQueues(), e.q.Queue).Err(); err != nil {
			return err
		}
		return w.cfg.Durability.write(ctx, w.client, e.stream, e.log, func(c redis.Cmdable) error {
			id, err := w.scripts.Get("dead_letter").Run(ctx, c, keys, args...).Text()
			if errors.Is(err, redis.Nil) {
				e.log.Warn("entry was no longer pending when dead-lettered (taken over?)")
				return nil
			}
			deadID = id
			return err
		})
	})
	if deadID != "" {
		taskType := UndecodedTaskType
		if e.env != nil {
			taskType = e.env.TaskType
		}
		w.stats.Count(e.q.Queue, taskType, StatDead)
	}
	e.log.Error("entry dead-lettered", "outcome", "dead", "failure_class", f.class,
		"reason", f.reason, "dead_id", deadID)
}

// settle runs a step that ends an entry's handling, retrying Redis errors for
// a while: an entry is never dropped, at worst it stays pending until this
// consumer reads its own pending entries again or stops and puts it back.
func (w *Worker) settle(e *entry, what string, step func() error) {
	if err := retryOutage(context.Background(), w.client, e.log, what, anyError, step); err != nil {
		e.log.Error("giving up on a step; the entry stays pending", "step", what, "error", err.Error())
	}
}
