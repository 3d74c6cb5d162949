package envelope

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"
)

// Producer publishes Envelopes (docs/protocol.md section 4) on any
// redis.UniversalClient: one Redis, a Sentinel-managed primary
// (redis.NewFailoverClient) or a Redis Cluster (see NewUniversalClient).
type Producer struct {
	Client     redis.UniversalClient
	Keys       KeySpace
	Scripts    Scripts
	Limits     Limits
	GzipMin    int          // bodies of at least this many bytes are compressed; <= 0 never
	Durability Durability   // replicas each publish waits for (none by default)
	Log        *slog.Logger // publish retries and WAIT warnings; nil: slog.Default()

	// TaskRecordRetention is how long the record of a task that ended is kept
	// (docs/protocol.md section 14): 0 is DefaultTaskRecordRetention, NoTaskRecords
	// writes none.
	TaskRecordRetention time.Duration
	// SchemaCache is how long the payload schemas read are used (schema_cache_s):
	// 0 is DefaultSchemaCache.
	SchemaCache time.Duration
	// RequireServed refuses a task that no live or recently seen worker of its
	// queue serves (section 15) with a *NotServedError.
	RequireServed bool
	// TracerProvider makes the "send <queue>" spans (docs/protocol.md section 18);
	// nil: OpenTelemetry's global provider (no spans until an SDK is installed).
	TracerProvider trace.TracerProvider

	schemasOnce sync.Once
	schemas     *PayloadSchemas
}

// NewProducer returns a Producer with the default limits and gzip threshold.
func NewProducer(client redis.UniversalClient, prefix string, scripts Scripts) *Producer {
	return &Producer{Client: client, Keys: KeySpace{prefix}, Scripts: scripts,
		Limits: DefaultLimits, GzipMin: GzipMinBytes}
}

// Publish validates e (including max_delay and its payload schema, section 16;
// with RequireServed, that a worker serves it) and stores it with its task record: enqueue.lua into
// its priority stream when due (removing a delayed copy of the same task_id),
// SADD <prefix>:queues then schedule.lua into the delayed set otherwise.
// It returns the stream entry id, "" when the task was delayed, or Waiting
// when it has an ordering_key whose turn has not come: it is stored, in no
// stream yet, and a promoter releases it when the task before it is settled
// (a keyed task registers its queue in <prefix>:queues first, as a delayed
// one does, so that promoters serve it; docs/protocol.md section 20).
//
// While Redis is away or failing over (IsOutage) the publish is retried for
// about 15 s with one publish token, so it is stored once however many tries
// reach Redis. With Durability set it then waits for replicas.
//
// Each publish is a "send <queue>" PRODUCER span; unless e sets traceparent,
// its headers get the trace context of that span, or of the task the handler
// publishing runs (docs/protocol.md section 18).
//
// e must carry its identity (task_id, trace_id, created_at): build it with
// New, which fills them in.
func (p *Producer) Publish(ctx context.Context, queue string, e *Envelope) (string, error) {
	return p.publish(ctx, queue, e, nil)
}

// publish is Publish with the announcements of a batch read once (nil: read now),
// in its send span.
func (p *Producer) publish(ctx context.Context, queue string, e *Envelope, announced []Announcement) (id string, err error) {
	if err := CheckQueueName(queue); err != nil {
		return "", err
	}
	span := startSend(ctx, p.TracerProvider, queue, e)
	defer func() { endSpan(span, err) }()
	now := time.Now()
	if err := e.Validate(p.Limits); err != nil {
		return "", err
	}
	if err := CheckPublishable(e, p.Limits, now); err != nil {
		return "", err
	}
	if err := p.checkServed(ctx, queue, e, announced); err != nil {
		return "", err
	}
	return p.store(ctx, queue, e, now)
}

// checkServed applies the payload schema of e and, with RequireServed, the
// served check against announced (nil: read them now).
func (p *Producer) checkServed(ctx context.Context, queue string, e *Envelope, announced []Announcement) error {
	// A schema read is safe to repeat: retried while Redis is away, as the publish is.
	var invalid error
	err := retryOutage(ctx, p.Client, p.logger(), "reading the payload schemas", IsOutage, func() error {
		invalid = p.payloadSchemas().Check(ctx, e)
		var refused *ValidationError
		if errors.As(invalid, &refused) {
			return nil
		}
		return invalid
	})
	if err := cmp.Or(err, invalid); err != nil {
		return err
	}
	if !p.RequireServed {
		return nil
	}
	if announced == nil {
		var err error
		if announced, err = p.announcedForCheck(ctx); err != nil {
			return err
		}
	}
	return servedBy(announced, queue, e)
}

// announcedForCheck reads the announcements for the served check, retried
// while Redis is away, as the publish is.
func (p *Producer) announcedForCheck(ctx context.Context) (announced []Announcement, err error) {
	err = retryOutage(ctx, p.Client, p.logger(), "reading the worker announcements", IsOutage, func() error {
		announced, err = p.announcements(ctx)
		return err
	})
	return announced, err
}

