package envelope

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// ParkedConsumer is the reserved consumer that holds the entries waiting for
// their task type's limits (docs/protocol.md section 19): no consumer may use
// the name, and nobody takes its entries over.
const ParkedConsumer = "parked"

// TaskLimit is what one task type may do on one queue, all workers of every
// language together (docs/protocol.md section 19). A zero member is not set;
// at least one of Concurrency, Rate and Breaker is.
type TaskLimit struct {
	Concurrency int64   // attempts running at once (≥ 1)
	Rate        float64 // starts per second (> 0)
	Burst       int64   // starts allowed back to back above Rate after an idle spell (≥ 1; default 1)
	Smooth      bool    // every start spaced evenly (Burst 1 whatever is set)
	Breaker     Breaker // no starts for a while after too many failures
}

// Breaker is the circuit breaker of a task type, enforced by read.lua from the
// worker statistics (docs/protocol.md sections 17 and 19). A zero member other
// than FailureRatio takes its default; the zero Breaker is no breaker.
type Breaker struct {
	FailureRatio float64       // share of failed attempts in the window that opens it (0 < r ≤ 1; required)
	MinAttempts  int64         // attempts ended in the window before it may open (≥ 1; default 20)
	Window       time.Duration // how far back attempts are counted (> 0; default 60 s)
	Cooldown     time.Duration // how long it stays open before probing (> 0; default 30 s)
	Probes       int64         // attempts let through half-open, all of which must succeed (≥ 1; default 1)
}

// InvalidLimitError is a limit that breaks the rules of
// kombu_envelope/schemas/limits.schema.json. Field names the member ("" for
// the document as a whole, "breaker.<member>" inside the breaker), Rule the
// broken rule, in the vocabulary of the conformance vectors (type, minimum,
// maximum, required, unknown_field, json).
type InvalidLimitError struct{ Violation }

func (e *InvalidLimitError) Error() string {
	field := e.Field
	if field == "" {
		field = "the limit"
	}
	return fmt.Sprintf("invalid task limit: %s: %s [%s]", field, e.Message, e.Rule)
}

func invalidLimit(field, rule, format string, args ...any) error {
	return &InvalidLimitError{Violation{Field: field, Rule: rule, Message: fmt.Sprintf(format, args...)}}
}

// limitMembers and breakerMembers are the members of a limit and of its
// breaker, in the order they are checked and written.
var (
	limitMembers   = []string{"concurrency", "rate", "burst", "smooth", "breaker"}
	breakerMembers = []string{"failure_ratio", "min_attempts", "window_s", "cooldown_s", "probes"}
)

// ParseTaskLimit reads a limit's JSON text, checked against the limits schema:
// an *InvalidLimitError names the first violation (unknown members first, then
// each member in schema order, the breaker's own members likewise, then the
// rule that concurrency, rate or breaker is set).
func ParseTaskLimit(data []byte) (TaskLimit, error) {
	var l TaskLimit
	root, err := ParseJSON(data)
	if err != nil {
		return l, invalidLimit("", "json", "not JSON: %v", err)
	}
	if root.Kind != Object {
		return l, invalidLimit("", "type", "must be a JSON object, not %s", root.Kind)
	}
	if err := checkMembers(root, "", limitMembers); err != nil {
		return l, err
	}
	if v := root.Get("concurrency"); v != nil {
		if l.Concurrency, err = limitInteger(v, "concurrency"); err != nil {
			return l, err
		}
	}
	if v := root.Get("rate"); v != nil {
		if l.Rate, err = limitPositive(v, "rate"); err != nil {
			return l, err
		}
	}
	if v := root.Get("burst"); v != nil {
		if l.Burst, err = limitInteger(v, "burst"); err != nil {
			return l, err
		}
	}
	if v := root.Get("smooth"); v != nil {
		if v.Kind != Bool {
			return l, invalidLimit("smooth", "type", "must be a boolean, not %s", v.Kind)
		}
		l.Smooth = v.Bool
	}
	if v := root.Get("breaker"); v != nil {
		if l.Breaker, err = parseBreaker(v); err != nil {
			return l, err
		}
	}
	return l, l.Validate()
}

// parseBreaker reads the breaker member of a limit.
func parseBreaker(v *Value) (Breaker, error) {
	var b Breaker
	if v.Kind != Object {
		return b, invalidLimit("breaker", "type", "must be a JSON object, not %s", v.Kind)
	}
	if err := checkMembers(v, "breaker.", breakerMembers); err != nil {
		return b, err
	}
	var err error
	ratio := v.Get("failure_ratio")
	if ratio != nil {
		if b.FailureRatio, err = limitPositive(ratio, "breaker.failure_ratio"); err != nil {
			return b, err
		}
		if b.FailureRatio > 1 {
			return b, invalidLimit("breaker.failure_ratio", "maximum", "must be at most 1")
		}
	}
	if m := v.Get("min_attempts"); m != nil {
		if b.MinAttempts, err = limitInteger(m, "breaker.min_attempts"); err != nil {
			return b, err
		}
	}
	if m := v.Get("window_s"); m != nil {
		if b.Window, err = limitSeconds(m, "breaker.window_s"); err != nil {
			return b, err
		}
	}
	if m := v.Get("cooldown_s"); m != nil {
		if b.Cooldown, err = limitSeconds(m, "breaker.cooldown_s"); err != nil {
			return b, err
		}
	}
	if m := v.Get("probes"); m != nil {
		if b.Probes, err = limitInteger(m, "breaker.probes"); err != nil {
			return b, err
		}
	}
	if ratio == nil {
		return b, invalidLimit("breaker.failure_ratio", "required", "a breaker sets failure_ratio")
	}
	return b, nil
}

