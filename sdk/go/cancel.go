package envelope

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// CancelMarkTTL is how long a cancel mark is kept (docs/protocol.md section 10).
const CancelMarkTTL = 7 * 24 * time.Hour

// CancelStatus is what cancelling a task found.
type CancelStatus string

// Outcomes of Producer.Cancel (docs/protocol.md section 10).
const (
	// CancelRemoved: the task waited in the delayed set of a queue and was removed from it.
	CancelRemoved CancelStatus = "removed"
	// CancelMarked: the task is marked; a worker that receives it acknowledges it without running it.
	CancelMarked CancelStatus = "marked"
	// CancelAlready: the task was marked before.
	CancelAlready CancelStatus = "already"
)

// CancelResult is the outcome of a cancel: its status and, for CancelRemoved,
// the queue whose delayed set held the task.
type CancelResult struct {
	Status CancelStatus
	Queue  string
}

// Cancel cancels a task knowing only its id: it marks the id in
// <prefix>:cancelled (marks older than CancelMarkTTL are dropped in the same
// MULTI), then removes it from the delayed set of every queue listed in
// <prefix>:queues with cancel.lua, which writes the task record (cancelled) there. The mark is written first and always, so a
// task already in a stream, or published again within CancelMarkTTL, is
// acknowledged without running by whichever worker receives it.
func (p *Producer) Cancel(ctx context.Context, taskID string) (CancelResult, error) {
	return p.cancel(ctx, taskID, nil)
}

// CancelInQueue is Cancel looking for the task in the delayed set of queue only.
func (p *Producer) CancelInQueue(ctx context.Context, queue, taskID string) (CancelResult, error) {
	if err := CheckQueueName(queue); err != nil {
		return CancelResult{}, err
	}
	return p.cancel(ctx, taskID, []string{queue})
}

func (p *Producer) cancel(ctx context.Context, taskID string, queues []string) (CancelResult, error) {
	if err := checkTaskID(taskID); err != nil {
		return CancelResult{}, err
	}
	now := time.Now().UnixMilli()
	log := p.logger().With("task_id", taskID)
	// Every step is safe to repeat: retried while Redis is away or failing over.
	retried := func(what string, step func() error) error {
		return retryOutage(ctx, p.Client, log, what, IsOutage, step)
	}
	var added *redis.IntCmd
	err := retried("cancel mark", func() error {
		_, err := p.Client.TxPipelined(ctx, func(pipe redis.Pipeliner) error {
			pipe.ZRemRangeByScore(ctx, p.Keys.Cancelled(), "-inf", strconv.FormatInt(now-CancelMarkTTL.Milliseconds(), 10))
			added = pipe.ZAddNX(ctx, p.Keys.Cancelled(), redis.Z{Score: float64(now), Member: taskID})
			return nil
		})
		return err
	})
	if err != nil {
		return CancelResult{}, fmt.Errorf("marking task %s cancelled: %w", taskID, err)
	}
	if queues == nil {
		err := retried("listing the queues", func() (err error) {
			queues, err = p.Client.SMembers(ctx, p.Keys.Queues()).Result()
			return err
		})
		if err != nil {
			return CancelResult{}, fmt.Errorf("listing the queues (%s): %w", p.Keys.Queues(), err)
		}
	}
	removed := CancelResult{}
	for _, queue := range queues { // every queue: the same id may wait in several
		q := p.Keys.Queue(queue)
		keys, args := newRecords(p.TaskRecordRetention).finalStep(q, taskID,
			map[string]string{"finished_at": recordTime(time.Now())}).script(
			[]string{q.Delayed(), q.DelayedData()}, []any{taskID}, 1)
		var got string
		err := retried("cancel.lua", func() (err error) {
			got, err = p.Scripts.Get("cancel").Run(ctx, p.Client, keys, args...).Text()
			return err
		})
		if err != nil {
			return CancelResult{}, fmt.Errorf("cancel.lua on queue %s: %w", queue, err)
		}
		if got == string(CancelRemoved) && removed.Status == "" {
			removed = CancelResult{Status: CancelRemoved, Queue: queue}
		}
	}
	switch {
	case removed.Status != "":
		return removed, nil
	case added.Val() == 0:
		return CancelResult{Status: CancelAlready}, nil
	}
	return CancelResult{Status: CancelMarked}, nil
}

// checkTaskID applies the task_id rules of docs/protocol.md section 1.
func checkTaskID(taskID string) error {
	c := &checker{}
	c.token(&Value{Kind: String, Text: taskID}, "task_id", maxTaskIDChars)
	if len(c.violations) > 0 {
		return &ValidationError{c.violations}
	}
	return nil
}
