package envelope

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Outcome counters of the statistics hash (docs/protocol.md section 17).
const (
	StatSucceeded = "succeeded" // attempts whose handler returned
	StatFailed    = "failed"    // attempts whose handler failed or timed out, or whose payload was refused
	StatRetried   = "retried"   // retries written with retry_count + 1
	StatDead      = "dead"      // dead-letter entries written
	StatDuplicate = "duplicate" // entries acknowledged unrun: their idempotency key was done
)

// Histograms of the statistics hash: how long an attempt ran, how long it waited to start.
const (
	HistogramRun  = "run"
	HistogramWait = "wait"
)

// UndecodedTaskType is the task type under which an entry whose Envelope could
// not be decoded is counted.
const UndecodedTaskType = "-"

// StatsKeep is the expiry every write of a statistics hash sets (30 days).
const StatsKeep = 30 * 24 * time.Hour

// statsBucket is one histogram bucket: its bound and how the field names it.
type statsBucket struct {
	le   time.Duration
	name string
}

// statsBuckets are the histogram bounds of section 17; an observation above
// the last one falls in "inf".
var statsBuckets = [...]statsBucket{
	{5 * time.Millisecond, "0.005"}, {10 * time.Millisecond, "0.01"}, {25 * time.Millisecond, "0.025"},
	{50 * time.Millisecond, "0.05"}, {100 * time.Millisecond, "0.1"}, {250 * time.Millisecond, "0.25"},
	{500 * time.Millisecond, "0.5"}, {time.Second, "1"}, {2500 * time.Millisecond, "2.5"},
	{5 * time.Second, "5"}, {10 * time.Second, "10"}, {30 * time.Second, "30"}, {time.Minute, "60"},
	{5 * time.Minute, "300"}, {15 * time.Minute, "900"}, {time.Hour, "3600"},
}

// statsFieldsPerType is how many fields one task type has: five outcomes and
// two histograms of 17 buckets and a sum.
const statsFieldsPerType = 5 + 2*(len(statsBuckets)+2)

// maxStatsFields caps the fields a Stats buffer holds (1,000 task types' worth):
// increments of new fields past it are dropped, and the drop is reported by
// the next Flush.
const maxStatsFields = 1000 * statsFieldsPerType

// StatsField is the field of the statistics hash for taskType and name, in
// this SDK's language: "<task_type> go <name>".
func StatsField(taskType, name string) string { return taskType + " " + Language + " " + name }

// bucketName is the bucket of a histogram observation of d.
func bucketName(d time.Duration) string {
	for _, b := range statsBuckets {
		if d <= b.le {
			return b.name
		}
	}
	return "inf"
}

// Stats buffers a worker's statistics in memory, summed per queue and field,
// until Flush writes them to each queue's hash <prefix>:{<queue>}:stats
// (docs/protocol.md section 17). It is safe for concurrent use.
type Stats struct {
	Keys KeySpace

	mu      sync.Mutex
	pending map[string]map[string]int64 // queue -> field -> increment
	fields  int                         // fields held, over every queue
	dropped int64                       // increments dropped at the cap since the last Flush
}

// Count adds 1 to the counter name (StatSucceeded...) of taskType on queue.
func (s *Stats) Count(queue, taskType, name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.add(queue, StatsField(taskType, name), 1)
}

// Observe adds d to the histogram (HistogramRun or HistogramWait) of taskType
// on queue: 1 to its bucket, d in microseconds to its sum. A negative d counts as 0.
func (s *Stats) Observe(queue, taskType, histogram string, d time.Duration) {
	d = max(d, 0)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.add(queue, StatsField(taskType, histogram+"_le_"+bucketName(d)), 1)
	s.add(queue, StatsField(taskType, histogram+"_sum_us"), int64((d+time.Microsecond/2)/time.Microsecond))
}

// add adds n to field of queue; s.mu is held.
func (s *Stats) add(queue, field string, n int64) {
	fields := s.pending[queue]
	if _, held := fields[field]; !held {
		if s.fields >= maxStatsFields {
			s.dropped += n
			return
		}
		if fields == nil {
			if s.pending == nil {
				s.pending = map[string]map[string]int64{}
			}
			fields = map[string]int64{}
			s.pending[queue] = fields
		}
		s.fields++
	}
	fields[field] += n
}

// Flush writes the increments held, one MULTI of HINCRBY and PEXPIRE per
// queue (the hash is in the queue's slot, so this works on a Cluster). The
// increments of a queue whose write fails are kept for the next Flush.
func (s *Stats) Flush(ctx context.Context, client redis.UniversalClient) error {
	s.mu.Lock()
	pending, dropped := s.pending, s.dropped
	s.pending, s.fields, s.dropped = nil, 0, 0
	s.mu.Unlock()
	var errs []error
	if dropped > 0 {
		errs = append(errs, fmt.Errorf("%d statistics increments dropped: the buffer holds at most %d fields",
			dropped, maxStatsFields))
	}
	for queue, fields := range pending {
		key := s.Keys.Queue(queue).Stats()
		_, err := client.TxPipelined(ctx, func(p redis.Pipeliner) error {
			for field, n := range fields {
				p.HIncrBy(ctx, key, field, n)
			}
			p.PExpire(ctx, key, StatsKeep)
			return nil
		})
		if err != nil {
			errs = append(errs, fmt.Errorf("writing %s: %w", key, err))
			s.keep(queue, fields)
		}
	}
	return errors.Join(errs...)
}

// keep puts back the increments of a failed write.
func (s *Stats) keep(queue string, fields map[string]int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for field, n := range fields {
		s.add(queue, field, n)
	}
}

// Pending is the increments held for queue and not written yet, by field.
func (s *Stats) Pending(queue string) map[string]int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int64, len(s.pending[queue]))
	for field, n := range s.pending[queue] {
		out[field] = n
	}
	return out
}

// waitStart is when env became due: its schedule_time when set, else its created_at.
func waitStart(env *Envelope) time.Time {
	if env.ScheduleTime != nil {
		return env.ScheduleTime.Time
	}
	return env.CreatedAt.Time
}
