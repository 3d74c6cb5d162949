package envelope

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"strconv"
	"syscall"
	"time"
)

// HeaderFastRetries counts the fast-tier retries already taken (docs/protocol.md section 8).
const HeaderFastRetries = "x-fast-retries"

// HeaderFirstFailureAt keeps the time of a task's first failed attempt across
// retries, so its dead-letter entry can report first_failure_at.
const HeaderFirstFailureAt = "x-first-failure-at"

// HeaderRetryPolicy asks for automatic retries (docs/protocol.md section 8);
// PolicyTiered is the one policy defined. Without it a failure is final.
const (
	HeaderRetryPolicy = "x-retry-policy"
	PolicyTiered      = "tiered"
)

// AsksForTiered reports whether e asks for automatic retries under the tiered policy.
func AsksForTiered(e *Envelope) bool { return e.Headers[HeaderRetryPolicy] == PolicyTiered }

// Failure classes of dead-letter entries (docs/protocol.md section 7).
const (
	ClassTransientExhausted        = "transient_exhausted"
	ClassTaskError                 = "task_error"
	ClassInvalidPayload            = "invalid_payload"
	ClassTimeout                   = "timeout"
	ClassUnsupportedPayloadVersion = "unsupported_payload_version"
	ClassUnknownTaskType           = "unknown_task_type"
	ClassMalformedEntry            = "malformed_entry"
	ClassRejected                  = "rejected"
	ClassRedeliveryLimit           = "redelivery_limit"
)

// ErrTransient marks an error as transient: errors.Is(err, ErrTransient).
var ErrTransient = errors.New("transient error")

// Transient wraps err so that the default classifier treats it as transient
// (fast-tier retries first, then backoff; transient_exhausted at the end).
func Transient(err error) error { return &transientError{err} }

type transientError struct{ err error }

func (e *transientError) Error() string        { return e.err.Error() }
func (e *transientError) Unwrap() error        { return e.err }
func (e *transientError) Is(target error) bool { return target == ErrTransient }

// Permanent errors dead-letter a task at once, whatever retries are left.
type Permanent struct {
	Class string // ClassInvalidPayload or ClassRejected
	Err   error
}

func (e *Permanent) Error() string { return e.Err.Error() }
func (e *Permanent) Unwrap() error { return e.Err }

// InvalidPayload dead-letters the task as invalid_payload without retrying.
func InvalidPayload(err error) error { return &Permanent{ClassInvalidPayload, err} }

// Reject dead-letters the task as rejected without retrying.
func Reject(err error) error { return &Permanent{ClassRejected, err} }

// DefaultIsTransient is the default classification: errors marked with
// Transient or ErrTransient, errors whose Transient() method answers true,
// network errors, refused or reset connections.
func DefaultIsTransient(err error) bool {
	var marked interface{ Transient() bool }
	var netErr net.Error
	switch {
	case errors.Is(err, ErrTransient):
		return true
	case errors.As(err, &marked):
		return marked.Transient()
	case errors.As(err, &netErr):
		return true
	case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.EPIPE):
		return true
	}
	return false
}

// ErrorKind is how a failed attempt is classified.
type ErrorKind int

// Kinds of failure.
const (
	KindTaskError ErrorKind = iota
	KindTransient
	KindTimeout
)

// RetryPolicy holds the retry settings of docs/protocol.md section 8.
type RetryPolicy struct {
	FastRetries int           // transient failures retried at once (default 2)
	Backoff     time.Duration // first backoff delay (default 30 s)
	MaxBackoff  time.Duration // longest backoff delay (default 1 h)
	// Jitter returns the random factor applied to a backoff delay; nil: uniform in [0.8, 1.2].
	Jitter func() float64
}

// DefaultRetryPolicy is the protocol's default.
var DefaultRetryPolicy = RetryPolicy{FastRetries: 2, Backoff: 30 * time.Second, MaxBackoff: time.Hour}

