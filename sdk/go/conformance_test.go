package envelope

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

// conformanceDir is the repository's conformance/ directory ($ENVELOPE_CONFORMANCE_DIR overrides).
func conformanceDir(t testing.TB) string {
	if dir := os.Getenv("ENVELOPE_CONFORMANCE_DIR"); dir != "" {
		return dir
	}
	return filepath.Join(repoRoot(t), "conformance")
}

type manifest struct {
	FormatVersion int      `json:"format_version"`
	Envelopes     []string `json:"envelopes"`
	Entries       []string `json:"entries"`
	Schemas       []string `json:"schemas"`
	Limits        []string `json:"limits"`
}

type envelopeCase struct {
	Name            string          `json:"name"`
	Input           json.RawMessage `json:"input"`
	Valid           bool            `json:"valid"`
	Field           string          `json:"field"`
	Rule            string          `json:"rule"`
	Expect          map[string]any  `json:"expect"`
	Publish         bool            `json:"publish"`
	ScheduleOffsetS *float64        `json:"schedule_offset_s"`
}

type entryCase struct {
	Name     string            `json:"name"`
	Fields   map[string]string `json:"fields"`
	Valid    bool              `json:"valid"`
	Envelope map[string]any    `json:"envelope"`
	Error    string            `json:"error"`
	Field    string            `json:"field"`
	Rule     string            `json:"rule"`
}

func loadManifest(t *testing.T) manifest {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(conformanceDir(t), "manifest.json"))
	if err != nil {
		t.Fatalf("reading the conformance manifest: %v", err)
	}
	var m manifest
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatal(err)
	}
	if m.FormatVersion != 1 {
		t.Fatalf("manifest format_version %d is not supported", m.FormatVersion)
	}
	return m
}

func loadCase(t *testing.T, relative string, into any) {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(conformanceDir(t), filepath.FromSlash(relative)))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, into); err != nil {
		t.Fatalf("%s: %v", relative, err)
	}
}

// inputText is the JSON text a reader receives for a vector.
func inputText(t *testing.T, c *envelopeCase) []byte {
	var raw struct {
		Raw *string `json:"raw"`
	}
	var obj map[string]json.RawMessage
	if json.Unmarshal(c.Input, &obj) == nil && len(obj) == 1 && obj["raw"] != nil {
		if err := json.Unmarshal(c.Input, &raw); err != nil {
			t.Fatal(err)
		}
		return []byte(*raw.Raw)
	}
	if c.ScheduleOffsetS != nil {
		when := NewTimestamp(time.Now().Add(time.Duration(*c.ScheduleOffsetS * float64(time.Second))).UTC())
		obj["schedule_time"], _ = json.Marshal(when.String())
		data, err := json.Marshal(obj)
		if err != nil {
			t.Fatal(err)
		}
		return data
	}
	return c.Input
}

func violationsOf(err error) []Violation {
	switch e := err.(type) {
	case *ValidationError:
		return e.Violations
	case *MalformedEntry:
		return e.Violations
	}
	return nil
}

func generic(t *testing.T, data []byte) any {
	t.Helper()
	var v any
	if err := json.Unmarshal(data, &v); err != nil {
		t.Fatalf("written JSON does not parse: %v\n%s", err, data)
	}
	return v
}

func TestConformanceEnvelopes(t *testing.T) {
	m := loadManifest(t)
	if len(m.Envelopes) == 0 {
		t.Fatal("no envelope vectors")
	}
	for _, relative := range m.Envelopes {
		t.Run(strings.TrimSuffix(filepath.Base(relative), ".json"), func(t *testing.T) {
			var c envelopeCase
			loadCase(t, relative, &c)
			env, err := Parse(inputText(t, &c), DefaultLimits)
			if err == nil && c.Publish {
				err = CheckPublishable(env, DefaultLimits, time.Now())
			}
			if err != nil {
				if c.Valid {
					t.Fatalf("refused a valid Envelope: %v", err)
				}
				got := violationsOf(err)
				if len(got) != 1 || got[0].Field != c.Field || got[0].Rule != c.Rule {
					t.Fatalf("want exactly %s [%s], got %v", c.Field, c.Rule, got)
				}
				return
			}
			if !c.Valid {
				t.Fatalf("accepted, expected %s [%s]", c.Field, c.Rule)
			}
			written := generic(t, env.JSON()).(map[string]any)
			for name, want := range c.Expect {
				if got := written[name]; !reflect.DeepEqual(got, want) {
					t.Errorf("written %s = %#v, want %#v", name, got, want)
				}
			}
			again, err := Parse(env.JSON(), DefaultLimits)
			if err != nil {
				t.Fatalf("what was written does not read back: %v", err)
			}
			if !bytes.Equal(again.JSON(), env.JSON()) {
				t.Fatalf("not stable when written again:\n%s\n%s", env.JSON(), again.JSON())
			}
		})
	}
}

