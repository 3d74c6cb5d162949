package envelope

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"
	"github.com/santhosh-tekuri/jsonschema/v6"
	"github.com/santhosh-tekuri/jsonschema/v6/kind"
	"golang.org/x/text/language"
	"golang.org/x/text/message"
)

// DefaultSchemaCache is how long payload schemas read from Redis are used (schema_cache_s).
const DefaultSchemaCache = 30 * time.Second

// RuleSchema is the rule of a payload that breaks its schema (docs/protocol.md section 16).
const RuleSchema = "schema"

// maxSchemaReason is the longest dead-letter reason of a schema violation, in characters.
const maxSchemaReason = 1000

// SchemaViolation is one way a payload breaks its schema: Field is
// payload<path>, Rule is RuleSchema, Keyword the JSON Schema keyword.
type SchemaViolation struct {
	Violation
	Keyword string
}

// PayloadSchemas enforces the payload schemas of one prefix (<prefix>:schemas,
// field <task_type>@<payload_version>, draft 2020-12), read with HGETALL at most
// every Cache. A stored schema that cannot be compiled is logged and ignored.
// It is safe for concurrent use.
type PayloadSchemas struct {
	Client redis.UniversalClient
	Keys   KeySpace
	Cache  time.Duration // 0: DefaultSchemaCache
	Log    *slog.Logger  // nil: slog.Default()

	mu       sync.Mutex
	readAt   time.Time
	texts    map[string]string             // field -> stored text, as compiled
	compiled map[string]*jsonschema.Schema // field -> schema; nil when it cannot be used
}

// Check returns a *ValidationError naming every violation (rule schema) when
// e's payload breaks the schema of its task type and version; nil when it
// does not or has none. It returns Redis's error when the schemas cannot be read.
func (s *PayloadSchemas) Check(ctx context.Context, e *Envelope) error {
	found, err := s.Violations(ctx, e)
	if err != nil || len(found) == 0 {
		return err
	}
	out := make([]Violation, len(found))
	for i, v := range found {
		out[i] = v.Violation
	}
	return &ValidationError{out}
}

// Violations are the ways e's payload breaks its schema, sorted as section 16 says.
func (s *PayloadSchemas) Violations(ctx context.Context, e *Envelope) ([]SchemaViolation, error) {
	schema, err := s.schemaOf(ctx, schemaField(e.TaskType, e.PayloadVersion))
	if err != nil || schema == nil {
		return nil, err
	}
	return PayloadViolations(schema, e.Payload)
}

// schemaOf is the compiled schema stored at field, reading the hash again once Cache passed.
func (s *PayloadSchemas) schemaOf(ctx context.Context, field string) (*jsonschema.Schema, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.compiled == nil || time.Since(s.readAt) >= cmp.Or(s.Cache, DefaultSchemaCache) {
		stored, err := s.Client.HGetAll(ctx, s.Keys.Schemas()).Result()
		if err != nil {
			return nil, fmt.Errorf("reading the payload schemas (%s): %w", s.Keys.Schemas(), err)
		}
		texts, compiled := map[string]string{}, map[string]*jsonschema.Schema{}
		for f, text := range stored {
			if s.texts[f] == text && s.texts != nil { // compile only what changed
				compiled[f] = s.compiled[f]
			} else {
				compiled[f] = s.usable(f, text)
			}
			texts[f] = text
		}
		s.texts, s.compiled, s.readAt = texts, compiled, time.Now()
	}
	return s.compiled[field], nil
}

// usable compiles a stored schema, or logs why it is ignored and answers nil.
func (s *PayloadSchemas) usable(field, text string) *jsonschema.Schema {
	schema, err := CompileSchema([]byte(text))
	if err != nil {
		cmp.Or(s.Log, slog.Default()).Warn("payload schema is ignored", "schema", field, "error", err.Error())
		return nil
	}
	return schema
}

// schemaField is the hash field of a schema: <task_type>@<payload_version>.
func schemaField(taskType string, version int64) string {
	return taskType + "@" + strconv.FormatInt(version, 10)
}

// refuseLoading keeps a schema from fetching anything: only #/... references resolve.
type refuseLoading struct{}

func (refuseLoading) Load(url string) (any, error) {
	return nil, fmt.Errorf("schemas refer only to themselves; %s is not loaded", url)
}

// CompileSchema compiles a payload schema: a JSON object, draft 2020-12 unless
// it names another, referring only to itself; format is never asserted.
func CompileSchema(text []byte) (*jsonschema.Schema, error) {
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(text))
	if err != nil {
		return nil, fmt.Errorf("not JSON: %w", err)
	}
	if _, ok := doc.(map[string]any); !ok {
		return nil, errors.New("a payload schema must be a JSON object")
	}
	c := jsonschema.NewCompiler()
	c.DefaultDraft(jsonschema.Draft2020)
	c.UseLoader(refuseLoading{})
	const url = "urn:envelope:payload-schema"
	if err := c.AddResource(url, doc); err != nil {
		return nil, err
	}
	return c.Compile(url)
}

