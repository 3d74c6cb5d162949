package envelope

import (
	"context"
	"strconv"
	"sync"
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

	mu         sync.Mutex
	registered map[string]bool
}

// NewProducer returns a Producer with the default limits and gzip threshold.
func NewProducer(client redis.UniversalClient, prefix string, scripts Scripts) *Producer {
	return &Producer{Client: client, Keys: KeySpace{prefix}, Scripts: scripts,
		Limits: DefaultLimits, GzipMin: GzipMinBytes}
}

// Publish validates e (including max_delay) and stores it: XADD to its
// priority stream when due, schedule.lua into the delayed set otherwise.
// It returns the stream entry id, or "" when the task was delayed.
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
		return p.Client.XAdd(ctx, &redis.XAddArgs{
			Stream: keys.Stream(bucket),
			Values: []string{FieldVersion, WireVersion, FieldEncoding, enc, FieldBody, string(body)},
		}).Result()
	}
	if err := p.RegisterDelayedQueue(ctx, queue); err != nil {
		return "", err
	}
	err = p.Scripts.Get("schedule").Run(ctx, p.Client,
		[]string{keys.Delayed(), keys.DelayedData()},
		e.TaskID, strconv.FormatInt(e.DueMS(now), 10), string(bucket), enc, string(body),
		p.Keys.Wakeup()).Err()
	return "", err
}

// RegisterDelayedQueue adds queue to <prefix>:queues, once per Producer.
func (p *Producer) RegisterDelayedQueue(ctx context.Context, queue string) error {
	p.mu.Lock()
	done := p.registered[queue]
	p.mu.Unlock()
	if done {
		return nil
	}
	if err := p.Client.SAdd(ctx, p.Keys.Queues(), queue).Err(); err != nil {
		return err
	}
	p.mu.Lock()
	if p.registered == nil {
		p.registered = map[string]bool{}
	}
	p.registered[queue] = true
	p.mu.Unlock()
	return nil
}