func TestConformanceEntries(t *testing.T) {
	m := loadManifest(t)
	if len(m.Entries) == 0 {
		t.Fatal("no entry vectors")
	}
	for _, relative := range m.Entries {
		t.Run(strings.TrimSuffix(filepath.Base(relative), ".json"), func(t *testing.T) {
			var c entryCase
			loadCase(t, relative, &c)
			fields := map[string]string{}
			for name, value := range c.Fields {
				if name == "body_base64" {
					raw, err := base64.StdEncoding.DecodeString(value)
					if err != nil {
						t.Fatal(err)
					}
					fields[FieldBody] = string(raw)
				} else {
					fields[name] = value
				}
			}
			env, err := DecodeEntry(fields, DefaultLimits)
			if err != nil {
				if c.Valid {
					t.Fatalf("refused a valid entry: %v", err)
				}
				me, ok := err.(*MalformedEntry)
				if !ok {
					t.Fatalf("want *MalformedEntry, got %T", err)
				}
				if me.Kind != c.Error {
					t.Fatalf("error %q (%s), want %q", me.Kind, me.Reason, c.Error)
				}
				if c.Field != "" {
					got := me.Violations
					if len(got) != 1 || got[0].Field != c.Field || got[0].Rule != c.Rule {
						t.Fatalf("want exactly %s [%s], got %v", c.Field, c.Rule, got)
					}
				}
				return
			}
			if !c.Valid {
				t.Fatalf("accepted, expected %s", c.Error)
			}
			got := generic(t, env.JSON())
			wantJSON, _ := json.Marshal(c.Envelope)
			if want := generic(t, wantJSON); !reflect.DeepEqual(got, want) {
				t.Fatalf("decoded\n%s\nwant\n%s", env.JSON(), wantJSON)
			}
		})
	}
}

// Every vector file on disk is listed in the manifest, so none is skipped silently.
func TestConformanceManifestListsEveryVector(t *testing.T) {
	m := loadManifest(t)
	for _, kind := range []struct {
		dir    string
		listed []string
	}{{"envelopes", m.Envelopes}, {"entries", m.Entries}, {"schemas", m.Schemas}, {"limits", m.Limits}} {
		files, _ := filepath.Glob(filepath.Join(conformanceDir(t), kind.dir, "*.json"))
		listed := map[string]bool{}
		for _, name := range kind.listed {
			listed[name] = true
		}
		for _, f := range files {
			if name := kind.dir + "/" + filepath.Base(f); !listed[name] {
				t.Errorf("%s is not in manifest.json", name)
			}
		}
	}
}

type schemaCase struct {
	Name       string          `json:"name"`
	Schema     json.RawMessage `json:"schema"`
	Payload    json.RawMessage `json:"payload"`
	Violations []struct {
		Field   string `json:"field"`
		Rule    string `json:"rule"`
		Keyword string `json:"keyword"`
	} `json:"violations"`
}

// Every schema vector: the violations' fields, rules and keywords, in order
// (messages may differ between languages).
func TestConformanceSchemas(t *testing.T) {
	m := loadManifest(t)
	if len(m.Schemas) == 0 {
		t.Fatal("the manifest lists no schema vectors")
	}
	for _, rel := range m.Schemas {
		var c schemaCase
		loadCase(t, rel, &c)
		t.Run(c.Name, func(t *testing.T) {
			schema, err := CompileSchema(c.Schema)
			if err != nil {
				t.Fatalf("compiling the schema: %v", err)
			}
			found, err := PayloadViolations(schema, c.Payload)
			if err != nil {
				t.Fatal(err)
			}
			got := make([]string, len(found))
			for i, v := range found {
				got[i] = v.Field + " " + v.Rule + " " + v.Keyword
			}
			want := make([]string, len(c.Violations))
			for i, v := range c.Violations {
				want[i] = v.Field + " " + v.Rule + " " + v.Keyword
			}
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("violations\n%v\nwant\n%v", got, want)
			}
		})
	}
}

type limitCase struct {
	Name  string          `json:"name"`
	Input json.RawMessage `json:"input"`
	Valid bool            `json:"valid"`
	Field string          `json:"field"`
	Rule  string          `json:"rule"`
}

// Every limit vector (docs/protocol.md section 19): the verdict, the field and
// rule of a refusal, and for a valid limit a canonical JSON that reads back the same.
func TestConformanceLimits(t *testing.T) {
	m := loadManifest(t)
	if len(m.Limits) == 0 {
		t.Fatal("the manifest lists no limit vectors")
	}
	for _, rel := range m.Limits {
		var c limitCase
		loadCase(t, rel, &c)
		t.Run(c.Name, func(t *testing.T) {
			limit, err := ParseTaskLimit(c.Input)
			if !c.Valid {
				var invalid *InvalidLimitError
				if !errors.As(err, &invalid) {
					t.Fatalf("accepted or refused without an *InvalidLimitError (%v), want %s [%s]", err, c.Field, c.Rule)
				}
				if invalid.Field != c.Field || invalid.Rule != c.Rule {
					t.Fatalf("refused as %s [%s], want %s [%s]", invalid.Field, invalid.Rule, c.Field, c.Rule)
				}
				return
			}
			if err != nil {
				t.Fatalf("refused a valid limit: %v", err)
			}
			again, err := ParseTaskLimit(limit.JSON())
			if err != nil || again != limit {
				t.Fatalf("%s reads back as %+v (%v), want %+v", limit.JSON(), again, err, limit)
			}
			var in, out map[string]any
			_ = json.Unmarshal(c.Input, &in)
			_ = json.Unmarshal(limit.JSON(), &out)
			if in["smooth"] == false {
				delete(in, "smooth") // false is the default: not written
			}
			if !reflect.DeepEqual(in, out) {
				t.Fatalf("written as %s, want the members of %s", limit.JSON(), c.Input)
			}
		})
	}
}
