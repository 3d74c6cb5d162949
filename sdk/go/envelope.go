// Package envelope is a Go peer of the kombu-envelope protocol (docs/protocol.md):
// the Envelope model and its validation rules, the stream-entry codec, the key
// layout, a producer and a worker that share queues with Python Celery workers.
package envelope

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math/big"
	"regexp"
	"sort"
	"strings"
	"time"
	"unicode/utf8"
)

// Field defaults and bounds of docs/protocol.md section 1.
const (
	PriorityMin         = 0
	PriorityMax         = 255
	PriorityDefault     = 100
	MaxRetriesDefault   = 3
	MaxSafeInteger      = 1<<53 - 1
	maxExtDepth         = 64
	maxTaskIDChars      = 255
	maxTaskTypeChars    = 255
	maxTraceIDChars     = 128
	maxIdempotencyKeys  = 512
	maxOrderingKeyChars = 255
)

var (
	taskTypeRe = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_\-]*(\.[A-Za-z_][A-Za-z0-9_\-]*)*$`)
	tokenRe    = regexp.MustCompile(`^[\x21-\x7e]+$`)
	extNameRe  = regexp.MustCompile(`^[a-z][a-z0-9_.\-]*$`)
)

// Limits are the configurable validation limits.
type Limits struct {
	MaxDelay        time.Duration // how far ahead schedule_time may be at publish
	MaxPayloadDepth int           // deepest nesting; the payload object is level 1
	MaxPayloadBytes int           // largest payload as compact JSON
}

// DefaultLimits are the protocol's defaults: 90 days, 5 levels, 1 MiB.
var DefaultLimits = Limits{
	MaxDelay:        90 * 24 * time.Hour,
	MaxPayloadDepth: 5,
	MaxPayloadBytes: 1024 * 1024,
}

// Envelope is one task, as every language sees it (docs/protocol.md section 1).
//
// Payload and each Ext namespace are kept as compact JSON objects, member
// order included, so data this program does not interpret passes through
// untouched.
type Envelope struct {
	TaskID         string
	TaskType       string
	PayloadVersion int64
	Payload        []byte     // a JSON object
	ScheduleTime   *Timestamp // nil: run now
	TimeoutMS      *int64     // nil: no limit
	Expires        *Timestamp // nil: never; after it the task must not start
	MaxRetries     *int64     // nil: unlimited
	RetryCount     int64
	Priority       int
	TraceID        string
	CreatedAt      Timestamp
	IdempotencyKey *string
	OrderingKey    *string // tasks of one key on a queue run one at a time, in order (section 20)
	Headers        map[string]string
	Ext            []ExtEntry
}

// ExtEntry is one namespace of ext: a name and its JSON object.
type ExtEntry struct {
	Namespace string
	Value     []byte
}

// Violation is one broken rule: the field (a dotted path, "envelope" for the
// whole object), the neutral rule name used by the conformance vectors, and
// a message.
type Violation struct {
	Field   string
	Rule    string
	Message string
}

func (v Violation) String() string { return fmt.Sprintf("%s: %s [%s]", v.Field, v.Message, v.Rule) }

// ValidationError is an Envelope that breaks one or more rules.
type ValidationError struct {
	Violations []Violation
}

func (e *ValidationError) Error() string {
	parts := make([]string, len(e.Violations))
	for i, v := range e.Violations {
		parts[i] = v.String()
	}
	return "invalid envelope: " + strings.Join(parts, "; ")
}

// New returns a valid-looking Envelope with every default set: a fresh task_id
// and trace_id, created_at now, payload {} unless given. This is the producer
// filling in the identity fields, which are required on the wire; readers
// (Parse, DecodeEntry) never invent them. Call Validate (or publish, which
// validates) after changing fields.
func New(taskType string, payload []byte) *Envelope {
	if len(payload) == 0 {
		payload = []byte("{}")
	}
	maxRetries := int64(MaxRetriesDefault)
	return &Envelope{
		TaskID:         NewTaskID(),
		TaskType:       taskType,
		PayloadVersion: 1,
		Payload:        payload,
		MaxRetries:     &maxRetries,
		Priority:       PriorityDefault,
		TraceID:        NewTraceID(),
		CreatedAt:      Now(),
		Headers:        map[string]string{},
	}
}

// NewTaskID returns a random UUID (version 4), the default task_id.
func NewTaskID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// NewTraceID returns 32 random hex digits, the default trace_id.
func NewTraceID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Parse validates JSON text as an Envelope (without the publish-time rules).
func Parse(data []byte, limits Limits) (*Envelope, error) {
	root, err := ParseJSON(data)
	if err != nil {
		return nil, &ValidationError{[]Violation{{"envelope", "json", err.Error()}}}
	}
	return FromValue(root, limits)
}

// Validate checks every rule except the publish-time ones by writing the
// Envelope and reading it back, so a built Envelope meets exactly the rules
// a reader applies.
func (e *Envelope) Validate(limits Limits) error {
	_, err := Parse(e.JSON(), limits)
	return err
}

// IsDue reports whether the task may run at now.
func (e *Envelope) IsDue(now time.Time) bool {
	return e.ScheduleTime == nil || !e.ScheduleTime.After(now)
}

// IsExpired reports whether the task must not start at now: its expires is
// at or before now (docs/protocol.md section 5.1, step 3).
func (e *Envelope) IsExpired(now time.Time) bool {
	return e.Expires != nil && !e.Expires.After(now)
}

// DueMS is the due time in milliseconds since the Unix epoch (now when unscheduled).
func (e *Envelope) DueMS(now time.Time) int64 {
	if e.ScheduleTime == nil {
		return now.UnixMilli()
	}
	return e.ScheduleTime.UnixMilli()
}

// CheckPublishable applies the publish-time rule max_delay.
func CheckPublishable(e *Envelope, limits Limits, now time.Time) error {
	if e.ScheduleTime == nil {
		return nil
	}
	if e.ScheduleTime.After(now.Add(limits.MaxDelay)) {
		return &ValidationError{[]Violation{{
			"schedule_time", "max_delay",
			fmt.Sprintf("%s is more than %s (the maximum delay) ahead of now", e.ScheduleTime, limits.MaxDelay),
		}}}
	}
	return nil
}

// Clone returns a deep copy.
func (e *Envelope) Clone() *Envelope {
	c := *e
	c.Payload = append([]byte(nil), e.Payload...)
	if e.ScheduleTime != nil {
		t := *e.ScheduleTime
		c.ScheduleTime = &t
	}
	if e.TimeoutMS != nil {
		v := *e.TimeoutMS
		c.TimeoutMS = &v
	}
	if e.Expires != nil {
		t := *e.Expires
		c.Expires = &t
	}
	if e.MaxRetries != nil {
		v := *e.MaxRetries
		c.MaxRetries = &v
	}
	if e.IdempotencyKey != nil {
		v := *e.IdempotencyKey
		c.IdempotencyKey = &v
	}
	if e.OrderingKey != nil {
		v := *e.OrderingKey
		c.OrderingKey = &v
	}
	c.Headers = make(map[string]string, len(e.Headers))
	for k, v := range e.Headers {
		c.Headers[k] = v
	}
	c.Ext = make([]ExtEntry, len(e.Ext))
	for i, x := range e.Ext {
		c.Ext[i] = ExtEntry{x.Namespace, append([]byte(nil), x.Value...)}
	}
	return &c
}

// JSON is the canonical compact JSON of the Envelope, fields in protocol
// order. Optional fields whose value is null are left out, except
// max_retries, whose null means "unlimited".
func (e *Envelope) JSON() []byte {
	b := make([]byte, 0, 256+len(e.Payload))
	b = append(b, `{"task_id":`...)
	b = AppendString(b, e.TaskID)
	b = append(b, `,"task_type":`...)
	b = AppendString(b, e.TaskType)
	b = fmt.Appendf(b, `,"payload_version":%d,"payload":`, e.PayloadVersion)
	if len(e.Payload) == 0 {
		b = append(b, "{}"...)
	} else {
		b = append(b, e.Payload...)
	}
	if e.ScheduleTime != nil {
		b = append(b, `,"schedule_time":`...)
		b = AppendString(b, e.ScheduleTime.String())
	}
	if e.TimeoutMS != nil {
		b = fmt.Appendf(b, `,"timeout_ms":%d`, *e.TimeoutMS)
	}
	if e.Expires != nil {
		b = append(b, `,"expires":`...)
		b = AppendString(b, e.Expires.String())
	}
	if e.MaxRetries != nil {
		b = fmt.Appendf(b, `,"max_retries":%d`, *e.MaxRetries)
	} else {
		b = append(b, `,"max_retries":null`...)
	}
	b = fmt.Appendf(b, `,"retry_count":%d,"priority":%d,"trace_id":`, e.RetryCount, e.Priority)
	b = AppendString(b, e.TraceID)
	b = append(b, `,"created_at":`...)
	b = AppendString(b, e.CreatedAt.String())
	if e.IdempotencyKey != nil {
		b = append(b, `,"idempotency_key":`...)
		b = AppendString(b, *e.IdempotencyKey)
	}
	if e.OrderingKey != nil {
		b = append(b, `,"ordering_key":`...)
		b = AppendString(b, *e.OrderingKey)
	}
	b = append(b, `,"headers":{`...)
	names := make([]string, 0, len(e.Headers))
	for k := range e.Headers {
		names = append(names, k)
	}
	sort.Strings(names)
	for i, k := range names {
		if i > 0 {
			b = append(b, ',')
		}
		b = AppendString(b, k)
		b = append(b, ':')
		b = AppendString(b, e.Headers[k])
	}
	b = append(b, `},"ext":{`...)
	for i, x := range e.Ext {
		if i > 0 {
			b = append(b, ',')
		}
		b = AppendString(b, x.Namespace)
		b = append(b, ':')
		b = append(b, x.Value...)
	}
	return append(b, "}}"...)
}

// --- reading and validating ---------------------------------------------------

type checker struct {
	violations []Violation
}

func (c *checker) add(field, rule, format string, args ...any) {
	c.violations = append(c.violations, Violation{field, rule, fmt.Sprintf(format, args...)})
}

// FromValue validates a parsed JSON value as an Envelope.
func FromValue(root *Value, limits Limits) (*Envelope, error) {
	c := &checker{}
	if root.Kind != Object {
		c.add("envelope", "type", "an Envelope is a JSON object, not %s", root.Kind)
		return nil, &ValidationError{c.violations}
	}
	// Defaults of the optional fields; task_id, trace_id and created_at are
	// required on the wire: a reader never invents an identity.
	maxRetries := int64(MaxRetriesDefault)
	e := &Envelope{PayloadVersion: 1, Payload: []byte("{}"), MaxRetries: &maxRetries,
		Priority: PriorityDefault, Headers: map[string]string{}}

	if v := root.Get("task_id"); v == nil {
		c.add("task_id", "required", "field required (producers fill it in; readers never invent it)")
	} else {
		e.TaskID = c.token(v, "task_id", maxTaskIDChars)
	}
	if v := root.Get("task_type"); v == nil {
		c.add("task_type", "required", "field required")
	} else if s, ok := c.str(v, "task_type", 1, maxTaskTypeChars); ok {
		if !taskTypeRe.MatchString(s) {
			c.add("task_type", "pattern", "must be dotted identifiers, e.g. order.close_timeout")
		}
		e.TaskType = s
	}
	if v := root.Get("payload_version"); v != nil {
		if n, ok := c.integer(v, "payload_version", 1, MaxSafeInteger); ok {
			e.PayloadVersion = n
		}
	}
	if v := root.Get("payload"); v != nil {
		if v.Kind != Object {
			c.add("payload", "type", "must be a JSON object, not %s", v.Kind)
		} else if c.jsonData(v, "payload", "payload", limits.MaxPayloadDepth) {
			b := AppendCanonical(nil, v)
			if len(b) > limits.MaxPayloadBytes {
				c.add("payload", "max_bytes", "payload is %d bytes of JSON, above the limit of %d",
					len(b), limits.MaxPayloadBytes)
			}
			e.Payload = b
		}
	}
	if v := root.Get("schedule_time"); v != nil && v.Kind != Null {
		if t, ok := c.timestamp(v, "schedule_time"); ok {
			e.ScheduleTime = &t
		}
	}
	if v := root.Get("timeout_ms"); v != nil && v.Kind != Null {
		if n, ok := c.integer(v, "timeout_ms", 1, MaxSafeInteger); ok {
			e.TimeoutMS = &n
		}
	}
	if v := root.Get("expires"); v != nil && v.Kind != Null {
		if t, ok := c.timestamp(v, "expires"); ok {
			e.Expires = &t
		}
	}
	maxRetriesOK := true
	if v := root.Get("max_retries"); v != nil {
		if v.Kind == Null {
			e.MaxRetries = nil
		} else if n, ok := c.integer(v, "max_retries", 0, MaxSafeInteger); ok {
			e.MaxRetries = &n
		} else {
			maxRetriesOK = false
		}
	}
	if v := root.Get("retry_count"); v != nil {
		if n, ok := c.integer(v, "retry_count", 0, MaxSafeInteger); ok {
			e.RetryCount = n
			if maxRetriesOK && e.MaxRetries != nil && n > *e.MaxRetries {
				c.add("retry_count", "retry_count_le_max_retries",
					"retry_count (%d) exceeds max_retries (%d)", n, *e.MaxRetries)
			}
		}
	}
	if v := root.Get("priority"); v != nil {
		if n, ok := c.integer(v, "priority", PriorityMin, PriorityMax); ok {
			e.Priority = int(n)
		}
	}
	if v := root.Get("trace_id"); v == nil {
		c.add("trace_id", "required", "field required (producers fill it in; readers never invent it)")
	} else {
		e.TraceID = c.token(v, "trace_id", maxTraceIDChars)
	}
	if v := root.Get("created_at"); v == nil {
		c.add("created_at", "required", "field required (producers fill it in; readers never invent it)")
	} else {
		if t, ok := c.timestamp(v, "created_at"); ok {
			e.CreatedAt = t
		}
	}
	if v := root.Get("idempotency_key"); v != nil && v.Kind != Null {
		if s, ok := c.str(v, "idempotency_key", 1, maxIdempotencyKeys); ok {
			e.IdempotencyKey = &s
		}
	}
	if v := root.Get("ordering_key"); v != nil && v.Kind != Null {
		if s := c.token(v, "ordering_key", maxOrderingKeyChars); s != "" {
			e.OrderingKey = &s
		}
	}
	if v := root.Get("headers"); v != nil {
		if v.Kind != Object {
			c.add("headers", "type", "must be an object of string to string, not %s", v.Kind)
		} else {
			for _, m := range v.Members {
				switch {
				case m.Value.Kind != String:
					c.add("headers."+m.Key, "type", "header values are strings, not %s", m.Value.Kind)
				default:
					e.Headers[m.Key] = m.Value.Text
				}
			}
		}
	}
	if v := root.Get("ext"); v != nil {
		if v.Kind != Object {
			c.add("ext", "type", "must be an object of namespace to object, not %s", v.Kind)
		} else {
			for _, m := range v.Members {
				field := "ext." + m.Key
				switch {
				case !extNameRe.MatchString(m.Key):
					c.add(field, "pattern", "namespaces match ^[a-z][a-z0-9_.-]*$")
				case m.Value.Kind != Object:
					c.add(field, "type", "must be a JSON object, not %s", m.Value.Kind)
				case c.jsonData(m.Value, "ext", field, maxExtDepth-1):
					e.Ext = append(e.Ext, ExtEntry{m.Key, AppendCanonical(nil, m.Value)})
				}
			}
		}
	}
	for _, m := range root.Members {
		if !knownFields[m.Key] {
			c.add(m.Key, "unknown_field", "extra fields are not permitted (language-specific data goes under ext)")
		}
	}
	if len(c.violations) > 0 {
		return nil, &ValidationError{c.violations}
	}
	return e, nil
}

var knownFields = map[string]bool{
	"task_id": true, "task_type": true, "payload_version": true, "payload": true,
	"schedule_time": true, "timeout_ms": true, "expires": true, "max_retries": true, "retry_count": true,
	"priority": true, "trace_id": true, "created_at": true, "idempotency_key": true,
	"ordering_key": true, "headers": true, "ext": true,
}

// str checks a string field's type and length (in characters).
func (c *checker) str(v *Value, field string, minLen, maxLen int) (string, bool) {
	if v.Kind != String {
		c.add(field, "type", "must be a string, not %s", v.Kind)
		return "", false
	}
	n := utf8.RuneCountInString(v.Text)
	if n < minLen || n > maxLen {
		c.add(field, "length", "must be %d to %d characters long, not %d", minLen, maxLen, n)
		return "", false
	}
	return v.Text, true
}

// token checks a string of printable ASCII without spaces (task_id, trace_id,
// ordering_key); it answers "" when the string breaks a rule.
func (c *checker) token(v *Value, field string, maxLen int) string {
	s, ok := c.str(v, field, 1, maxLen)
	if !ok {
		return ""
	}
	if !tokenRe.MatchString(s) {
		c.add(field, "pattern", "must be printable ASCII without spaces")
		return ""
	}
	return s
}

// integer checks a JSON integer: no fraction, no exponent, no boolean, within [lo, hi].
func (c *checker) integer(v *Value, field string, lo, hi int64) (int64, bool) {
	if v.Kind != Number || !v.IsInteger() {
		c.add(field, "type", "must be an integer written without fraction or exponent, not %s", v.Kind)
		return 0, false
	}
	n, ok := new(big.Int).SetString(v.Text, 10)
	if !ok || !n.IsInt64() || n.Int64() < lo || n.Int64() > hi {
		c.add(field, "range", "must be between %d and %d", lo, hi)
		return 0, false
	}
	return n.Int64(), true
}

func (c *checker) timestamp(v *Value, field string) (Timestamp, bool) {
	if v.Kind != String {
		c.add(field, "type", "must be an RFC 3339 string with an offset, not %s (numeric timestamps are ambiguous)", v.Kind)
		return Timestamp{}, false
	}
	t, err := ParseTimestamp(v.Text)
	if err != nil {
		var te *TimeError
		errors.As(err, &te)
		c.add(field, te.Rule, "%s", te.Message)
		return Timestamp{}, false
	}
	return t, true
}

// jsonData checks nesting (the value itself is level 1) and that every number
// is finite as a double; violations name field, messages name path.
func (c *checker) jsonData(v *Value, field, path string, maxDepth int) bool {
	var walk func(v *Value, where string, level int) bool
	walk = func(v *Value, where string, level int) bool {
		switch v.Kind {
		case Object, Array:
			if level > maxDepth {
				c.add(field, "max_depth", "nested deeper than %d levels at %s", maxDepth, where)
				return false
			}
			for i, item := range v.Items {
				if !walk(item, fmt.Sprintf("%s[%d]", where, i), level+1) {
					return false
				}
			}
			for _, m := range v.Members {
				if !walk(m.Value, where+"."+m.Key, level+1) {
					return false
				}
			}
		case Number:
			if !v.IsInteger() && isInfinite(v.Text) {
				c.add(field, "json_value", "%s is too large for a double (infinity is not JSON)", where)
				return false
			}
		}
		return true
	}
	return walk(v, path, 1)
}

func isInfinite(text string) bool {
	f, _, err := big.ParseFloat(text, 10, 64, big.ToNearestEven)
	if err != nil {
		return true
	}
	x, _ := f.Float64()
	return x > 1.7976931348623157e308 || x < -1.7976931348623157e308
}
