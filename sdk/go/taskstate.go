package envelope

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"
)

// TaskInfo is what became of a task (docs/protocol.md section 14): State as a
// reader reports it, Queue where its record was found, Record the fields as
// written (nil when there is no record).
type TaskInfo struct {
	TaskID, Queue, State string
	Record               map[string]string
}

// GetTask reports the state of taskID, with the rules every reader uses: a
// scheduled or retrying task that is due and no longer delayed is queued, a
// running one whose worker has no liveness key is queued, a dead one whose
// dead-letter entry was purged is failed, and without a record it is scheduled
// when delayed, else unknown. queue "" looks in every queue of the registries
// and of the announced workers.
func (p *Producer) GetTask(ctx context.Context, queue, taskID string) (*TaskInfo, error) {
	if err := checkTaskID(taskID); err != nil {
		return nil, err
	}
	queues := []string{queue}
	if queue == "" {
		var err error
		if queues, err = p.knownQueues(ctx); err != nil {
			return nil, err
		}
	} else if err := CheckQueueName(queue); err != nil {
		return nil, err
	}
	for _, name := range queues {
		fields, err := p.Client.HGetAll(ctx, p.Keys.Queue(name).Task(taskID)).Result()
		if err != nil {
			return nil, fmt.Errorf("reading the task record: %w", err)
		}
		if len(fields) > 0 {
			state, err := p.readState(ctx, p.Keys.Queue(name), taskID, fields)
			return &TaskInfo{TaskID: taskID, Queue: name, State: state, Record: fields}, err
		}
	}
	for _, name := range queues {
		delayed, err := p.isDelayed(ctx, p.Keys.Queue(name), taskID)
		if err != nil {
			return nil, err
		}
		if delayed {
			return &TaskInfo{TaskID: taskID, Queue: name, State: StateScheduled}, nil
		}
	}
	return &TaskInfo{TaskID: taskID, Queue: queue, State: StateUnknown}, nil
}

// readState is the state a record reports, corrected for what happened since it was written.
func (p *Producer) readState(ctx context.Context, q QueueKeys, taskID string, fields map[string]string) (string, error) {
	state := fields["state"]
	switch state {
	case StateScheduled, StateRetrying:
		due, err := ParseTimestamp(fields["due_at"])
		if err != nil || due.After(time.Now()) {
			return state, nil
		}
		delayed, err := p.isDelayed(ctx, q, taskID)
		if err != nil || delayed {
			return state, err
		}
		return StateQueued, nil // promoted
	case StateRunning:
		alive, err := p.Client.Exists(ctx, p.Keys.Consumer(fields["worker"])).Result()
		if err != nil || alive == 1 {
			return state, err
		}
		return StateQueued, nil // its consumer died: the entry is taken over
	case StateDead:
		id := fields["dead_id"]
		if id == "" {
			return state, nil
		}
		msgs, err := p.Client.XRange(ctx, q.Dead(), id, id).Result()
		if err != nil || len(msgs) > 0 {
			return state, err
		}
		return StateFailed, nil // purged
	}
	return state, nil
}

func (p *Producer) isDelayed(ctx context.Context, q QueueKeys, taskID string) (bool, error) {
	err := p.Client.ZScore(ctx, q.Delayed(), taskID).Err()
	if err == redis.Nil {
		return false, nil
	}
	return err == nil, err
}

// knownQueues are the queues of the registries and of the announced workers, sorted.
func (p *Producer) knownQueues(ctx context.Context) ([]string, error) {
	var names []string
	for _, registry := range []string{p.Keys.Queues(), p.Keys.DeadQueues(), p.Keys.PeriodicQueues()} {
		members, err := p.Client.SMembers(ctx, registry).Result()
		if err != nil {
			return nil, fmt.Errorf("reading %s: %w", registry, err)
		}
		names = append(names, members...)
	}
	announced, err := p.announcements(ctx)
	if err != nil {
		return nil, err
	}
	for _, a := range announced {
		names = append(names, a.Queues...)
	}
	slices.Sort(names)
	return slices.Compact(names), nil
}
