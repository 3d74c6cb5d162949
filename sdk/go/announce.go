package envelope

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// AnnounceKeep is how long a worker's announcement is kept after it wrote it
// (announce_keep_ms): workers seen within it count as recently seen.
const AnnounceKeep = time.Hour

// announcedFor is how long a member of <prefix>:workers is kept by its readers.
const announcedFor = 24 * time.Hour

// Announcement is what a consumer says about itself in
// <prefix>:worker:<consumer> (docs/protocol.md section 15).
type Announcement struct {
	Consumer    string             `json:"consumer"`
	Language    string             `json:"language"`
	Host        string             `json:"host"`
	PID         int                `json:"pid"`
	Queues      []string           `json:"queues"`
	Serves      map[string][]int64 `json:"serves"` // task type -> payload versions; empty: every version
	Concurrency int                `json:"concurrency"`
	StartedAt   string             `json:"started_at"`
	SeenAt      string             `json:"seen_at"`
	StoppedAt   string             `json:"stopped_at,omitempty"`
	// HeartbeatMS is how often the announcement is written again (the liveness
	// renewal period); 0 when a reader found none (then take DefaultHeartbeatMS).
	HeartbeatMS int64 `json:"heartbeat_ms,omitempty"`
}

// DefaultHeartbeatMS is the heartbeat_ms of an announcement that has none.
const DefaultHeartbeatMS = 10_000

// Accepts reports whether the announcement serves taskType at version on queue.
func (a *Announcement) Accepts(queue, taskType string, version int64) bool {
	versions, ok := a.Serves[taskType]
	return ok && slices.Contains(a.Queues, queue) && (len(versions) == 0 || slices.Contains(versions, version))
}

// announcement is this consumer's announcement; stopped marks a clean shutdown.
func (w *Worker) announcement(stopped bool) Announcement {
	pid, _ := strconv.Atoi(w.pid)
	a := Announcement{Consumer: w.cfg.Consumer, Language: Language, Host: w.host, PID: pid,
		Queues: w.cfg.Queues, Serves: w.serves(), Concurrency: 1,
		StartedAt: recordTime(w.startedAt), SeenAt: recordTime(time.Now()),
		HeartbeatMS: w.renewEvery().Milliseconds()}
	if stopped {
		a.StoppedAt = a.SeenAt
	}
	return a
}

// announceSelf writes the announcement: ZADD <prefix>:workers first and awaited,
// then SET <prefix>:worker:<consumer> PX AnnounceKeep.
func (w *Worker) announceSelf(ctx context.Context, stopped bool) error {
	value, err := json.Marshal(w.announcement(stopped))
	if err != nil {
		return err
	}
	if err := w.client.ZAdd(ctx, w.keys.Workers(), redis.Z{Score: float64(time.Now().UnixMilli()), Member: w.cfg.Consumer}).Err(); err != nil {
		return fmt.Errorf("ZADD %s: %w", w.keys.Workers(), err)
	}
	return w.client.Set(ctx, w.keys.Worker(w.cfg.Consumer), value, AnnounceKeep).Err()
}