// BackoffDelay is min(backoff × 2^(next − fast − 1) × jitter, max_backoff) for
// attempt number next (the retry_count it will carry) after fast fast-tier
// retries: the jitter factor is applied before the cap, so a capped delay is
// exactly max_backoff.
func (p RetryPolicy) BackoffDelay(next int64, fast int) time.Duration {
	exp := next - int64(fast) - 1
	if exp < 0 {
		exp = 0
	}
	factor := 0.8 + 0.4*rand.Float64()
	if p.Jitter != nil {
		factor = p.Jitter()
	}
	delay := float64(p.MaxBackoff)
	if exp < 62 {
		delay = math.Min(float64(p.Backoff)*math.Exp2(float64(exp))*factor, float64(p.MaxBackoff))
	}
	return time.Duration(delay)
}

// Action is what happens to a failed attempt.
type Action int

// Actions.
const (
	DeadLetter Action = iota
	RetryNow          // fast tier: straight back to the stream
	RetryLater        // backoff tier: through the delayed set
)

// Decision is the outcome of RetryPolicy.Decide.
type Decision struct {
	Action       Action
	Class        string        // failure class when Action is DeadLetter
	Next         int64         // retry_count of the next attempt
	FastRetries  int           // x-fast-retries of the next attempt
	Delay        time.Duration // for RetryLater
	ExhaustedMsg string
}

// FastRetriesTaken reads the x-fast-retries header (absent or unreadable: 0).
func FastRetriesTaken(e *Envelope) int {
	n, err := strconv.Atoi(e.Headers[HeaderFastRetries])
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// Decide applies the retry rules to a failed attempt of e. A task whose
// Envelope does not ask for the tiered policy is not retried: dead-lettered as
// timeout or task_error.
func (p RetryPolicy) Decide(e *Envelope, kind ErrorKind) Decision {
	next := e.RetryCount + 1
	fast := FastRetriesTaken(e)
	if !AsksForTiered(e) {
		class := ClassTaskError
		if kind == KindTimeout {
			class = ClassTimeout
		}
		return Decision{Action: DeadLetter, Class: class, Next: next, FastRetries: fast,
			ExhaustedMsg: fmt.Sprintf("failed; not retried (no %s: %s header)", HeaderRetryPolicy, PolicyTiered)}
	}
	if e.MaxRetries != nil && next > *e.MaxRetries {
		class := ClassTaskError
		switch kind {
		case KindTransient:
			class = ClassTransientExhausted
		case KindTimeout:
			class = ClassTimeout
		}
		return Decision{Action: DeadLetter, Class: class, Next: next, FastRetries: fast,
			ExhaustedMsg: fmt.Sprintf("gave up after %d attempts (max_retries %d)", next, *e.MaxRetries)}
	}
	// Only transient errors take the fast tier: a timeout is retried with backoff.
	if kind == KindTransient && fast < p.FastRetries {
		return Decision{Action: RetryNow, Next: next, FastRetries: fast + 1}
	}
	return Decision{Action: RetryLater, Next: next, FastRetries: fast, Delay: p.BackoffDelay(next, fast)}
}

// NextAttempt is the Envelope of the next attempt: same task_id, retry_count
// and x-fast-retries from d, schedule_time now + delay (left out when the
// delay is 0: the attempt is due at once).
func NextAttempt(e *Envelope, d Decision, now time.Time) *Envelope {
	n := e.Clone()
	n.RetryCount = d.Next
	if d.FastRetries > 0 {
		n.Headers[HeaderFastRetries] = strconv.Itoa(d.FastRetries)
	}
	n.ScheduleTime = scheduleAfter(now, d.Delay)
	return n
}

// scheduleAfter is now + delay as a schedule_time, or nil for a delay <= 0.
func scheduleAfter(now time.Time, delay time.Duration) *Timestamp {
	if delay <= 0 {
		return nil
	}
	at := NewTimestamp(now.Add(delay).UTC())
	return &at
}

// isTimeout reports whether an attempt ended because its deadline passed.
func isTimeout(ctx context.Context, err error) bool {
	return errors.Is(ctx.Err(), context.DeadlineExceeded) ||
		(err != nil && errors.Is(err, context.DeadlineExceeded))
}
