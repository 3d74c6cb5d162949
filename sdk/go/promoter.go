package envelope

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/redis/go-redis/v9"
)

// Promoter moves due delayed tasks of every queue in <prefix>:queues to their
// streams with promote.lua (docs/protocol.md section 6). Any number of
// promoters, in any language, may run at once.
type Promoter struct {
	Client  redis.UniversalClient
	Keys    KeySpace
	Scripts Scripts
	Batch   int           // tasks per promote.lua call (1000)
	MaxIdle time.Duration // longest sleep without looking at the registry (5 s)
	Log     *slog.Logger
}

// RunOnce promotes what is due now on Redis's clock, with one promote.lua per
// queue (each call touches one queue's slot); it returns how many tasks moved,
// the earliest due time still waiting (ms, -1 when none) and the errors of the
// queues it could not promote (the others are promoted all the same).
func (p *Promoter) RunOnce(ctx context.Context) (int64, int64, error) {
	batch := int64(p.Batch)
	if batch <= 0 {
		batch = 1000
	}
	now, err := p.Client.Time(ctx).Result()
	if err != nil {
		return 0, -1, err
	}
	nowMS := now.UnixMilli()
	queues, err := p.Client.SMembers(ctx, p.Keys.Queues()).Result()
	if err != nil {
		return 0, -1, err
	}
	var moved int64
	earliest := int64(-1)
	var failed []error // one queue's node failing over does not hold the others back
	for _, queue := range queues {
		if CheckQueueName(queue) != nil {
			continue
		}
		q := p.Keys.Queue(queue)
		for {
			res, err := p.Scripts.Get("promote").Run(ctx, p.Client,
				[]string{q.Delayed(), q.DelayedData(), q.Stream(High), q.Stream(Normal), q.Stream(Low)},
				nowMS, batch).Int64Slice()
			if err != nil {
				failed = append(failed, fmt.Errorf("promote.lua on %s: %w", queue, err))
				break
			}
			moved += res[0]
			if res[0] < batch {
				if next := res[1]; next >= 0 && (earliest < 0 || next < earliest) {
					earliest = next
				}
				break
			}
		}
	}
	return moved, earliest, errors.Join(failed...)
}

// Run promotes until ctx ends, sleeping until the next due time or a wake-up
// on <prefix>:wakeup.
func (p *Promoter) Run(ctx context.Context) {
	maxIdle := p.MaxIdle
	if maxIdle <= 0 {
		maxIdle = 5 * time.Second
	}
	log := p.Log
	if log == nil {
		log = slog.Default()
	}
	sub := p.Client.Subscribe(ctx, p.Keys.Wakeup())
	defer sub.Close()
	wake := sub.Channel()
	for ctx.Err() == nil {
		moved, next, err := p.RunOnce(ctx)
		wait := maxIdle
		switch {
		case err != nil:
			if ctx.Err() == nil {
				log.Warn("promotion failed; retrying", "error", err.Error())
				refreshRoutes(ctx, p.Client, err)
			}
			wait = time.Second
		case next >= 0:
			if now, err := p.Client.Time(ctx).Result(); err == nil {
				wait = min(maxIdle, max(time.Duration(next-now.UnixMilli())*time.Millisecond, 0))
			}
		}
		if moved > 0 {
			log.Debug("promoted due tasks", "moved", moved)
		}
		if wait <= 0 {
			continue
		}
		timer := time.NewTimer(wait)
		select {
		case <-ctx.Done():
		case <-wake:
		case <-timer.C:
		}
		timer.Stop()
	}
}