// PayloadViolations are the ways payload (JSON text) breaks schema: one per
// missing required member and per unexpected member, each on that member's
// path, sorted by path segment by segment (indices as numbers), then keyword.
func PayloadViolations(schema *jsonschema.Schema, payload []byte) ([]SchemaViolation, error) {
	doc, err := jsonschema.UnmarshalJSON(bytes.NewReader(payload))
	if err != nil {
		return nil, fmt.Errorf("payload is not JSON: %w", err)
	}
	err = schema.Validate(doc)
	var verr *jsonschema.ValidationError
	if err == nil || !errors.As(err, &verr) {
		return nil, err
	}
	var found []located
	collect(verr, doc, &found)
	slices.SortStableFunc(found, func(a, b located) int {
		return cmp.Or(comparePaths(a.path, b.path), strings.Compare(a.keyword, b.keyword),
			strings.Compare(a.message, b.message))
	})
	out := make([]SchemaViolation, len(found))
	for i, l := range found {
		out[i] = SchemaViolation{Violation{Field: "payload" + l.path.String(), Rule: RuleSchema,
			Message: l.message}, l.keyword}
	}
	return out, nil
}

// SchemaDeadLetterReason is the dead-letter reason of a payload that breaks
// its schema: "schema: <path>: <message>; ...", cut to 1,000 characters.
func SchemaDeadLetterReason(violations []SchemaViolation) string {
	parts := make([]string, len(violations))
	for i, v := range violations {
		parts[i] = v.Field + ": " + v.Message
	}
	reason := "schema: " + strings.Join(parts, "; ")
	if utf8.RuneCountInString(reason) <= maxSchemaReason {
		return reason
	}
	return string([]rune(reason)[:maxSchemaReason-1]) + "…"
}

// segment is one step of a path below the payload: a member name or an array index.
type segment struct {
	name  string
	index int
	isIdx bool
}

type schemaPath []segment

func (p schemaPath) String() string {
	var b strings.Builder
	for _, s := range p {
		if s.isIdx {
			fmt.Fprintf(&b, "[%d]", s.index)
		} else {
			b.WriteString("." + s.name)
		}
	}
	return b.String()
}

// comparePaths orders segment by segment, an index before a name, indices as numbers.
func comparePaths(a, b schemaPath) int {
	for i := range min(len(a), len(b)) {
		x, y := a[i], b[i]
		switch {
		case x.isIdx != y.isIdx:
			if x.isIdx {
				return -1
			}
			return 1
		case x.isIdx:
			if c := cmp.Compare(x.index, y.index); c != 0 {
				return c
			}
		default:
			if c := strings.Compare(x.name, y.name); c != 0 {
				return c
			}
		}
	}
	return cmp.Compare(len(a), len(b))
}

// located is one violation before it is sorted.
type located struct {
	path             schemaPath
	keyword, message string
}

var english = message.NewPrinter(language.English)

// collect flattens the error tree: groups, references and allOf are looked
// into; every other error is a violation, required and additionalProperties
// one per member.
func collect(e *jsonschema.ValidationError, doc any, out *[]located) {
	switch k := e.ErrorKind.(type) {
	case *kind.Schema, *kind.Group, *kind.Reference, *kind.AllOf:
		for _, c := range e.Causes {
			collect(c, doc, out)
		}
		return
	case *kind.Required:
		at := instancePath(doc, e.InstanceLocation)
		for _, name := range k.Missing {
			msg := (&kind.Required{Missing: []string{name}}).LocalizedString(english)
			*out = append(*out, located{member(at, name), "required", msg})
		}
		return
	case *kind.AdditionalProperties:
		at := instancePath(doc, e.InstanceLocation)
		for _, name := range k.Properties {
			msg := (&kind.AdditionalProperties{Properties: []string{name}}).LocalizedString(english)
			*out = append(*out, located{member(at, name), "additionalProperties", msg})
		}
		return
	}
	keyword := "schema"
	if kw := e.ErrorKind.KeywordPath(); len(kw) > 0 {
		keyword = kw[0]
	}
	*out = append(*out, located{instancePath(doc, e.InstanceLocation), keyword,
		e.ErrorKind.LocalizedString(english)})
}

func member(at schemaPath, name string) schemaPath {
	return append(slices.Clone(at), segment{name: name})
}

// instancePath types the segments of an instance location: an index where
// the value is an array, a name where it is an object.
func instancePath(doc any, location []string) schemaPath {
	out := make(schemaPath, 0, len(location))
	for _, part := range location {
		if arr, ok := doc.([]any); ok {
			if i, err := strconv.Atoi(part); err == nil && i >= 0 && i < len(arr) {
				out = append(out, segment{index: i, isIdx: true})
				doc = arr[i]
				continue
			}
		}
		out = append(out, segment{name: part})
		if obj, ok := doc.(map[string]any); ok {
			doc = obj[part]
		} else {
			doc = nil
		}
	}
	return out
}
