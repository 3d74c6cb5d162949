package envelope

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Result states written for Celery callers (docs/protocol.md section 12).
const (
	ResultSuccess = "SUCCESS"
	ResultFailure = "FAILURE"
	ResultRevoked = "REVOKED"
)

// Why a task was revoked: the exc_message of its REVOKED result.
const (
	revokedCancelled = "revoked"
	revokedExpired   = "expired"
)

// ResultHandlerFunc runs one attempt of a task and returns its result, which
// is written as JSON (encoding/json) for a Celery caller that asked for one
// (ext.celery.result). Errors are handled as HandlerFunc's.
type ResultHandlerFunc func(ctx context.Context, t *Task) (any, error)

// ResultEncodeError is a result a handler returned that is not JSON: the
// attempt fails as a task error (exception type EncodeError, as in Celery).
type ResultEncodeError struct{ Err error }

func (e *ResultEncodeError) Error() string         { return "the result is not JSON: " + e.Err.Error() }
func (e *ResultEncodeError) Unwrap() error         { return e.Err }
func (e *ResultEncodeError) ExceptionType() string { return "EncodeError" }

// resultRequest is ext.celery.result: where a Celery caller waits for the result.
type resultRequest struct {
	key     string
	expires time.Duration // 0: no expiry
}

// resultRequestOf reads ext.celery.result; nil when the Envelope asks for no result.
func resultRequestOf(e *Envelope) (*resultRequest, error) {
	for _, x := range e.Ext {
		if x.Namespace != "celery" {
			continue
		}
		var celery struct {
			Result json.RawMessage `json:"result"`
		}
		if err := json.Unmarshal(x.Value, &celery); err != nil || celery.Result == nil ||
			string(celery.Result) == "null" {
			return nil, nil
		}
		var r struct {
			Key      *string  `json:"key"`
			ExpiresS *float64 `json:"expires_s"`
		}
		if err := json.Unmarshal(celery.Result, &r); err != nil || r.Key == nil || *r.Key == "" ||
			(r.ExpiresS != nil && *r.ExpiresS < 0) {
			return nil, fmt.Errorf(`ext.celery.result must be {"key": <non-empty string>, "expires_s": <seconds ≥ 0 or null>}, not %s`,
				celery.Result)
		}
		req := &resultRequest{key: *r.Key}
		if r.ExpiresS != nil { // Celery's result_expires 0 means no expiry too
			req.expires = time.Duration(math.Ceil(*r.ExpiresS)) * time.Second
		}
		return req, nil
	}
	return nil, nil
}

// asksForResult reports whether e carries ext.celery.result (well formed or not).
func asksForResult(e *Envelope) bool {
	req, err := resultRequestOf(e)
	return req != nil || err != nil
}

// outcome is a final state of a task, as its result says it.
type outcome struct {
	status    string
	result    json.RawMessage // the JSON of the meta's "result"
	traceback string          // "": null
}

func succeeded(result json.RawMessage) outcome { return outcome{status: ResultSuccess, result: result} }

func revoked(why string) outcome {
	module := "celery.exceptions"
	return outcome{status: ResultRevoked, result: compactJSON(excInfo{"TaskRevokedError", []string{why}, &module})}
}

// failed is the FAILURE of a dead-lettered task: the exception type of the
// dead-letter entry, else its failure class; the error message, else the reason.
func failed(f failure) outcome {
	excType, message := f.exceptionType, f.message
	if excType == "" {
		excType = f.class
	}
	if message == "" {
		message = f.reason
	}
	return outcome{status: ResultFailure, result: compactJSON(excInfo{excType, []string{message}, nil}),
		traceback: f.traceback}
}

// excInfo is the error object of a FAILURE or REVOKED result.
type excInfo struct {
	Type    string   `json:"exc_type"`
	Message []string `json:"exc_message"`
	Module  *string  `json:"exc_module"`
}

// encodeResult is a handler's value as compact JSON.
func encodeResult(value any) (json.RawMessage, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(value); err != nil {
		return nil, &ResultEncodeError{err}
	}
	return bytes.TrimSuffix(b.Bytes(), []byte("\n")), nil
}

// compactJSON encodes values built here, which always encode.
func compactJSON(value any) json.RawMessage {
	b, err := encodeResult(value)
	if err != nil {
		panic(err)
	}
	return b
}

// resultMeta is the compact JSON Celery's result backend stores for a task.
func resultMeta(taskID string, o outcome, now time.Time) []byte {
	var traceback *string
	if o.traceback != "" {
		traceback = &o.traceback
	}
	return compactJSON(struct {
		Status    string          `json:"status"`
		Result    json.RawMessage `json:"result"`
		Traceback *string         `json:"traceback"`
		Children  []any           `json:"children"`
		DateDone  string          `json:"date_done"`
		TaskID    string          `json:"task_id"`
	}{o.status, o.result, traceback, []any{}, now.UTC().Format("2006-01-02T15:04:05.000000+00:00"), taskID})
}

// results writes the results Celery callers ask for; a Worker's consumers share one.
type results struct {
	backend   redis.UniversalClient // nil: none configured
	unwritten sync.Map              // task types whose unwritten results were logged
}

// write stores o as the result of env when env asks for one: SET (with EX
// when it expires) and PUBLISH in one MULTI on the result backend, retried
// while it is away. A result that cannot be written is logged; it never
// changes what happens to the task.
func (r *results) write(ctx context.Context, log *slog.Logger, env *Envelope, o outcome) {
	req, err := resultRequestOf(env)
	if err != nil {
		log.Warn("result asked for and not written", "status", o.status, "error", err.Error())
		return
	}
	if req == nil {
		return
	}
	if r.backend == nil {
		if _, seen := r.unwritten.LoadOrStore(env.TaskType, true); !seen {
			log.Warn("result asked for and not written: the worker has no result backend "+
				"(Config.ResultBackend); logged once per task type", "status", o.status)
		}
		return
	}
	meta := resultMeta(env.TaskID, o, time.Now())
	err = retryOutage(log, "result write", func() error {
		_, err := r.backend.TxPipelined(ctx, func(p redis.Pipeliner) error {
			p.Set(ctx, req.key, meta, req.expires)
			p.Publish(ctx, req.key, meta)
			return nil
		})
		return err
	})
	if err != nil {
		log.Error("result not written", "status", o.status, "result_key", req.key, "error", err.Error())
		return
	}
	log.Debug("result written", "status", o.status, "result_key", req.key,
		"expires_s", int64(req.expires/time.Second))
}
