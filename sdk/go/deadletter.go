package envelope

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/user"
	"sort"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// DeadEntry is one dead-letter entry: its failure fields (failure_class,
// reason, exception_type, traceback, attempts, ...), the raw fields of the
// original stream entry, and its Envelope when those decode.
type DeadEntry struct {
	Queue       string
	ID          string
	Fields      map[string]string
	Raw         map[string]string
	Envelope    *Envelope // nil when the raw entry holds no valid Envelope
	DecodeError error     // why Envelope is nil
}

// FailureClass is why the task was dead-lettered (ClassTaskError, ...).
func (d *DeadEntry) FailureClass() string { return d.Fields["failure_class"] }

// DeadLetters lists, shows and replays dead-letter entries
// (<prefix>:{<queue>}:dead), the library form of the Python dead-letter tools.
type DeadLetters struct {
	Client  redis.UniversalClient
	Keys    KeySpace
	Scripts Scripts
	Limits  Limits
	GzipMin int
	// TaskRecordRetention is that of Producer: the record a replay writes.
	TaskRecordRetention time.Duration
	// Schemas are the payload schemas a replay enforces (section 16); nil: none.
	Schemas *PayloadSchemas
}

// NewDeadLetters returns the dead-letter tools of prefix with the default
// limits and the embedded scripts when scripts is nil.
func NewDeadLetters(client redis.UniversalClient, prefix string, scripts Scripts) *DeadLetters {
	if scripts == nil {
		scripts = DefaultScripts()
	}
	return &DeadLetters{Client: client, Keys: KeySpace{prefix}, Scripts: scripts,
		Limits: DefaultLimits, GzipMin: GzipMinBytes,
		Schemas: &PayloadSchemas{Client: client, Keys: KeySpace{prefix}}}
}

// Queues are the queues that have had dead-letter entries (<prefix>:dead-queues), sorted.
func (d *DeadLetters) Queues(ctx context.Context) ([]string, error) {
	queues, err := d.Client.SMembers(ctx, d.Keys.DeadQueues()).Result()
	sort.Strings(queues)
	return queues, err
}

// List returns up to limit entries of queue, oldest first, starting after the
// entry id after ("" for the first); limit <= 0 means 100.
func (d *DeadLetters) List(ctx context.Context, queue, after string, limit int) ([]*DeadEntry, error) {
	if err := CheckQueueName(queue); err != nil {
		return nil, err
	}
	if limit <= 0 {
		limit = 100
	}
	start := "-"
	if after != "" {
		start = "(" + after
	}
	msgs, err := d.Client.XRangeN(ctx, d.Keys.Queue(queue).Dead(), start, "+", int64(limit)).Result()
	if err != nil {
		return nil, err
	}
	out := make([]*DeadEntry, len(msgs))
	for i, m := range msgs {
		out[i] = d.entry(queue, m)
	}
	return out, nil
}

// Show returns one entry of queue by id, or nil when there is none.
func (d *DeadLetters) Show(ctx context.Context, queue, id string) (*DeadEntry, error) {
	if err := CheckQueueName(queue); err != nil {
		return nil, err
	}
	msgs, err := d.Client.XRange(ctx, d.Keys.Queue(queue).Dead(), id, id).Result()
	if err != nil || len(msgs) == 0 {
		return nil, err
	}
	return d.entry(queue, msgs[0]), nil
}

// ErrGone is returned by Replay when the entry no longer exists (someone
// replayed or purged it first).
var ErrGone = errors.New("dead-letter entry is gone")

// ReplayOptions edit a task before it is published again.
type ReplayOptions struct {
	// Edit changes the Envelope before it is validated and published; it
	// starts from the dead task with retry_count 0 and no schedule_time
	// (a replay runs now).
	Edit func(e *Envelope) error
	// Operator is recorded in the replay record (default user@host).
	Operator string
}

// Replay publishes a dead-lettered task again with replay.lua: the entry is
// removed and a replay record (<prefix>:{<queue>}:replayed) added in the same
// step, so two operators replaying one entry publish it once. It returns the
// new stream entry id (Waiting for a keyed task whose turn has not come); ErrGone when the entry is gone, a *MalformedEntry when
// it holds no valid Envelope, a *ValidationError when the edit broke it or the
// payload breaks its schema. The task record says queued again.
func (d *DeadLetters) Replay(ctx context.Context, queue, id string, opts ReplayOptions) (string, error) {
	entry, err := d.Show(ctx, queue, id)
	if err != nil {
		return "", err
	}
	if entry == nil {
		return "", ErrGone
	}
	if entry.Envelope == nil {
		return "", &MalformedEntry{Kind: ErrEnvelope,
			Reason: fmt.Sprintf("dead-letter entry %s holds no valid Envelope: %v", id, entry.DecodeError)}
	}
	next := entry.Envelope.Clone()
	next.RetryCount = 0
	next.ScheduleTime = nil
	if opts.Edit != nil {
		if err := opts.Edit(next); err != nil {
			return "", err
		}
	}
	// Round-trip through the wire form so the edit is checked like any reader checks it.
	checked, err := Parse(next.JSON(), d.Limits)
	if err != nil {
		return "", err
	}
	if err := CheckPublishable(checked, d.Limits, time.Now()); err != nil {
		return "", err
	}
	if d.Schemas != nil {
		if err := d.Schemas.Check(ctx, checked); err != nil {
			return "", err
		}
	}
	enc, body, err := EncodeBody(checked, d.GzipMin, d.Limits)
	if err != nil {
		return "", err
	}
	operator := opts.Operator
	if operator == "" {
		operator = defaultOperator()
	}
	if checked.OrderingKey != nil {
		// Its key's next tasks are released by promoters (protocol section 20): the
		// queue is registered first, on its own (section 2).
		if err := d.Client.SAdd(ctx, d.Keys.Queues(), queue).Err(); err != nil {
			return "", err
		}
	}
	q := d.Keys.Queue(queue)
	keys, args := newRecords(d.TaskRecordRetention).activeStep(q, checked.TaskID, time.Time{},
		published(checked, queue)).script(
		[]string{q.Dead(), q.Stream(BucketFor(checked.Priority)), q.Replayed()},
		[]any{id, enc, string(body), "replayed_at", Now().String(), "operator", operator}, 3)
	newID, err := d.Scripts.Get("replay").Run(ctx, d.Client, keys, args...).Text()
	if errors.Is(err, redis.Nil) {
		return "", ErrGone
	}
	return newID, err
}

func (d *DeadLetters) entry(queue string, m redis.XMessage) *DeadEntry {
	dl := &DeadEntry{Queue: queue, ID: m.ID, Fields: map[string]string{}, Raw: map[string]string{}}
	for k, v := range textFields(m.Values) {
		if raw, ok := strings.CutPrefix(k, "raw."); ok {
			dl.Raw[raw] = v
		} else {
			dl.Fields[k] = v
		}
	}
	dl.Envelope, dl.DecodeError = DecodeEntry(dl.Raw, d.Limits)
	if dl.DecodeError != nil {
		dl.Envelope = nil
	}
	return dl
}

func defaultOperator() string {
	name := "unknown"
	if u, err := user.Current(); err == nil && u.Username != "" {
		name = u.Username
	}
	host, _ := os.Hostname()
	return name + "@" + host
}
