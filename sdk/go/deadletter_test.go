package envelope

import (
	"context"
	"errors"
	"sync"
	"testing"
)

func TestDeadLettersListShowAndReplayWithAnEdit(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	var mu sync.Mutex
	var ran []string
	w := e.worker(nil)
	w.Handle("jobs.pay", func(ctx context.Context, task *Task) error {
		var p struct{ Amount int }
		if err := task.DecodePayload(&p); err != nil || p.Amount <= 0 {
			return InvalidPayload(errors.New("amount must be positive"))
		}
		mu.Lock()
		defer mu.Unlock()
		ran = append(ran, task.TaskID)
		return nil
	}, 1, 2)
	bad := New("jobs.pay", []byte(`{"Amount":0}`))
	e.publish(bad)
	e.start(w)
	e.waitFor("the task to be dead-lettered", func() bool { return len(e.dead()) == 1 })

	dl := NewDeadLetters(e.client, e.prefix, e.scripts)
	if queues, err := dl.Queues(ctx); err != nil || len(queues) != 1 || queues[0] != e.queue {
		t.Fatalf("Queues: %v %v", queues, err)
	}
	list, err := dl.List(ctx, e.queue, "", 0)
	if err != nil || len(list) != 1 {
		t.Fatalf("List: %v %v", list, err)
	}
	entry := list[0]
	if entry.FailureClass() != ClassInvalidPayload || entry.Envelope == nil ||
		entry.Envelope.TaskID != bad.TaskID || entry.Fields["language"] != Language {
		t.Fatalf("entry: %+v", entry)
	}
	if more, _ := dl.List(ctx, e.queue, entry.ID, 10); len(more) != 0 {
		t.Fatalf("List after the last id: %v", more)
	}
	shown, err := dl.Show(ctx, e.queue, entry.ID)
	if err != nil || shown == nil || shown.Envelope.TaskID != bad.TaskID {
		t.Fatalf("Show: %+v %v", shown, err)
	}
	if missing, err := dl.Show(ctx, e.queue, "1-1"); missing != nil || err != nil {
		t.Fatalf("Show of a missing id: %+v %v", missing, err)
	}

	// An edit that breaks the Envelope publishes nothing.
	_, err = dl.Replay(ctx, e.queue, entry.ID, ReplayOptions{Edit: func(env *Envelope) error {
		env.Payload = []byte(`[1]`)
		return nil
	}})
	var invalid *ValidationError
	if !errors.As(err, &invalid) {
		t.Fatalf("Replay with a broken edit: %v, want a *ValidationError", err)
	}

	newID, err := dl.Replay(ctx, e.queue, entry.ID, ReplayOptions{Operator: "ops@test",
		Edit: func(env *Envelope) error {
			env.Payload = []byte(`{"Amount":5}`)
			env.PayloadVersion = 2
			return nil
		}})
	if err != nil || newID == "" {
		t.Fatalf("Replay: %q %v", newID, err)
	}
	e.waitFor("the replayed task to run", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(ran) == 1 && ran[0] == bad.TaskID
	})
	if len(e.dead()) != 0 {
		t.Fatalf("the dead-letter entry is still there: %v", e.dead())
	}
	records, _ := e.client.XRange(ctx, e.q.Replayed(), "-", "+").Result()
	if len(records) != 1 || records[0].Values["operator"] != "ops@test" ||
		records[0].Values["new_id"] != newID || records[0].Values["dead_id"] != entry.ID {
		t.Fatalf("replay records: %v", records)
	}
	if _, err := dl.Replay(ctx, e.queue, entry.ID, ReplayOptions{}); !errors.Is(err, ErrGone) {
		t.Fatalf("second Replay: %v, want ErrGone", err)
	}
}
