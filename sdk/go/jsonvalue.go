package envelope

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// Kind is the JSON type of a Value.
type Kind int

// JSON types.
const (
	Null Kind = iota
	Bool
	Number
	String
	Array
	Object
)

func (k Kind) String() string {
	return [...]string{"null", "boolean", "number", "string", "array", "object"}[k]
}

// Value is a parsed JSON value that keeps what encoding/json loses: the order
// of object members and the exact text of numbers.
type Value struct {
	Kind    Kind
	Bool    bool
	Text    string // a string's decoded text, or a number's literal text
	Items   []*Value
	Members []Member
}

// Member is one name/value pair of an object.
type Member struct {
	Key   string
	Value *Value
}

// Get returns the member named key (nil when absent).
func (v *Value) Get(key string) *Value {
	for i := range v.Members {
		if v.Members[i].Key == key {
			return v.Members[i].Value
		}
	}
	return nil
}

// IsInteger reports whether a number is written without fraction or exponent.
func (v *Value) IsInteger() bool {
	return v.Kind == Number && !strings.ContainsAny(v.Text, ".eE")
}

// maxParseDepth bounds nesting while parsing, so hostile input cannot exhaust the stack.
const maxParseDepth = 512

var errJSON = errors.New("invalid JSON")

// ParseJSON parses one JSON text (RFC 8259, UTF-8, nothing after the value).
// A lone UTF-16 surrogate escape ("\ud800"), which UTF-8 cannot carry, is an
// error. Duplicate object names keep the first position and the last value,
// as most JSON readers do.
func ParseJSON(data []byte) (*Value, error) {
	if !utf8.Valid(data) {
		return nil, fmt.Errorf("%w: not UTF-8", errJSON)
	}
	p := parser{data: data}
	p.space()
	v, err := p.value(0)
	if err != nil {
		return nil, err
	}
	p.space()
	if p.pos != len(p.data) {
		return nil, p.fail("data after the JSON value")
	}
	return v, nil
}

type parser struct {
	data []byte
	pos  int
}

func (p *parser) fail(what string) error {
	return fmt.Errorf("%w at byte %d: %s", errJSON, p.pos, what)
}

func (p *parser) space() {
	for p.pos < len(p.data) {
		switch p.data[p.pos] {
		case ' ', '\t', '\n', '\r':
			p.pos++
		default:
			return
		}
	}
}

func (p *parser) literal(word string) bool {
	if strings.HasPrefix(string(p.data[p.pos:min(len(p.data), p.pos+len(word))]), word) {
		p.pos += len(word)
		return true
	}
	return false
}

func (p *parser) value(depth int) (*Value, error) {
	if depth > maxParseDepth {
		return nil, p.fail("nested too deeply")
	}
	if p.pos >= len(p.data) {
		return nil, p.fail("unexpected end")
	}
	switch c := p.data[p.pos]; {
	case c == '{':
		return p.object(depth)
	case c == '[':
		return p.array(depth)
	case c == '"':
		text, err := p.str()
		if err != nil {
			return nil, err
		}
		return &Value{Kind: String, Text: text}, nil
	case c == 't' && p.literal("true"):
		return &Value{Kind: Bool, Bool: true}, nil
	case c == 'f' && p.literal("false"):
		return &Value{Kind: Bool}, nil
	case c == 'n' && p.literal("null"):
		return &Value{Kind: Null}, nil
	case c == '-' || (c >= '0' && c <= '9'):
		return p.number()
	}
	return nil, p.fail("unexpected character")
}

func (p *parser) object(depth int) (*Value, error) {
	p.pos++ // {
	v := &Value{Kind: Object}
	index := map[string]int{}
	p.space()
	if p.pos < len(p.data) && p.data[p.pos] == '}' {
		p.pos++
		return v, nil
	}
	for {
		p.space()
		if p.pos >= len(p.data) || p.data[p.pos] != '"' {
			return nil, p.fail("expected a member name")
		}
		key, err := p.str()
		if err != nil {
			return nil, err
		}
		p.space()
		if p.pos >= len(p.data) || p.data[p.pos] != ':' {
			return nil, p.fail("expected ':'")
		}
		p.pos++
		p.space()
		item, err := p.value(depth + 1)
		if err != nil {
			return nil, err
		}
		if at, seen := index[key]; seen {
			v.Members[at].Value = item
		} else {
			index[key] = len(v.Members)
			v.Members = append(v.Members, Member{Key: key, Value: item})
		}
		p.space()
		if p.pos >= len(p.data) {
			return nil, p.fail("unterminated object")
		}
		switch p.data[p.pos] {
		case ',':
			p.pos++
		case '}':
			p.pos++
			return v, nil
		default:
			return nil, p.fail("expected ',' or '}'")
		}
	}
}

func (p *parser) array(depth int) (*Value, error) {
	p.pos++ // [
	v := &Value{Kind: Array, Items: []*Value{}}
	p.space()
	if p.pos < len(p.data) && p.data[p.pos] == ']' {
		p.pos++
		return v, nil
	}
	for {
		p.space()
		item, err := p.value(depth + 1)
		if err != nil {
			return nil, err
		}
		v.Items = append(v.Items, item)
		p.space()
		if p.pos >= len(p.data) {
			return nil, p.fail("unterminated array")
		}
		switch p.data[p.pos] {
		case ',':
			p.pos++
		case ']':
			p.pos++
			return v, nil
		default:
			return nil, p.fail("expected ',' or ']'")
		}
	}
}