// checkMembers refuses the first member of object not in known, named with prefix.
func checkMembers(object *Value, prefix string, known []string) error {
	for _, m := range object.Members {
		if !slices.Contains(known, m.Key) {
			return invalidLimit(prefix+m.Key, "unknown_field", "is not a member (%v)", known)
		}
	}
	return nil
}

// limitInteger is an integer member ≥ 1.
func limitInteger(v *Value, field string) (int64, error) {
	if !v.IsInteger() {
		return 0, invalidLimit(field, "type", "must be an integer written without fraction or exponent, not %s", v.Kind)
	}
	n, err := strconv.ParseInt(v.Text, 10, 64)
	if err != nil {
		return 0, invalidLimit(field, "type", "must be an integer of at most 64 bits")
	}
	if n < 1 {
		return 0, invalidLimit(field, "minimum", "must be at least 1")
	}
	return n, nil
}

// limitPositive is a finite number member > 0.
func limitPositive(v *Value, field string) (float64, error) {
	if v.Kind != Number {
		return 0, invalidLimit(field, "type", "must be a number, not %s", v.Kind)
	}
	n, err := strconv.ParseFloat(v.Text, 64)
	if err != nil || math.IsInf(n, 0) {
		return 0, invalidLimit(field, "type", "must be a finite number")
	}
	if n <= 0 {
		return 0, invalidLimit(field, "minimum", "must be above 0")
	}
	return n, nil
}

// maxSeconds is the longest time.Duration in seconds.
const maxSeconds = float64(math.MaxInt64) / float64(time.Second)

// limitSeconds is a number of seconds > 0, as a Duration rounded to the
// nanosecond (at least 1 ns, at most what a Duration holds: about 292 years).
func limitSeconds(v *Value, field string) (time.Duration, error) {
	s, err := limitPositive(v, field)
	if err != nil {
		return 0, err
	}
	if s >= maxSeconds {
		return 0, invalidLimit(field, "maximum", "must be below %.0f seconds", maxSeconds)
	}
	d := time.Duration(math.Round(s * float64(time.Second)))
	if d < 1 {
		return 0, invalidLimit(field, "minimum", "must be at least 1 ns")
	}
	return d, nil
}

// Validate checks l as the limits schema does: members set are in range, and
// Concurrency, Rate or Breaker is set.
func (l TaskLimit) Validate() error {
	switch {
	case l.Concurrency < 0:
		return invalidLimit("concurrency", "minimum", "must be at least 1")
	case math.IsNaN(l.Rate) || math.IsInf(l.Rate, 0):
		return invalidLimit("rate", "json_value", "must be a finite number")
	case l.Rate < 0:
		return invalidLimit("rate", "minimum", "must be above 0")
	case l.Burst < 0:
		return invalidLimit("burst", "minimum", "must be at least 1")
	}
	if err := l.Breaker.validate(); err != nil {
		return err
	}
	if l.Concurrency == 0 && l.Rate == 0 && l.Breaker == (Breaker{}) {
		return invalidLimit("concurrency", "required", "a limit sets concurrency, rate or breaker")
	}
	return nil
}

// validate checks a breaker that is set: members in range, FailureRatio set.
func (b Breaker) validate() error {
	switch {
	case b == Breaker{}:
		return nil
	case math.IsNaN(b.FailureRatio) || math.IsInf(b.FailureRatio, 0):
		return invalidLimit("breaker.failure_ratio", "json_value", "must be a finite number")
	case b.FailureRatio < 0:
		return invalidLimit("breaker.failure_ratio", "minimum", "must be above 0")
	case b.FailureRatio > 1:
		return invalidLimit("breaker.failure_ratio", "maximum", "must be at most 1")
	case b.MinAttempts < 0:
		return invalidLimit("breaker.min_attempts", "minimum", "must be at least 1")
	case b.Window < 0:
		return invalidLimit("breaker.window_s", "minimum", "must be above 0")
	case b.Cooldown < 0:
		return invalidLimit("breaker.cooldown_s", "minimum", "must be above 0")
	case b.Probes < 0:
		return invalidLimit("breaker.probes", "minimum", "must be at least 1")
	case b.FailureRatio == 0:
		return invalidLimit("breaker.failure_ratio", "required", "a breaker sets failure_ratio")
	}
	return nil
}

// jsonObject writes a JSON object member by member.
type jsonObject []byte

