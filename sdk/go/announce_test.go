package envelope

// Worker announcements and the producer's served check (docs/protocol.md
// section 15) against a real Redis.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

func (e *env) announcement(consumer string) Announcement {
	e.t.Helper()
	var a Announcement
	text, err := e.client.Get(context.Background(), e.keys.Worker(consumer)).Result()
	if err != nil || json.Unmarshal([]byte(text), &a) != nil {
		e.t.Fatalf("announcement of %s: %q %v", consumer, text, err)
	}
	return a
}

func TestWorkerAnnouncesWhatItServesAndWhenItStopped(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	w := e.worker(nil)
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error { return nil }, 1, 2)
	w.Handle("jobs.other", func(ctx context.Context, task *Task) error { return nil })
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- w.Run(runCtx) }()

	e.waitFor("the announcement", func() bool { return e.client.Exists(ctx, e.keys.Worker(w.Consumer())).Val() == 1 })
	a := e.announcement(w.Consumer())
	if a.Consumer != w.Consumer() || a.Language != Language || a.Host != w.host || a.PID == 0 ||
		len(a.Queues) != 1 || a.Queues[0] != e.queue || a.Concurrency != 1 || a.StoppedAt != "" ||
		len(a.Serves) != 2 || len(a.Serves["jobs.run"]) != 2 || a.Serves["jobs.other"][0] != 1 ||
		a.HeartbeatMS != (600*time.Millisecond/3).Milliseconds() {
		t.Fatalf("announcement %+v", a)
	}
	if _, err := ParseTimestamp(a.StartedAt); err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.ZScore(ctx, e.keys.Workers(), w.Consumer()).Result(); err != nil {
		t.Fatalf("the consumer is not in %s: %v", e.keys.Workers(), err)
	}
	if ttl := e.client.PTTL(ctx, e.keys.Worker(w.Consumer())).Val(); ttl < AnnounceKeep-time.Minute {
		t.Fatalf("announcement kept %v", ttl)
	}
	seen := a.SeenAt
	e.waitFor("a renewal to announce again", func() bool { return e.announcement(w.Consumer()).SeenAt != seen })

	stop()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	a = e.announcement(w.Consumer())
	if a.StoppedAt == "" || e.client.Exists(ctx, e.keys.Consumer(w.Consumer())).Val() != 0 {
		t.Fatalf("after a clean shutdown: %+v", a)
	}
}

// With Concurrency n each of the n consumers announces itself, as each has its liveness key.
func TestEveryConsumerOfAWorkerAnnouncesItself(t *testing.T) {
	e := newEnv(t)
	w := e.worker(func(c *Config) { c.Concurrency = 2 })
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error { return nil })
	e.start(w)
	for i := range 2 {
		consumer := fmt.Sprintf("%s-%d", w.Consumer(), i)
		e.waitFor("the announcement of "+consumer, func() bool {
			return e.client.Exists(context.Background(), e.keys.Worker(consumer)).Val() == 1
		})
		if a := e.announcement(consumer); a.Consumer != consumer || a.Concurrency != 1 {
			t.Fatalf("announcement %+v", a)
		}
	}
}

func TestRequireServedRefusesWhatNoWorkerOfTheQueueServes(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	p := NewProducer(e.client, e.prefix, e.scripts)
	p.RequireServed = true
	var notServed *NotServedError
	if _, err := p.PublishTask(ctx, e.queue, "jobs.run", nil); !errors.As(err, &notServed) ||
		!strings.Contains(err.Error(), "no worker of this queue was seen") {
		t.Fatalf("no worker at all: %v", err)
	}
	w := e.worker(nil)
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error { return nil }, 1, 2)
	if err := w.announceSelf(ctx, true); err != nil { // a recently seen worker, stopped since
		t.Fatal(err)
	}
	if _, err := p.PublishTask(ctx, e.queue, "jobs.run", nil, WithPayloadVersion(2)); err != nil {
		t.Fatalf("a served task was refused: %v", err)
	}
	_, err := p.PublishTask(ctx, e.queue, "jobs.run", nil, WithPayloadVersion(3))
	if !errors.As(err, &notServed) || !strings.Contains(err.Error(), `{"jobs.run":[1,2]}`) {
		t.Fatalf("an unserved version: %v", err)
	}
	_, err = p.PublishBatch(ctx, "elsewhere", []*Envelope{New("jobs.run", nil)})
	if !errors.As(err, &notServed) || notServed.Queue != "elsewhere" {
		t.Fatalf("a queue the worker does not consume: %v", err)
	}
	// Announcements older than a day leave the registry when a producer reads it.
	e.client.ZAdd(ctx, e.keys.Workers(), zOld("gone"))
	if _, err := p.Announcements(ctx); err != nil {
		t.Fatal(err)
	}
	if n := e.client.ZCard(ctx, e.keys.Workers()).Val(); n != 1 {
		t.Fatalf("%d members in %s, want 1", n, e.keys.Workers())
	}
}
