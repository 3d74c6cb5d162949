package envelope

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
)

// Stream entry fields and values (docs/protocol.md section 3).
const (
	WireVersion    = "1"
	EncJSON        = "json"
	EncJSONGzip    = "json+gzip"
	FieldVersion   = "v"
	FieldEncoding  = "enc"
	FieldBody      = "body"
	FieldRedeliver = "n"

	// GzipMinBytes: bodies of at least this many bytes are compressed by default.
	GzipMinBytes = 8192
	// BodyOverheadBytes is the room for the fields other than payload in a body.
	BodyOverheadBytes = 256 * 1024
)

// Why an entry is malformed: the error names of the conformance entry vectors.
const (
	ErrMissingField = "missing_field"
	ErrVersion      = "version"
	ErrEncoding     = "encoding"
	ErrGzip         = "gzip"
	ErrTooLarge     = "too_large"
	ErrEnvelope     = "envelope"
)

// MalformedEntry is a stream entry that cannot be decoded into a valid Envelope.
// Kind is one of the Err* names; Violations is set when Kind is ErrEnvelope.
type MalformedEntry struct {
	Kind       string
	Reason     string
	Violations []Violation
}

func (e *MalformedEntry) Error() string { return e.Reason }

func malformed(kind, format string, args ...any) *MalformedEntry {
	return &MalformedEntry{Kind: kind, Reason: fmt.Sprintf(format, args...)}
}

// MaxBodyBytes is the largest body (uncompressed JSON) written or read.
func MaxBodyBytes(limits Limits) int { return limits.MaxPayloadBytes + BodyOverheadBytes }

// EncodeBody returns (enc, body) for e, gzip-compressed when its JSON has at
// least gzipMin bytes (gzipMin <= 0: never), except for an Envelope with an
// ordering_key, always plain JSON: the scripts read the key from the body
// (docs/protocol.md section 20). An Envelope whose JSON exceeds MaxBodyBytes
// is refused.
func EncodeBody(e *Envelope, gzipMin int, limits Limits) (string, []byte, error) {
	body := e.JSON()
	if limit := MaxBodyBytes(limits); len(body) > limit {
		return "", nil, &ValidationError{[]Violation{{"envelope", "max_bytes",
			fmt.Sprintf("the Envelope is %d bytes of JSON, above the limit of %d", len(body), limit)}}}
	}
	if gzipMin <= 0 || len(body) < gzipMin || e.OrderingKey != nil {
		return EncJSON, body, nil
	}
	var buf bytes.Buffer
	w, _ := gzip.NewWriterLevel(&buf, 6)
	if _, err := w.Write(body); err != nil {
		return "", nil, err
	}
	if err := w.Close(); err != nil {
		return "", nil, err
	}
	return EncJSONGzip, buf.Bytes(), nil
}

// EncodeEntry returns the fields of the stream entry that stores e, in order.
func EncodeEntry(e *Envelope, gzipMin int, limits Limits) ([]string, error) {
	enc, body, err := EncodeBody(e, gzipMin, limits)
	if err != nil {
		return nil, err
	}
	return []string{FieldVersion, WireVersion, FieldEncoding, enc, FieldBody, string(body)}, nil
}

// DecodeEntry decodes stream entry fields into an Envelope. Any input yields
// either an Envelope or a *MalformedEntry. Fields it does not know are ignored.
func DecodeEntry(fields map[string]string, limits Limits) (*Envelope, error) {
	version, ok := fields[FieldVersion]
	if !ok {
		return nil, malformed(ErrMissingField, "missing field 'v'")
	}
	if version != WireVersion {
		return nil, malformed(ErrVersion, "unsupported wire version %q", version)
	}
	enc, ok := fields[FieldEncoding]
	if !ok {
		return nil, malformed(ErrMissingField, "missing field 'enc'")
	}
	body, ok := fields[FieldBody]
	if !ok {
		return nil, malformed(ErrMissingField, "missing field 'body'")
	}
	return DecodeBody(enc, []byte(body), limits)
}

// DecodeBody decodes a body written with encoding enc.
func DecodeBody(enc string, body []byte, limits Limits) (*Envelope, error) {
	limit := MaxBodyBytes(limits)
	switch enc {
	case EncJSONGzip:
		inflated, err := inflate(body, limit)
		if err != nil {
			return nil, err
		}
		body = inflated
	case EncJSON:
		if len(body) > limit {
			return nil, malformed(ErrTooLarge, "body too large: %d bytes, above the limit of %d", len(body), limit)
		}
	default:
		return nil, malformed(ErrEncoding, "unknown encoding %q", enc)
	}
	e, err := Parse(body, limits)
	if err != nil {
		var ve *ValidationError
		errors.As(err, &ve)
		return nil, &MalformedEntry{Kind: ErrEnvelope, Reason: err.Error(), Violations: ve.Violations}
	}
	return e, nil
}

// inflate decompresses exactly one gzip member of at most limit bytes.
func inflate(body []byte, limit int) ([]byte, error) {
	src := bytes.NewReader(body) // an io.ByteReader: the inflater never reads past the member
	r, err := gzip.NewReader(src)
	if err != nil {
		return nil, malformed(ErrGzip, "body is not valid gzip: %v", err)
	}
	r.Multistream(false)
	data, err := io.ReadAll(io.LimitReader(r, int64(limit)+1))
	if len(data) > limit {
		return nil, malformed(ErrTooLarge, "body too large: gzip body inflates beyond %d bytes", limit)
	}
	if err != nil {
		return nil, malformed(ErrGzip, "body is not valid gzip: %v", err)
	}
	if src.Len() > 0 {
		return nil, malformed(ErrGzip, "body is not valid gzip: %d bytes after the end of the gzip stream", src.Len())
	}
	return data, nil
}
