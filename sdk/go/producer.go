package envelope

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// NewClient connects to a redis:// or rediss:// URL with the settings this
// peer relies on: RESP2 (Lua false reads as nil, as in every other language)
// and no connection-time commands that older servers refuse.
func NewClient(url string) (*redis.Client, error) {
	opts, err := redis.ParseURL(url)
	if err != nil {
		return nil, err
	}
	opts.Protocol = 2
	opts.DisableIdentity = true
	opts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	return redis.NewClient(opts), nil
}

// Producer publishes Envelopes (docs/protocol.md section 4).
type Producer struct {
	Client  redis.UniversalClient
	Keys    KeySpace
	Scripts Scripts
	Limits  Limits
	GzipMin int // bodies of at least this many bytes are compressed; <= 0 never
}

// NewProducer returns a Producer with the default limits and gzip threshold.
func NewProducer(client redis.UniversalClient, prefix string, scripts Scripts) *Producer {
	return &Producer{Client: client, Keys: KeySpace{prefix}, Scripts: scripts,
		Limits: DefaultLimits, GzipMin: GzipMinBytes}
}

// Publish validates e (including max_delay) and stores it: enqueue.lua into
// its priority stream when due (removing a delayed copy of the same task_id),
// SADD <prefix>:queues and schedule.lua into the delayed set otherwise.
// It returns the stream entry id, or "" when the task was delayed.
//
// e must carry its identity (task_id, trace_id, created_at): build it with
// New, which fills them in.
func (p *Producer) Publish(ctx context.Context, queue string, e *Envelope) (string, error) {
	if err := CheckQueueName(queue); err != nil {
		return "", err
	}
	now := time.Now()
	if err := e.Validate(p.Limits); err != nil {
		return "", err
	}
	if err := CheckPublishable(e, p.Limits, now); err != nil {
		return "", err
	}
	enc, body, err := EncodeBody(e, p.GzipMin, p.Limits)
	if err != nil {
		return "", err
	}
	keys := p.Keys.Queue(queue)
	bucket := BucketFor(e.Priority)
	if e.IsDue(now) {
		return p.Scripts.Get("enqueue").Run(ctx, p.Client,
			[]string{keys.Stream(bucket), keys.Delayed(), keys.DelayedData(), keys.Published(e.TaskID)},
			e.TaskID, enc, string(body), PublishToken(), PublishDedupeMS).Text()
	}
	_, err = p.Client.Pipelined(ctx, func(pipe redis.Pipeliner) error {
		StoreDelayed(ctx, pipe, p.Scripts, p.Keys, queue, e.TaskID, e.DueMS(now), bucket, enc, body,
			PublishToken())
		return nil
	})
	return "", err
}

// StoreDelayed queues, on pipe, what every delayed store sends in one round
// trip: SADD <prefix>:queues <queue> (so a registry lost with a Redis restart
// is rebuilt) and schedule.lua. The script is sent with EVAL, which never
// answers NOSCRIPT, so the pipeline may be a MULTI transaction.
// token is the publish token, the same for every try of one store.
func StoreDelayed(ctx context.Context, pipe redis.Pipeliner, scripts Scripts, ks KeySpace, queue,
	taskID string, dueMS int64, bucket Bucket, enc string, body []byte, token string) {
	q := ks.Queue(queue)
	pipe.SAdd(ctx, ks.Queues(), queue)
	scripts.Get("schedule").Eval(ctx, pipe, []string{q.Delayed(), q.DelayedData(), q.Published(taskID)},
		taskID, strconv.FormatInt(dueMS, 10), string(bucket), enc, string(body), ks.Wakeup(),
		token, PublishDedupeMS)
}

// PublishDedupeMS is how long enqueue.lua and schedule.lua remember a publish
// token (docs/protocol.md section 4).
const PublishDedupeMS = 90_000

// PublishToken is a new publish token: one per publish, the same for every try of it.
func PublishToken() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