// store writes a checked Envelope, with its task record.
func (p *Producer) store(ctx context.Context, queue string, e *Envelope, now time.Time) (string, error) {
	enc, body, err := EncodeBody(e, p.GzipMin, p.Limits)
	if err != nil {
		return "", err
	}
	keys := p.Keys.Queue(queue)
	bucket := BucketFor(e.Priority)
	token := PublishToken()
	log := p.logger().With("task_id", e.TaskID, "queue", queue)
	due := e.IsDue(now)
	fields := published(e, queue)
	fields["published_at"] = recordTime(now)
	var rec *record
	if due {
		rec = newRecords(p.TaskRecordRetention).activeStep(keys, e.TaskID, time.Time{}, fields)
	} else {
		fields["due_at"] = recordTime(e.ScheduleTime.Time)
		rec = newRecords(p.TaskRecordRetention).activeStep(keys, e.TaskID, e.ScheduleTime.Time, fields)
	}
	var id string
	err = retryOutage(ctx, p.Client, log, "publish", IsOutage, func() error {
		// The registry first, on its own (section 2): promoters serve the queue's
		// delayed tasks, and release the keyed ones in their turn (section 20).
		if !due || e.OrderingKey != nil {
			if err := p.Client.SAdd(ctx, p.Keys.Queues(), queue).Err(); err != nil {
				return err
			}
		}
		if due {
			return p.Durability.write(ctx, p.Client, keys.Stream(bucket), log, func(c redis.Cmdable) error {
				var err error
				k, args := rec.script(
					[]string{keys.Stream(bucket), keys.Delayed(), keys.DelayedData(), keys.Published(e.TaskID)},
					[]any{e.TaskID, enc, string(body), token, PublishDedupeMS}, 5)
				id, err = p.Scripts.Get("enqueue").Run(ctx, c, k, args...).Text()
				return err
			})
		}
		return p.Durability.write(ctx, p.Client, keys.Delayed(), log, func(c redis.Cmdable) error {
			_, err := c.Pipelined(ctx, func(pipe redis.Pipeliner) error {
				storeDelayed(ctx, pipe, p.Scripts, p.Keys, queue, e.TaskID, e.DueMS(now), bucket, enc, body, token, rec)
				return nil
			})
			return err
		})
	})
	return id, err
}

// logger is Log, else slog.Default().
func (p *Producer) logger() *slog.Logger {
	if p.Log != nil {
		return p.Log
	}
	return slog.Default()
}

// StoreDelayed queues schedule.lua on pipe, which may be a MULTI of the same
// queue's keys: the script is sent with EVAL, which never answers NOSCRIPT.
// The caller sends SADD <prefix>:queues <queue> first, on its own (a registry
// is never in a MULTI with a queue's keys: docs/protocol.md section 2), so a
// registry lost with a Redis restart is rebuilt and a crash in between leaves
// a listed queue with nothing in it, never a delayed task nobody lists.
// token is the publish token, the same for every try of one store.
func StoreDelayed(ctx context.Context, pipe redis.Pipeliner, scripts Scripts, ks KeySpace, queue,
	taskID string, dueMS int64, bucket Bucket, enc string, body []byte, token string) {
	storeDelayed(ctx, pipe, scripts, ks, queue, taskID, dueMS, bucket, enc, body, token, nil)
}

// storeDelayed is StoreDelayed writing rec, the task record, too.
func storeDelayed(ctx context.Context, pipe redis.Pipeliner, scripts Scripts, ks KeySpace, queue,
	taskID string, dueMS int64, bucket Bucket, enc string, body []byte, token string, rec *record) {
	q := ks.Queue(queue)
	keys, args := rec.script([]string{q.Delayed(), q.DelayedData(), q.Published(taskID)},
		[]any{taskID, strconv.FormatInt(dueMS, 10), string(bucket), enc, string(body), ks.Wakeup(),
			token, PublishDedupeMS}, 8)
	scripts.Get("schedule").Eval(ctx, pipe, keys, args...)
}

// Waiting is the entry id Publish answers for a keyed task stored to wait for
// its turn (docs/protocol.md section 20).
const Waiting = "waiting"

// PublishDedupeMS is how long enqueue.lua and schedule.lua remember a publish
// token (docs/protocol.md section 4).
const PublishDedupeMS = 90_000

// PublishToken is a new publish token: one per publish, the same for every try of it.
func PublishToken() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// payloadSchemas are the schemas this producer enforces, made on first use.
func (p *Producer) payloadSchemas() *PayloadSchemas {
	p.schemasOnce.Do(func() {
		p.schemas = &PayloadSchemas{Client: p.Client, Keys: p.Keys, Cache: p.SchemaCache, Log: p.Log}
	})
	return p.schemas
}
