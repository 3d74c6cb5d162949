package envelope

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"

	"github.com/redis/go-redis/v9"
)

// ParkedConsumer is the reserved consumer that holds the entries waiting for
// their task type's limits (docs/protocol.md section 19): no consumer may use
// the name, and nobody takes its entries over.
const ParkedConsumer = "parked"

// TaskLimit is what one task type may do on one queue, all workers of every
// language together (docs/protocol.md section 19). A zero member is not set;
// at least one of Concurrency and Rate is.
type TaskLimit struct {
	Concurrency int64   // attempts running at once (≥ 1)
	Rate        float64 // starts per second (> 0)
	Burst       int64   // starts allowed back to back above Rate after an idle spell (≥ 1; default 1)
	Smooth      bool    // every start spaced evenly (Burst 1 whatever is set)
}

// InvalidLimitError is a limit that breaks the rules of
// kombu_envelope/schemas/limits.schema.json. Field names the member ("" for
// the document as a whole), Rule the broken rule, in the vocabulary of the
// conformance vectors (type, minimum, required, unknown_field, json).
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

// limitMembers are the members of a limit, in the order they are checked and written.
var limitMembers = []string{"concurrency", "rate", "burst", "smooth"}

// ParseTaskLimit reads a limit's JSON text, checked against the limits schema:
// an *InvalidLimitError names the first violation (unknown members first, then
// each member in schema order, then the rule that concurrency or rate is set).
func ParseTaskLimit(data []byte) (TaskLimit, error) {
	var l TaskLimit
	root, err := ParseJSON(data)
	if err != nil {
		return l, invalidLimit("", "json", "not JSON: %v", err)
	}
	if root.Kind != Object {
		return l, invalidLimit("", "type", "must be a JSON object, not %s", root.Kind)
	}
	for _, m := range root.Members {
		if !slices.Contains(limitMembers, m.Key) {
			return l, invalidLimit(m.Key, "unknown_field", "is not a member of a limit (%v)", limitMembers)
		}
	}
	if v := root.Get("concurrency"); v != nil {
		if l.Concurrency, err = limitInteger(v, "concurrency"); err != nil {
			return l, err
		}
	}
	if v := root.Get("rate"); v != nil {
		if v.Kind != Number {
			return l, invalidLimit("rate", "type", "must be a number, not %s", v.Kind)
		}
		rate, err := strconv.ParseFloat(v.Text, 64)
		if err != nil || math.IsInf(rate, 0) {
			return l, invalidLimit("rate", "type", "must be a finite number")
		}
		if rate <= 0 {
			return l, invalidLimit("rate", "minimum", "must be above 0")
		}
		l.Rate = rate
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
	return l, l.Validate()
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

// Validate checks l as the limits schema does: members set are in range, and
// Concurrency or Rate is set.
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
	case l.Concurrency == 0 && l.Rate == 0:
		return invalidLimit("concurrency", "required", "a limit sets concurrency, rate or both")
	}
	return nil
}

// JSON is l's canonical JSON: the members set, in schema order.
func (l TaskLimit) JSON() []byte {
	out := []byte{'{'}
	add := func(name, value string) {
		if len(out) > 1 {
			out = append(out, ',')
		}
		out = append(AppendString(out, name), ':')
		out = append(out, value...)
	}
	if l.Concurrency > 0 {
		add("concurrency", strconv.FormatInt(l.Concurrency, 10))
	}
	if l.Rate > 0 {
		add("rate", strconv.FormatFloat(l.Rate, 'f', -1, 64))
	}
	if l.Burst > 0 {
		add("burst", strconv.FormatInt(l.Burst, 10))
	}
	if l.Smooth {
		add("smooth", "true")
	}
	return append(out, '}')
}

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
