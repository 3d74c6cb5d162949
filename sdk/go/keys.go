package envelope

import (
	"fmt"
	"strings"
)

// DefaultPrefix starts every key; DefaultGroup is the consumer group of every worker.
const (
	DefaultPrefix = "envelope"
	DefaultGroup  = "workers"
)

// Bucket is a priority stream of a queue.
type Bucket string

// Buckets, and the priorities that choose them (higher is more urgent).
const (
	High   Bucket = "high"
	Normal Bucket = "normal"
	Low    Bucket = "low"

	HighPriorityFrom   = 170
	NormalPriorityFrom = 85
)

// BucketsByUrgency is the order streams are read in.
var BucketsByUrgency = []Bucket{High, Normal, Low}

// BucketFor returns the bucket of a priority (0-255).
func BucketFor(priority int) Bucket {
	switch {
	case priority >= HighPriorityFrom:
		return High
	case priority >= NormalPriorityFrom:
		return Normal
	}
	return Low
}

// KeySpace builds key names under one prefix (docs/protocol.md section 2).
type KeySpace struct {
	Prefix string
}

// QueueKeys are the keys of one queue; all carry the hash tag {<queue>}.
type QueueKeys struct {
	Prefix, Queue string
}

// CheckQueueName refuses names that cannot be a Redis Cluster hash tag.
func CheckQueueName(queue string) error {
	if queue == "" || strings.ContainsAny(queue, "{}") {
		return fmt.Errorf("queue name %q must be non-empty and contain no '{' or '}'", queue)
	}
	return nil
}

// Queue returns the keys of queue (call CheckQueueName first for user input).
func (k KeySpace) Queue(queue string) QueueKeys { return QueueKeys{k.Prefix, queue} }

// Queues is the set of queues that have delayed tasks.
func (k KeySpace) Queues() string { return k.Prefix + ":queues" }

// DeadQueues is the set of queues that have dead-letter entries (the tools list it).
func (k KeySpace) DeadQueues() string { return k.Prefix + ":dead-queues" }

// Cancelled is the sorted set of cancelled task ids of every queue, scored by
// cancel time in ms (docs/protocol.md section 10).
func (k KeySpace) Cancelled() string { return k.Prefix + ":cancelled" }

// Consumer is the liveness key of a consumer.
func (k KeySpace) Consumer(name string) string { return k.Prefix + ":consumer:" + name }

// Idempotency is the claim / done marker of an idempotency key.
func (k KeySpace) Idempotency(taskType, key string) string {
	return k.Prefix + ":idem:" + taskType + ":" + key
}

// Retrying is the set of running retries of a task type (retry_slot.lua).
func (k KeySpace) Retrying(taskType string) string { return k.Prefix + ":retrying:" + taskType }

// Wakeup is the pub/sub channel that wakes promoters.
func (k KeySpace) Wakeup() string { return k.Prefix + ":wakeup" }

// PeriodicQueues is the set of queues that have periodic entries.
func (k KeySpace) PeriodicQueues() string { return k.Prefix + ":periodic-queues" }

// Workers is the sorted set of consumers that announced themselves, scored by
// when they last did, in ms (docs/protocol.md section 15).
func (k KeySpace) Workers() string { return k.Prefix + ":workers" }

// Worker is the announcement of a consumer (section 15).
func (k KeySpace) Worker(consumer string) string { return k.Prefix + ":worker:" + consumer }

// Schemas is the hash of payload schemas, field <task_type>@<payload_version> (section 16).
func (k KeySpace) Schemas() string { return k.Prefix + ":schemas" }

// Base is "<prefix>:{<queue>}".
func (q QueueKeys) Base() string { return q.Prefix + ":{" + q.Queue + "}" }

// Stream is the task stream of a bucket.
func (q QueueKeys) Stream(b Bucket) string { return q.Base() + ":" + string(b) }

// TaskStreams are the task streams, most urgent first.
func (q QueueKeys) TaskStreams() []string {
	return []string{q.Stream(High), q.Stream(Normal), q.Stream(Low)}
}

// Delayed is the sorted set of delayed task ids by due time (ms).
func (q QueueKeys) Delayed() string { return q.Base() + ":delayed" }

// Published is the marker of the last publish of taskID, which absorbs a
// publish retried after its reply was lost.
func (q QueueKeys) Published(taskID string) string { return q.Base() + ":published:" + taskID }

// DelayedData is the hash of delayed task id to stored entry.
func (q QueueKeys) DelayedData() string { return q.Base() + ":delayed:data" }

// Task is the task record of taskID (docs/protocol.md section 14).
func (q QueueKeys) Task(taskID string) string { return q.Base() + ":task:" + taskID }

// Dead is the dead-letter stream.
func (q QueueKeys) Dead() string { return q.Base() + ":dead" }

// Replayed is the stream of replay records (replay.lua).
func (q QueueKeys) Replayed() string { return q.Base() + ":replayed" }

// BucketOfStream returns the bucket of one of this queue's task streams.
func (q QueueKeys) BucketOfStream(stream string) (Bucket, bool) {
	for _, b := range BucketsByUrgency {
		if q.Stream(b) == stream {
			return b, true
		}
	}
	return "", false
}

// Stats is the hash of the workers' statistics of this queue (docs/protocol.md section 17).
func (q QueueKeys) Stats() string { return q.Base() + ":stats" }

// Limits is the hash of the limits of task types on this queue, field
// <task_type> (docs/protocol.md section 19).
func (q QueueKeys) Limits() string { return q.Base() + ":limits" }

// Running is the sorted set of the concurrency slots of taskType, member
// "<stream> <entry id>", scored by the slot's deadline in ms (section 19).
func (q QueueKeys) Running(taskType string) string { return q.Base() + ":running:" + taskType }

// SlotFreed is the stream a settle that frees a slot appends to; it exists only
// while entries wait for a slot (section 19, "Waking on a freed slot").
func (q QueueKeys) SlotFreed() string { return q.Base() + ":slot-freed" }

// Breaker is the hash of the circuit breaker of taskType (state closed, open or
// half_open, since in ms...), written only by read.lua (section 19).
func (q QueueKeys) Breaker(taskType string) string { return q.Base() + ":breaker:" + taskType }

// Order is the list of the task ids of one ordering key in the order they
// joined it; the head's turn it is (docs/protocol.md section 20).
func (q QueueKeys) Order(key string) string { return q.Base() + ":order:" + key }

// OrderWaiting is the hash of the tasks of an ordering key waiting for their
// turn, task id -> "<bucket>\n<enc>\n<body>" (section 20).
func (q QueueKeys) OrderWaiting(key string) string { return q.Base() + ":order-waiting:" + key }

// OrderAdvanced is the list of ordering keys whose head was settled, from which
// promote.lua releases the next head (section 20).
func (q QueueKeys) OrderAdvanced() string { return q.Base() + ":order-advanced" }

// OrderHeld is the sorted set of ordering keys held by runs acknowledged before
// they end, "<key>\n<task_id>\n<stream>\n<entry id>" scored by deadline in ms (section 20).
func (q QueueKeys) OrderHeld() string { return q.Base() + ":order-held" }

// OrderPolicy is the hash of what a dead-lettered head does to its ordering key,
// field <task_type> -> advance (the default) or halt (section 20).
func (q QueueKeys) OrderPolicy() string { return q.Base() + ":order-policy" }

// OrderHalted is the hash of halted ordering keys, key -> task id of the
// dead-lettered head the key waits for (section 20).
func (q QueueKeys) OrderHalted() string { return q.Base() + ":order-halted" }