// add appends the member name with value, JSON text already.
func (o *jsonObject) add(name, value string) {
	if len(*o) == 0 {
		*o = append(*o, '{')
	} else {
		*o = append(*o, ',')
	}
	*o = append(append(AppendString(*o, name), ':'), value...)
}

// close ends the object ("{}" when no member was added).
func (o jsonObject) close() string {
	if len(o) == 0 {
		return "{}"
	}
	return string(append(o, '}'))
}

// JSON is l's canonical JSON: the members set, in schema order.
func (l TaskLimit) JSON() []byte {
	var o jsonObject
	if l.Concurrency > 0 {
		o.add("concurrency", strconv.FormatInt(l.Concurrency, 10))
	}
	if l.Rate > 0 {
		o.add("rate", formatNumber(l.Rate))
	}
	if l.Burst > 0 {
		o.add("burst", strconv.FormatInt(l.Burst, 10))
	}
	if l.Smooth {
		o.add("smooth", "true")
	}
	if l.Breaker != (Breaker{}) {
		o.add("breaker", l.Breaker.json())
	}
	return []byte(o.close())
}

// json is b's canonical JSON: the members set, in schema order.
func (b Breaker) json() string {
	var o jsonObject
	if b.FailureRatio > 0 {
		o.add("failure_ratio", formatNumber(b.FailureRatio))
	}
	if b.MinAttempts > 0 {
		o.add("min_attempts", strconv.FormatInt(b.MinAttempts, 10))
	}
	if b.Window > 0 {
		o.add("window_s", formatNumber(b.Window.Seconds()))
	}
	if b.Cooldown > 0 {
		o.add("cooldown_s", formatNumber(b.Cooldown.Seconds()))
	}
	if b.Probes > 0 {
		o.add("probes", strconv.FormatInt(b.Probes, 10))
	}
	return o.close()
}

// formatNumber is f as the shortest JSON number that reads back as f.
func formatNumber(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) }

// TaskLimits reads and writes the limits of task types, per queue, in the
// hash <prefix>:{<queue>}:limits, field <task_type> (docs/protocol.md section
// 19). Workers read it on every read: a change applies without a restart.
type TaskLimits struct {
	Client redis.UniversalClient
	Keys   KeySpace
}

// limitsKey is the limits hash of queue, after checking the names.
func (t TaskLimits) limitsKey(queue, taskType string) (string, error) {
	if err := CheckQueueName(queue); err != nil {
		return "", err
	}
	if taskType != "" && (!taskTypeRe.MatchString(taskType) || len(taskType) > maxTaskTypeChars) {
		return "", fmt.Errorf("task_type %q must be dotted identifiers of at most %d characters", taskType,
			maxTaskTypeChars)
	}
	return t.Keys.Queue(queue).Limits(), nil
}

// Set validates limit and writes it for taskType on queue, replacing any.
func (t TaskLimits) Set(ctx context.Context, queue, taskType string, limit TaskLimit) error {
	if taskType == "" {
		return errors.New("task_type is required")
	}
	key, err := t.limitsKey(queue, taskType)
	if err != nil {
		return err
	}
	if err := limit.Validate(); err != nil {
		return err
	}
	return t.Client.HSet(ctx, key, taskType, string(limit.JSON())).Err()
}

// Get answers the limit of taskType on queue, and whether it has one. A stored
// value that breaks the schema answers an *InvalidLimitError (workers ignore it).
func (t TaskLimits) Get(ctx context.Context, queue, taskType string) (TaskLimit, bool, error) {
	key, err := t.limitsKey(queue, taskType)
	if err != nil {
		return TaskLimit{}, false, err
	}
	text, err := t.Client.HGet(ctx, key, taskType).Result()
	if errors.Is(err, redis.Nil) {
		return TaskLimit{}, false, nil
	}
	if err != nil {
		return TaskLimit{}, false, err
	}
	limit, err := ParseTaskLimit([]byte(text))
	return limit, err == nil, err
}

// List answers every limit of queue by task type. Stored values that break
// the schema are left out and named in the error, which joins their
// *InvalidLimitError (workers ignore them).
func (t TaskLimits) List(ctx context.Context, queue string) (map[string]TaskLimit, error) {
	key, err := t.limitsKey(queue, "")
	if err != nil {
		return nil, err
	}
	stored, err := t.Client.HGetAll(ctx, key).Result()
	if err != nil {
		return nil, err
	}
	out := make(map[string]TaskLimit, len(stored))
	var bad []error
	for taskType, text := range stored {
		limit, err := ParseTaskLimit([]byte(text))
		if err != nil {
			bad = append(bad, fmt.Errorf("limit of %s: %w", taskType, err))
			continue
		}
		out[taskType] = limit
	}
	return out, errors.Join(bad...)
}

// Remove deletes the limit of taskType on queue; it reports whether there was one.
func (t TaskLimits) Remove(ctx context.Context, queue, taskType string) (bool, error) {
	key, err := t.limitsKey(queue, taskType)
	if err != nil {
		return false, err
	}
	n, err := t.Client.HDel(ctx, key, taskType).Result()
	return n == 1, err
}
