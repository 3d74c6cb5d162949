package envelope

// Payload schemas (docs/protocol.md section 16) against a real Redis: refused
// at publish, dead-lettered at the worker. The vectors of conformance/schemas
// run in conformance_test.go.

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const orderSchema = `{"type": "object", "required": ["order_id"], "additionalProperties": false,
	"properties": {"order_id": {"type": "integer"}}}`

func zOld(member string) redis.Z {
	return redis.Z{Score: float64(time.Now().Add(-25 * time.Hour).UnixMilli()), Member: member}
}

func TestProducerRefusesAPayloadThatBreaksItsSchema(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.client.HSet(ctx, e.keys.Schemas(), "jobs.order@1", orderSchema, "jobs.broken@1", `{"type": 7}`)
	p := NewProducer(e.client, e.prefix, e.scripts)
	_, err := p.PublishTask(ctx, e.queue, "jobs.order", map[string]any{"colour": "red"})
	var invalid *ValidationError
	if !errors.As(err, &invalid) || len(invalid.Violations) != 2 ||
		invalid.Violations[0].Field != "payload.colour" || invalid.Violations[1].Field != "payload.order_id" ||
		invalid.Violations[0].Rule != RuleSchema || invalid.Violations[0].Message == "" {
		t.Fatalf("publish: %v", err)
	}
	good, bad := New("jobs.order", []byte(`{"order_id": 7}`)), New("jobs.order", []byte(`{"order_id": "7"}`))
	_, err = p.PublishBatch(ctx, e.queue, []*Envelope{good, bad})
	var batch *BatchError
	if !errors.As(err, &batch) || len(batch.Failed) != 1 || batch.Failed[1] == nil ||
		!strings.Contains(batch.Failed[1].Error(), "payload.order_id") {
		t.Fatalf("batch: %v", err)
	}
	// Another version has no schema; a schema that cannot be compiled is ignored.
	if _, err := p.PublishTask(ctx, e.queue, "jobs.order", nil, WithPayloadVersion(2)); err != nil {
		t.Fatal(err)
	}
	if _, err := p.PublishTask(ctx, e.queue, "jobs.broken", nil); err != nil {
		t.Fatalf("a schema that cannot be compiled refused a task: %v", err)
	}
	// A schema registered later is enforced once the cache time passed.
	p2 := NewProducer(e.client, e.prefix, e.scripts)
	p2.SchemaCache = 100 * time.Millisecond
	if _, err := p2.PublishTask(ctx, e.queue, "jobs.late", nil); err != nil {
		t.Fatal(err)
	}
	e.client.HSet(ctx, e.keys.Schemas(), "jobs.late@1", orderSchema)
	time.Sleep(150 * time.Millisecond)
	if _, err := p2.PublishTask(ctx, e.queue, "jobs.late", nil); !errors.As(err, &invalid) {
		t.Fatalf("after the cache time: %v", err)
	}
}

func TestWorkerDeadLettersAPayloadThatBreaksItsSchema(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	bad := New("jobs.order", []byte(`{"order_id": "x", "note": "`+strings.Repeat("n", 1200)+`"}`))
	e.publish(bad) // published before its schema was registered
	e.client.HSet(ctx, e.keys.Schemas(), "jobs.order@1", orderSchema)
	w := e.worker(nil)
	w.Handle("jobs.order", func(ctx context.Context, task *Task) error { t.Error("ran"); return nil })
	e.start(w)
	e.waitFor("the dead letter", func() bool { return len(e.dead()) == 1 })
	d := e.dead()[0]
	reason, _ := d["reason"].(string)
	if d["failure_class"] != ClassInvalidPayload || d["attempts"] != "1" ||
		!strings.HasPrefix(reason, "schema: payload.note: ") || !strings.Contains(reason, "; payload.order_id: ") ||
		len([]rune(reason)) > 1000 {
		t.Fatalf("dead-letter entry %v", d)
	}
	if r := e.waitState(bad.TaskID, StateDead); !strings.HasPrefix(r["error"], "invalid_payload: schema: ") {
		t.Fatalf("record %v", r)
	}
	// A refused payload is a failed attempt that ran nothing (section 17).
	e.waitFor("the statistics", func() bool { return e.client.Exists(ctx, e.q.Stats()).Val() == 1 })
	if got := e.client.HGetAll(ctx, e.q.Stats()).Val(); len(got) != 2 ||
		got[StatsField("jobs.order", StatFailed)] != "1" || got[StatsField("jobs.order", StatDead)] != "1" {
		t.Fatalf("statistics %v", got)
	}
}

func TestWorkerRunsUncheckedWhenTheSchemasCannotBeRead(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	e.publish(New("jobs.order", nil))
	e.client.Set(ctx, e.keys.Schemas(), "not a hash", 0) // HGETALL fails (WRONGTYPE)
	ran := make(chan struct{}, 1)
	w := e.worker(nil)
	w.Handle("jobs.order", func(ctx context.Context, task *Task) error { ran <- struct{}{}; return nil })
	e.start(w)
	select {
	case <-ran:
	case <-time.After(5 * time.Second):
		t.Fatal("the task did not run")
	}
	if !strings.Contains(e.logs.String(), "payload schema check failed; running the task unchecked") {
		t.Fatal("the failed schema read was not logged")
	}
}

// A stored schema is compiled only when it is an object that refers to itself alone:
// nothing is fetched, and anything else is an error (so the schema is ignored).
func TestCompileSchemaRefusesWhatCannotBeUsed(t *testing.T) {
	for _, text := range []string{`true`, `{"type": 7}`, `{"$ref": "https://example.com/s.json"}`,
		`{"$ref": "#/$defs/missing"}`, `{"pattern": "^(?=x)"}`, `{not json`} {
		if _, err := CompileSchema([]byte(text)); err == nil {
			t.Errorf("%s compiled", text)
		}
	}
	if _, err := CompileSchema([]byte(`{"$defs": {"id": {"type": "integer"}}, "$ref": "#/$defs/id"}`)); err != nil {
		t.Fatal(err)
	}
}
