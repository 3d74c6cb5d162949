package envelope

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// NotServedError is a task that no live or recently seen worker of its queue
// serves (docs/protocol.md section 15); Serves is what the queue's workers serve.
type NotServedError struct {
	Queue, TaskType string
	PayloadVersion  int64
	Serves          map[string][]int64
}

func (e *NotServedError) Error() string {
	served := "nothing: no worker of this queue was seen"
	if len(e.Serves) > 0 {
		b, _ := json.Marshal(e.Serves)
		served = string(b)
	}
	return fmt.Sprintf("task_type %q payload_version %d is not served on queue %q; its workers serve %s",
		e.TaskType, e.PayloadVersion, e.Queue, served)
}

// Announcements are the announcements of the workers seen in the last
// AnnounceKeep (live or recently seen), after dropping registry members older than a day.
func (p *Producer) Announcements(ctx context.Context) ([]Announcement, error) {
	return p.announcements(ctx)
}

func (p *Producer) announcements(ctx context.Context) ([]Announcement, error) {
	now := time.Now()
	cut := strconv.FormatInt(now.Add(-announcedFor).UnixMilli(), 10)
	if err := p.Client.ZRemRangeByScore(ctx, p.Keys.Workers(), "-inf", cut).Err(); err != nil {
		return nil, fmt.Errorf("pruning %s: %w", p.Keys.Workers(), err)
	}
	consumers, err := p.Client.ZRange(ctx, p.Keys.Workers(), 0, -1).Result()
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", p.Keys.Workers(), err)
	}
	// One GET per key (they have no hash tag): a cluster client splits the pipeline per node.
	cmds := make([]*redis.StringCmd, len(consumers))
	_, err = p.Client.Pipelined(ctx, func(pipe redis.Pipeliner) error {
		for i, c := range consumers {
			cmds[i] = pipe.Get(ctx, p.Keys.Worker(c))
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, fmt.Errorf("reading the worker announcements: %w", err)
	}
	out := []Announcement{}
	for i, cmd := range cmds {
		var a Announcement
		if cmd.Err() != nil || json.Unmarshal([]byte(cmd.Val()), &a) != nil {
			if cmd.Err() == nil {
				p.logger().Warn("unreadable worker announcement ignored", "consumer", consumers[i])
			}
			continue
		}
		out = append(out, a)
	}
	return out, nil
}

// servedBy is nil when an announcement serves e on queue, else a *NotServedError.
func servedBy(announced []Announcement, queue string, e *Envelope) error {
	serves := map[string][]int64{}
	for _, a := range announced {
		if a.Accepts(queue, e.TaskType, e.PayloadVersion) {
			return nil
		}
		if !slices.Contains(a.Queues, queue) {
			continue
		}
		for taskType, versions := range a.Serves {
			serves[taskType] = union(serves[taskType], versions)
		}
	}
	return &NotServedError{Queue: queue, TaskType: e.TaskType, PayloadVersion: e.PayloadVersion, Serves: serves}
}

// union merges version lists; an empty list (every version) absorbs the others.
func union(have, more []int64) []int64 {
	if (have != nil && len(have) == 0) || len(more) == 0 {
		return []int64{}
	}
	set := map[int64]bool{}
	for _, v := range append(slices.Clone(have), more...) {
		set[v] = true
	}
	return slices.Sorted(maps.Keys(set))
}