func (p *parser) number() (*Value, error) {
	start := p.pos
	digits := func() int {
		n := 0
		for p.pos < len(p.data) && p.data[p.pos] >= '0' && p.data[p.pos] <= '9' {
			p.pos++
			n++
		}
		return n
	}
	if p.data[p.pos] == '-' {
		p.pos++
	}
	if p.pos < len(p.data) && p.data[p.pos] == '0' {
		p.pos++
	} else if digits() == 0 {
		return nil, p.fail("bad number")
	}
	if p.pos < len(p.data) && p.data[p.pos] == '.' {
		p.pos++
		if digits() == 0 {
			return nil, p.fail("bad number fraction")
		}
	}
	if p.pos < len(p.data) && (p.data[p.pos] == 'e' || p.data[p.pos] == 'E') {
		p.pos++
		if p.pos < len(p.data) && (p.data[p.pos] == '+' || p.data[p.pos] == '-') {
			p.pos++
		}
		if digits() == 0 {
			return nil, p.fail("bad number exponent")
		}
	}
	return &Value{Kind: Number, Text: string(p.data[start:p.pos])}, nil
}

func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	n, err := strconv.ParseUint(string(b[:4]), 16, 32)
	return rune(n), err == nil
}

// str reads a string token.
func (p *parser) str() (string, error) {
	p.pos++ // opening quote
	var sb strings.Builder
	for {
		if p.pos >= len(p.data) {
			return "", p.fail("unterminated string")
		}
		c := p.data[p.pos]
		switch {
		case c == '"':
			p.pos++
			return sb.String(), nil
		case c < 0x20:
			return "", p.fail("control character in string")
		case c != '\\':
			sb.WriteByte(c)
			p.pos++
			continue
		}
		p.pos++ // backslash
		if p.pos >= len(p.data) {
			return "", p.fail("unterminated escape")
		}
		e := p.data[p.pos]
		p.pos++
		switch e {
		case '"', '\\', '/':
			sb.WriteByte(e)
		case 'b':
			sb.WriteByte('\b')
		case 'f':
			sb.WriteByte('\f')
		case 'n':
			sb.WriteByte('\n')
		case 'r':
			sb.WriteByte('\r')
		case 't':
			sb.WriteByte('\t')
		case 'u':
			r, ok := hex4(p.data[p.pos:])
			if !ok {
				return "", p.fail("bad \\u escape")
			}
			p.pos += 4
			if utf16.IsSurrogate(r) {
				if r < 0xdc00 && p.pos+6 <= len(p.data) && p.data[p.pos] == '\\' && p.data[p.pos+1] == 'u' {
					if low, ok := hex4(p.data[p.pos+2:]); ok && low >= 0xdc00 && low <= 0xdfff {
						p.pos += 6
						sb.WriteRune(utf16.DecodeRune(r, low))
						continue
					}
				}
				return "", p.fail("lone UTF-16 surrogate escape")
			}
			sb.WriteRune(r)
		default:
			return "", p.fail("bad escape")
		}
	}
}

// AppendCanonical appends the compact JSON of v: no whitespace, members in
// order, strings with the minimal escapes (", \ and control characters), every
// other character as UTF-8, integers without a sign on zero and other numbers
// as written. This is the form whose length the payload limit measures.
func AppendCanonical(dst []byte, v *Value) []byte {
	switch v.Kind {
	case Null:
		return append(dst, "null"...)
	case Bool:
		if v.Bool {
			return append(dst, "true"...)
		}
		return append(dst, "false"...)
	case Number:
		if v.IsInteger() && strings.TrimLeft(v.Text, "-0") == "" {
			return append(dst, '0')
		}
		return append(dst, v.Text...)
	case String:
		return AppendString(dst, v.Text)
	case Array:
		dst = append(dst, '[')
		for i, item := range v.Items {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = AppendCanonical(dst, item)
		}
		return append(dst, ']')
	default:
		dst = append(dst, '{')
		for i, m := range v.Members {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = AppendString(dst, m.Key)
			dst = append(dst, ':')
			dst = AppendCanonical(dst, m.Value)
		}
		return append(dst, '}')
	}
}

// AppendString appends s as a JSON string with the minimal escapes.
func AppendString(dst []byte, s string) []byte {
	const hexDigits = "0123456789abcdef"
	dst = append(dst, '"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch c {
		case '"':
			dst = append(dst, '\\', '"')
		case '\\':
			dst = append(dst, '\\', '\\')
		case '\b':
			dst = append(dst, '\\', 'b')
		case '\f':
			dst = append(dst, '\\', 'f')
		case '\n':
			dst = append(dst, '\\', 'n')
		case '\r':
			dst = append(dst, '\\', 'r')
		case '\t':
			dst = append(dst, '\\', 't')
		default:
			if c < 0x20 {
				dst = append(dst, '\\', 'u', '0', '0', hexDigits[c>>4], hexDigits[c&0xf])
			} else {
				dst = append(dst, c)
			}
		}
	}
	return append(dst, '"')
}
