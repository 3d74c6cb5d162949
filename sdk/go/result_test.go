package envelope

import (
	"context"
	"errors"
	"fmt"
	"math"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// backend is the result backend of the tests: another database of the test
// Redis, as Celery's result backend often is.
func (e *env) backend() *redis.Client {
	opts, err := redis.ParseURL(testRedisURL)
	if err != nil {
		e.t.Fatal(err)
	}
	opts.DB = (opts.DB + 1) % 16
	opts.Protocol = 2
	c := redis.NewClient(opts)
	e.t.Cleanup(func() {
		ctx := context.Background()
		if keys, _ := c.Keys(ctx, e.resultKey("*")).Result(); len(keys) > 0 {
			c.Del(ctx, keys...)
		}
		c.Close()
	})
	return c
}

// resultKey is the key Celery's result backend reads for taskID (in this test's namespace).
func (e *env) resultKey(taskID string) string { return "celery-task-meta-" + e.prefix + "-" + taskID }

// askResult makes env ask for its result, as a Celery producer does (expiresS "" leaves expires_s out).
func (e *env) askResult(env *Envelope, expiresS string) *Envelope {
	request := `{"key":"` + e.resultKey(env.TaskID) + `"`
	if expiresS != "" {
		request += `,"expires_s":` + expiresS
	}
	env.Ext = append(env.Ext, ExtEntry{"celery", []byte(`{"result":` + request + `}}`)})
	return env
}

var dateDoneRe = regexp.MustCompile(`"date_done":"([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{6}\+00:00)"`)

// wantMeta checks the exact stored JSON, date_done being any time of the run written as Celery does.
func wantMeta(t *testing.T, got, status, result, traceback, taskID string) {
	t.Helper()
	m := dateDoneRe.FindStringSubmatch(got)
	if m == nil {
		t.Fatalf("no date_done written YYYY-MM-DDThh:mm:ss.ffffff+00:00 in %s", got)
	}
	if done, err := time.Parse("2006-01-02T15:04:05.000000-07:00", m[1]); err != nil ||
		time.Since(done) > time.Minute || time.Until(done) > 0 {
		t.Fatalf("date_done %s is not the time of writing (%v)", m[1], err)
	}
	want := `{"status":"` + status + `","result":` + result + `,"traceback":` + traceback +
		`,"children":[],"date_done":"` + m[1] + `","task_id":"` + taskID + `"}`
	if got != want {
		t.Fatalf("stored result\n%s\nwant\n%s", got, want)
	}
}

type valueError struct{ msg string }

func (e *valueError) Error() string         { return e.msg }
func (e *valueError) ExceptionType() string { return "ValueError" }

func TestResultsOfEveryOutcomeAreWrittenAndPublished(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	backend := e.backend()
	w := e.worker(func(c *Config) { c.ResultBackend = backend; c.Prefetch = 10 })
	w.HandleResult("jobs.sum", func(ctx context.Context, task *Task) (any, error) {
		return map[string]any{"total": 42, "note": "<a&b>"}, nil
	})
	w.Handle("jobs.plain", func(ctx context.Context, task *Task) error { return nil })
	w.Handle("jobs.fail", func(ctx context.Context, task *Task) error { return &valueError{"bad order 7"} })
	w.Handle("jobs.panic", func(ctx context.Context, task *Task) error { panic("out of range") })
	w.Handle("jobs.dup", func(ctx context.Context, task *Task) error { t.Error("a duplicate ran"); return nil })

	sub := backend.PSubscribe(ctx, e.resultKey("*"))
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil { // the subscription is in place
		t.Fatal(err)
	}
	p := NewProducer(e.client, e.prefix, e.scripts)
	sum := e.askResult(New("jobs.sum", nil), "86400")
	plain := e.askResult(New("jobs.plain", nil), "") // no expiry
	fail := e.askResult(New("jobs.fail", nil), "null")
	panics := e.askResult(New("jobs.panic", nil), "60")
	unknown := e.askResult(New("nobody.handles", nil), "60")
	dup := e.askResult(New("jobs.dup", nil), "60")
	key := "k1"
	dup.IdempotencyKey = &key
	e.client.Set(ctx, e.keys.Idempotency("jobs.dup", key), "done earlier 2025-09-11T04:40:00Z", time.Minute)
	cancelled := e.askResult(New("jobs.plain", nil), "60")
	if _, err := p.Cancel(ctx, cancelled.TaskID); err != nil {
		t.Fatal(err)
	}
	expired := e.askResult(New("jobs.plain", nil), "60")
	past := NewTimestamp(time.Now().Add(-time.Second))
	expired.Expires = &past
	all := []*Envelope{sum, plain, fail, panics, unknown, dup, cancelled, expired}
	for _, task := range all {
		e.publish(task)
	}
	e.start(w)
	published := map[string]string{}
	for range all {
		msg, err := sub.ReceiveMessage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		published[msg.Channel] = msg.Payload
	}
	e.waitFor("the queue to drain", e.drained)
	stored := map[string]string{}
	for _, task := range all {
		k := e.resultKey(task.TaskID)
		got, err := backend.Get(ctx, k).Result()
		if err != nil {
			t.Fatalf("no result for %s: %v", task.TaskType, err)
		}
		if published[k] != got {
			t.Fatalf("published %q, stored %q", published[k], got)
		}
		stored[task.TaskID] = got
	}
	wantMeta(t, stored[sum.TaskID], "SUCCESS", `{"note":"<a&b>","total":42}`, "null", sum.TaskID)
	wantMeta(t, stored[plain.TaskID], "SUCCESS", "null", "null", plain.TaskID)
	wantMeta(t, stored[dup.TaskID], "SUCCESS", "null", "null", dup.TaskID)
	wantMeta(t, stored[fail.TaskID], "FAILURE",
		`{"exc_type":"ValueError","exc_message":["bad order 7"],"exc_module":null}`, "null", fail.TaskID)
	wantMeta(t, stored[unknown.TaskID], "FAILURE", `{"exc_type":"unknown_task_type","exc_message":`+
		`["no handler for task_type \"nobody.handles\" in this worker"],"exc_module":null}`, "null", unknown.TaskID)
	revoked := `{"exc_type":"TaskRevokedError","exc_message":["%s"],"exc_module":"celery.exceptions"}`
	wantMeta(t, stored[cancelled.TaskID], "REVOKED", fmt.Sprintf(revoked, "revoked"), "null", cancelled.TaskID)
	wantMeta(t, stored[expired.TaskID], "REVOKED", fmt.Sprintf(revoked, "expired"), "null", expired.TaskID)

	// A panic's FAILURE carries the stack; its exc_type is the dead-letter entry's exception_type.
	var dead map[string]any
	for _, d := range e.dead() {
		if d["task_id"] == panics.TaskID {
			dead = d
		}
	}
	tb, _ := dead["traceback"].(string)
	wantTB := string(compactJSON(tb))
	if !strings.Contains(tb, "goroutine") {
		t.Fatalf("dead-letter traceback %q", tb)
	}
	wantMeta(t, stored[panics.TaskID], "FAILURE", fmt.Sprintf(
		`{"exc_type":"%s","exc_message":["panic: out of range"],"exc_module":null}`, dead["exception_type"]),
		wantTB, panics.TaskID)

	for id, want := range map[string]time.Duration{sum.TaskID: 86400 * time.Second, plain.TaskID: -1,
		fail.TaskID: -1, cancelled.TaskID: time.Minute} {
		ttl, err := backend.TTL(ctx, e.resultKey(id)).Result()
		if err != nil || (want < 0 && ttl != want) || (want > 0 && (ttl > want || ttl < want-5*time.Second)) {
			t.Fatalf("TTL %v %v, want %v", ttl, err, want)
		}
	}
}

func TestAResultThatIsNotJSONFailsTheTask(t *testing.T) {
	e := newEnv(t)
	backend := e.backend()
	w := e.worker(func(c *Config) { c.ResultBackend = backend })
	w.HandleResult("jobs.sum", func(ctx context.Context, task *Task) (any, error) { return math.Inf(1), nil })
	task := e.askResult(New("jobs.sum", nil), "60")
	e.publish(task)
	e.start(w)
	e.waitFor("a dead-letter entry", func() bool { return len(e.dead()) == 1 })
	if d := e.dead()[0]; d["failure_class"] != ClassTaskError || d["exception_type"] != "EncodeError" {
		t.Fatalf("dead-letter entry %v", d)
	}
	got, _ := backend.Get(context.Background(), e.resultKey(task.TaskID)).Result()
	wantMeta(t, got, "FAILURE", `{"exc_type":"EncodeError","exc_message":`+
		`["the result is not JSON: json: unsupported value: +Inf"],"exc_module":null}`, "null", task.TaskID)
}

func TestAResultAskedForWithoutABackendIsLoggedOncePerTaskType(t *testing.T) {
	e := newEnv(t)
	var runs atomic.Int32
	w := e.worker(func(c *Config) { c.Concurrency = 2 })
	w.HandleResult("jobs.sum", func(ctx context.Context, task *Task) (any, error) { runs.Add(1); return 1, nil })
	w.Handle("jobs.plain", func(ctx context.Context, task *Task) error { runs.Add(1); return nil })
	for _, taskType := range []string{"jobs.sum", "jobs.sum", "jobs.sum", "jobs.plain", "jobs.plain"} {
		e.publish(e.askResult(New(taskType, nil), "60"))
	}
	e.publish(New("jobs.plain", nil)) // asks for no result
	e.start(w)
	e.waitFor("six runs", func() bool { return runs.Load() == 6 })
	e.waitFor("the queue to drain", e.drained)
	logs := e.logs.String()
	if n := strings.Count(logs, "result asked for and not written"); n != 2 {
		t.Fatalf("logged %d times, want once per task type:\n%s", n, logs)
	}
	if strings.Count(logs, `"outcome":"success"`) != 6 {
		t.Fatal("a task without a result backend did not succeed")
	}
}

func TestAMalformedResultRequestIsLoggedAndTheTaskStillRuns(t *testing.T) {
	e := newEnv(t)
	var runs atomic.Int32
	w := e.worker(func(c *Config) { c.ResultBackend = e.backend() })
	w.Handle("jobs.plain", func(ctx context.Context, task *Task) error { runs.Add(1); return nil })
	task := New("jobs.plain", nil)
	task.Ext = []ExtEntry{{"celery", []byte(`{"result":{"key":7}}`)}}
	e.publish(task)
	e.start(w)
	e.waitFor("the queue to drain", e.drained)
	if runs.Load() != 1 || !strings.Contains(e.logs.String(), `ext.celery.result must be {\"key\"`) {
		t.Fatalf("runs %d; logs:\n%s", runs.Load(), e.logs.String())
	}
}

func TestAResultIsRetriedWhileTheBackendIsAwayAndWrittenBeforeTheAck(t *testing.T) {
	e := newEnv(t)
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	url := fmt.Sprintf("redis://127.0.0.1:%d/0", port)
	backend, err := NewClient(url)
	if err != nil {
		t.Fatal(err)
	}
	defer backend.Close()
	w := e.worker(func(c *Config) { c.ResultBackend = backend })
	w.HandleResult("jobs.sum", func(ctx context.Context, task *Task) (any, error) { return "done", nil })
	task := e.askResult(New("jobs.sum", nil), "60")
	e.publish(task)
	e.start(w)
	e.waitFor("a failed result write", func() bool { return strings.Contains(e.logs.String(), `"step":"result write"`) })
	ctx := context.Background()
	if p, _ := e.client.XPending(ctx, e.q.Stream(Normal), DefaultGroup).Result(); p == nil || p.Count != 1 {
		t.Fatal("acknowledged before its result was written")
	}
	_, stop, err := startRedisAt(port)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	e.waitFor("the queue to drain", e.drained)
	got, err := backend.Get(ctx, e.resultKey(task.TaskID)).Result()
	if err != nil {
		t.Fatal(err)
	}
	wantMeta(t, got, "SUCCESS", `"done"`, "null", task.TaskID)
	if !strings.Contains(e.logs.String(), `"outcome":"success"`) || len(e.dead()) != 0 {
		t.Fatal("a result written late turned the task into a failure")
	}
}

func TestADeadConsumersTaskPastTheRedeliveryLimitGetsItsFailure(t *testing.T) {
	e := newEnv(t)
	backend := e.backend()
	w := e.worker(func(c *Config) { c.MaxRedeliveries = 1; c.ResultBackend = backend })
	w.Handle("jobs.run", func(ctx context.Context, task *Task) error { t.Error("ran"); return nil })
	task := e.askResult(New("jobs.run", nil), "60")
	e.client.XAdd(context.Background(), &redis.XAddArgs{Stream: e.q.Stream(Normal),
		Values: []string{"v", "1", "enc", "json", "body", string(task.JSON()), "n", "1"}})
	e.hold(w, "ghost")
	e.start(w)
	e.waitFor("a dead-letter entry", func() bool { return len(e.dead()) == 1 })
	reason := fmt.Sprint(e.dead()[0]["reason"])
	var got string
	e.waitFor("its result", func() bool {
		var err error
		got, err = backend.Get(context.Background(), e.resultKey(task.TaskID)).Result()
		return !errors.Is(err, redis.Nil)
	})
	wantMeta(t, got, "FAILURE", `{"exc_type":"redelivery_limit","exc_message":`+string(compactJSON([]string{reason}))+
		`,"exc_module":null}`, "null", task.TaskID)
}
