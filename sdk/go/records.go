package envelope

import (
	"context"
	"encoding/json"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"
)

// Task record states (docs/protocol.md section 14); GetTask also reports
// StateFailed and StateUnknown.
const (
	StateScheduled = "scheduled"
	StateQueued    = "queued"
	StateRunning   = "running"
	StateRetrying  = "retrying"
	StateSucceeded = "succeeded"
	StateDead      = "dead"
	StateCancelled = "cancelled"
	StateFailed    = "failed"
	StateUnknown   = "unknown"
)

// DefaultTaskRecordRetention is how long a task record in a final state is
// kept (task_record_retention). A negative retention (NoTaskRecords) turns
// records off; zero takes this default, as every zero setting does.
const (
	DefaultTaskRecordRetention = time.Hour
	NoTaskRecords              = time.Duration(-1)
)

// activeRecordKeep is the least time a record in a non-final state is kept
// after the later of its write and its due time.
const activeRecordKeep = 7 * 24 * time.Hour

// maxRecordError is the longest error field of a record, in characters.
const maxRecordError = 1000

// recordTime writes t as a record's times are written: UTC, milliseconds.
func recordTime(t time.Time) string { return t.UTC().Format("2006-01-02T15:04:05.000Z07:00") }

// records writes the task records of one writer; retention <= 0 writes none.
type records struct {
	retention time.Duration
}

// newRecords resolves a retention setting: 0 is the default, negative is off.
func newRecords(retention time.Duration) records {
	if retention == 0 {
		retention = DefaultTaskRecordRetention
	}
	return records{retention: max(retention, 0)}
}

// record is the task record one step writes: its key and spec (section 14).
// A nil *record writes nothing.
type record struct {
	key  string
	spec map[string]any
}

// finalStep is the record of a step that ends the task (succeeded, dead, cancelled).
func (r records) finalStep(q QueueKeys, taskID string, fields map[string]string) *record {
	return r.step(q, taskID, fields, r.retention, 0)
}

// activeStep is the record of a step that leaves the task to run later, due
// at due (zero: now).
func (r records) activeStep(q QueueKeys, taskID string, due time.Time, fields map[string]string) *record {
	keep := max(activeRecordKeep, r.retention) + max(time.Until(due), 0)
	return r.step(q, taskID, fields, keep, 0)
}

// requeueStep is the record of requeue.lua, which ends queued or dead.
func (r records) requeueStep(q QueueKeys, taskID string) *record {
	keep := max(activeRecordKeep, r.retention)
	return r.step(q, taskID, map[string]string{"updated_at": recordTime(time.Now())}, keep, r.retention)
}

func (r records) step(q QueueKeys, taskID string, fields map[string]string, ttl, deadTTL time.Duration) *record {
	if r.retention <= 0 || taskID == "" {
		return nil
	}
	if _, ok := fields["updated_at"]; !ok {
		fields["updated_at"] = recordTime(time.Now())
	}
	spec := map[string]any{"ttl_ms": ttl.Milliseconds(), "fields": fields}
	if deadTTL > 0 {
		spec["dead_ttl_ms"] = deadTTL.Milliseconds()
	}
	return &record{key: q.Task(taskID), spec: spec}
}

// published are the record fields of a publish (or replay) of e on queue.
func published(e *Envelope, queue string) map[string]string {
	return map[string]string{
		"task_type":       e.TaskType,
		"payload_version": strconv.FormatInt(e.PayloadVersion, 10),
		"queue":           queue,
		"retry_count":     strconv.FormatInt(e.RetryCount, 10),
	}
}

// script adds the record to a script call: its key after the others, its
// spec at ARGV index fixed (0-based: right after the script's fixed ARGV).
func (r *record) script(keys []string, args []any, fixed int) ([]string, []any) {
	if r == nil {
		return keys, args
	}
	spec, _ := json.Marshal(r.spec)
	out := make([]any, 0, len(args)+1)
	out = append(append(append(out, args[:fixed]...), string(spec)), args[fixed:]...)
	return append(keys, r.key), out
}

// hset queues the record's fields, state and expiry on a MULTI (the start
// and the acknowledgements), with attempts incremented when increment is set.
func (r *record) hset(ctx context.Context, p redis.Pipeliner, state string, increment bool) {
	if r == nil {
		return
	}
	fields := r.spec["fields"].(map[string]string)
	args := make([]any, 0, 2*len(fields)+2)
	for k, v := range fields {
		args = append(args, k, v)
	}
	p.HSet(ctx, r.key, append(args, "state", state)...)
	if increment {
		p.HIncrBy(ctx, r.key, "attempts", 1)
	}
	if ttl := r.spec["ttl_ms"].(int64); ttl > 0 {
		p.PExpire(ctx, r.key, time.Duration(ttl)*time.Millisecond)
	}
}

// recordError is the error field of a record: "<type>: <message>", cut to
// maxRecordError characters.
func recordError(kind, message string) string {
	text := kind + ": " + message
	if utf8.RuneCountInString(text) <= maxRecordError {
		return text
	}
	return string([]rune(text)[:maxRecordError])
}
