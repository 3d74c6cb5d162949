package envelope

import (
	"bytes"
	"compress/gzip"
	"errors"
	"io"
	"strings"
	"testing"
	"time"
)

func TestParseTimestampKeepsOffsetAndInstant(t *testing.T) {
	cases := []struct {
		in, out string
		utc     time.Time
	}{
		{"2025-09-11T12:45:00+08:00", "2025-09-11T12:45:00+08:00", time.Date(2025, 9, 11, 4, 45, 0, 0, time.UTC)},
		{"2025-09-11T04:45:00Z", "2025-09-11T04:45:00Z", time.Date(2025, 9, 11, 4, 45, 0, 0, time.UTC)},
		{"2025-09-11t04:45:00z", "2025-09-11T04:45:00Z", time.Date(2025, 9, 11, 4, 45, 0, 0, time.UTC)},
		{"2025-09-11T04:45:00+00:00", "2025-09-11T04:45:00Z", time.Date(2025, 9, 11, 4, 45, 0, 0, time.UTC)},
		{"2025-09-11T04:45:00-00:00", "2025-09-11T04:45:00Z", time.Date(2025, 9, 11, 4, 45, 0, 0, time.UTC)},
		{"2025-09-11T07:15:00-05:30", "2025-09-11T07:15:00-05:30", time.Date(2025, 9, 11, 12, 45, 0, 0, time.UTC)},
		{"2025-09-11T12:45:00.5Z", "2025-09-11T12:45:00.500000Z", time.Date(2025, 9, 11, 12, 45, 0, 5e8, time.UTC)},
		{"2025-09-11T12:45:00.123456789+08:00", "2025-09-11T12:45:00.123456+08:00",
			time.Date(2025, 9, 11, 4, 45, 0, 123456000, time.UTC)},
		{"2024-02-29T00:00:00Z", "2024-02-29T00:00:00Z", time.Date(2024, 2, 29, 0, 0, 0, 0, time.UTC)},
		{"9999-12-31T23:59:59.999999Z", "9999-12-31T23:59:59.999999Z",
			time.Date(9999, 12, 31, 23, 59, 59, 999999000, time.UTC)},
	}
	for _, c := range cases {
		ts, err := ParseTimestamp(c.in)
		if err != nil {
			t.Errorf("%q: %v", c.in, err)
			continue
		}
		if got := ts.String(); got != c.out {
			t.Errorf("%q written as %q, want %q", c.in, got, c.out)
		}
		if !ts.Equal(c.utc) {
			t.Errorf("%q is %v, want %v", c.in, ts.UTC(), c.utc)
		}
	}
}

func TestParseTimestampRefusesNaiveAndNonRFC3339(t *testing.T) {
	cases := map[string]string{
		"2025-09-11T12:45:00":             "timezone_required",
		"2025-09-11T12:45:00.250":         "timezone_required",
		"2025-09-11 12:45:00":             "rfc3339",
		"2025-09-11 12:45:00+08:00":       "rfc3339",
		"2025-09-11":                      "rfc3339",
		"1757565900":                      "rfc3339",
		"1757565900000":                   "rfc3339",
		"2025-09-11T12:45:00+0800":        "rfc3339",
		"2025-09-11T12:45:00+08":          "rfc3339",
		"2025-09-11T12:45:00+24:00":       "rfc3339",
		"2025-09-11T12:45:00+05:60":       "rfc3339",
		"2025-02-30T12:45:00Z":            "rfc3339",
		"2025-02-29T12:45:00Z":            "rfc3339",
		"2025-13-11T12:45:00Z":            "rfc3339",
		"2025-09-11T24:00:00Z":            "rfc3339",
		"2016-12-31T23:59:60Z":            "rfc3339",
		"0000-01-01T00:00:00Z":            "rfc3339",
		"0001-01-01T00:30:00+01:00":       "rfc3339",
		"9999-12-31T23:30:00-01:00":       "rfc3339",
		"2025-09-11T12:45:00Z\n":          "rfc3339",
		"2025-09-11T12:45:00.Z":           "rfc3339",
		"2025-09-11T12:45:00.1234567891Z": "rfc3339",
		"":                                "rfc3339",
	}
	for in, rule := range cases {
		_, err := ParseTimestamp(in)
		var te *TimeError
		if !errors.As(err, &te) || te.Rule != rule {
			t.Errorf("%q: got %v, want rule %s", in, err, rule)
		}
	}
}

// identity is the part of a test body every Envelope must carry on the wire.
const identity = `"task_id":"t-1","trace_id":"tr-1"`

func TestTimeFieldsRefuseNumbers(t *testing.T) {
	for _, body := range []string{
		`{` + identity + `,"created_at":"2025-09-11T04:40:00Z","task_type":"a","schedule_time":1757565900}`,
		`{` + identity + `,"created_at":"2025-09-11T04:40:00Z","task_type":"a","schedule_time":1757565900000}`,
		`{` + identity + `,"created_at":"2025-09-11T04:40:00Z","task_type":"a","schedule_time":1757565900.25}`,
		`{` + identity + `,"task_type":"a","created_at":true}`,
	} {
		_, err := Parse([]byte(body), DefaultLimits)
		v := violationsOf(err)
		if len(v) != 1 || v[0].Rule != "type" {
			t.Errorf("%s: got %v, want rule type", body, err)
		}
	}
}

func TestReadersNeverInventTheIdentity(t *testing.T) {
	full := map[string]string{
		"task_id": `"t-1"`, "trace_id": `"tr-1"`, "created_at": `"2025-09-11T04:40:00Z"`,
	}
	for missing := range full {
		body := `{"task_type":"a"`
		for name, value := range full {
			if name != missing {
				body += `,"` + name + `":` + value
			}
		}
		body += "}"
		_, err := Parse([]byte(body), DefaultLimits)
		v := violationsOf(err)
		if len(v) != 1 || v[0].Field != missing || v[0].Rule != "required" {
			t.Errorf("%s: got %v, want %s [required]", body, err, missing)
		}
		_, err = DecodeEntry(map[string]string{"v": "1", "enc": "json", "body": body}, DefaultLimits)
		var me *MalformedEntry
		if !errors.As(err, &me) || me.Kind != ErrEnvelope {
			t.Errorf("%s: entry decoded (%v), want malformed", body, err)
		}
	}
	// The producer fills them in.
	e := New("a", nil)
	if e.TaskID == "" || e.TraceID == "" || e.CreatedAt.IsZero() {
		t.Fatalf("New left the identity out: %s", e.JSON())
	}
	if _, err := Parse(e.JSON(), DefaultLimits); err != nil {
		t.Fatal(err)
	}
}

func TestNewTimestampRoundsToWholeMinuteOffsets(t *testing.T) {
	odd := time.Date(2025, 1, 1, 0, 0, 0, 1500, time.FixedZone("", 5*3600+30*60+7))
	if got := NewTimestamp(odd).String(); got != "2024-12-31T18:29:53.000001Z" {
		t.Fatalf("got %s", got)
	}
	plus8 := time.Date(2025, 9, 11, 12, 45, 0, 0, time.FixedZone("CST", 8*3600))
	if got := NewTimestamp(plus8).String(); got != "2025-09-11T12:45:00+08:00" {
		t.Fatalf("got %s", got)
	}
}

func TestBucketFor(t *testing.T) {
	cases := map[int]Bucket{0: Low, 84: Low, 85: Normal, 100: Normal, 169: Normal, 170: High, 255: High}
	for priority, want := range cases {
		if got := BucketFor(priority); got != want {
			t.Errorf("priority %d: %s, want %s", priority, got, want)
		}
	}
}

func TestKeyLayout(t *testing.T) {
	k := KeySpace{"envelope"}
	q := k.Queue("orders")
	got := []string{q.Stream(High), q.Stream(Normal), q.Stream(Low), q.Delayed(), q.DelayedData(),
		q.Dead(), k.Cancelled(), k.Queues(), k.Consumer("c1"), k.Idempotency("order.close_timeout", "42"),
		k.Retrying("order.close_timeout"), k.Wakeup(), q.Order("order:42"), q.OrderWaiting("order:42"),
		q.OrderAdvanced(), q.OrderHeld(), q.OrderPolicy(), q.OrderHalted()}
	want := []string{"envelope:{orders}:high", "envelope:{orders}:normal", "envelope:{orders}:low",
		"envelope:{orders}:delayed", "envelope:{orders}:delayed:data", "envelope:{orders}:dead",
		"envelope:cancelled", "envelope:queues", "envelope:consumer:c1",
		"envelope:idem:order.close_timeout:42", "envelope:retrying:order.close_timeout", "envelope:wakeup",
		"envelope:{orders}:order:order:42", "envelope:{orders}:order-waiting:order:42",
		"envelope:{orders}:order-advanced", "envelope:{orders}:order-held", "envelope:{orders}:order-policy",
		"envelope:{orders}:order-halted"}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("got %s, want %s", got[i], want[i])
		}
	}
	for _, bad := range []string{"", "a{b", "a}b"} {
		if CheckQueueName(bad) == nil {
			t.Errorf("queue name %q accepted", bad)
		}
	}
}

func TestBackoffDelay(t *testing.T) {
	p := RetryPolicy{FastRetries: 2, Backoff: 30 * time.Second, MaxBackoff: time.Hour,
		Jitter: func() float64 { return 1 }}
	cases := []struct {
		next int64
		fast int
		want time.Duration
	}{
		{1, 0, 30 * time.Second},
		{2, 0, 60 * time.Second},
		{3, 0, 120 * time.Second},
		{3, 2, 30 * time.Second}, // two fast retries taken: the backoff tier starts over
		{4, 2, 60 * time.Second},
		{8, 0, time.Hour}, // 30 s × 2^7 = 64 min, capped
		{1000, 0, time.Hour},
		{1, 5, 30 * time.Second}, // an inconsistent header never gives a shorter delay
	}
	for _, c := range cases {
		if got := p.BackoffDelay(c.next, c.fast); got != c.want {
			t.Errorf("BackoffDelay(%d, %d) = %v, want %v", c.next, c.fast, got, c.want)
		}
	}
	// The jitter factor is applied before the cap: a capped delay is exactly
	// max_backoff, and a delay just above the cap may be jittered below it.
	p.Jitter = func() float64 { return 1.2 }
	if got := p.BackoffDelay(20, 0); got != time.Hour {
		t.Errorf("capped delay with jitter 1.2: %v, want exactly 1 h", got)
	}
	p.Jitter = func() float64 { return 0.8 }
	if got := p.BackoffDelay(8, 0); got != 3072*time.Second { // 30 s × 2^7 × 0.8 = 51.2 min
		t.Errorf("BackoffDelay(8, 0) with jitter 0.8: %v, want 51m12s", got)
	}
	p.Jitter = nil
	for i := 0; i < 1000; i++ {
		if d := p.BackoffDelay(30, 0); d > time.Hour {
			t.Fatalf("jittered delay %v above the cap", d)
		}
		d := p.BackoffDelay(2, 0)
		if d < 48*time.Second || d > 72*time.Second {
			t.Fatalf("jittered delay %v outside [0.8, 1.2] × 60 s", d)
		}
	}
}

func TestRetryDecisions(t *testing.T) {
	p := RetryPolicy{FastRetries: 2, Backoff: 200 * time.Millisecond, MaxBackoff: time.Second,
		Jitter: func() float64 { return 1 }}
	three := int64(3)
	e := tiered(New("a", nil))
	e.MaxRetries = &three

	// Transient: two fast retries, then the backoff tier.
	d := p.Decide(e, KindTransient)
	if d.Action != RetryNow || d.Next != 1 || d.FastRetries != 1 {
		t.Fatalf("first transient failure: %+v", d)
	}
	e = NextAttempt(e, d, time.Now())
	if e.Headers[HeaderFastRetries] != "1" || e.RetryCount != 1 {
		t.Fatalf("next attempt: %s", e.JSON())
	}
	if e.ScheduleTime != nil {
		t.Fatalf("a delay-0 retry carries schedule_time: %s", e.JSON())
	}
	// A timeout skips the fast tier.
	if d := p.Decide(e, KindTimeout); d.Action != RetryLater || d.FastRetries != 1 || d.Delay != 200*time.Millisecond {
		t.Fatalf("timeout: %+v", d)
	}
	d = p.Decide(e, KindTransient)
	if d.Action != RetryNow || d.FastRetries != 2 {
		t.Fatalf("second transient failure: %+v", d)
	}
	e = NextAttempt(e, d, time.Now())
	d = p.Decide(e, KindTransient)
	if d.Action != RetryLater || d.Next != 3 || d.Delay != 200*time.Millisecond {
		t.Fatalf("third transient failure: %+v", d)
	}
	e = NextAttempt(e, d, time.Now())
	if e.ScheduleTime == nil || e.RetryCount != 3 {
		t.Fatalf("delayed attempt: %s", e.JSON())
	}
	if d = p.Decide(e, KindTransient); d.Action != DeadLetter || d.Class != ClassTransientExhausted {
		t.Fatalf("exhausted: %+v", d)
	}
	if d = p.Decide(e, KindTimeout); d.Class != ClassTimeout {
		t.Fatalf("exhausted by timeouts: %+v", d)
	}
	if d = p.Decide(e, KindTaskError); d.Class != ClassTaskError {
		t.Fatalf("exhausted by errors: %+v", d)
	}

	// Other errors skip the fast tier.
	f := tiered(New("a", nil))
	if d = p.Decide(f, KindTaskError); d.Action != RetryLater || d.Delay != 200*time.Millisecond {
		t.Fatalf("task error: %+v", d)
	}
	// max_retries 0: the first failure is final; null: never final.
	zero := int64(0)
	f.MaxRetries = &zero
	if d = p.Decide(f, KindTaskError); d.Action != DeadLetter {
		t.Fatalf("max_retries 0: %+v", d)
	}
	f.MaxRetries, f.RetryCount = nil, 1_000_000
	if d = p.Decide(f, KindTaskError); d.Action != RetryLater || d.Delay != time.Second {
		t.Fatalf("unlimited: %+v", d)
	}
}

// tiered is e asking for automatic retries.
func tiered(e *Envelope) *Envelope {
	e.Headers[HeaderRetryPolicy] = PolicyTiered
	return e
}

func TestWithoutTheTieredPolicyAFailureIsFinal(t *testing.T) {
	p := DefaultRetryPolicy
	unlimited := New("a", nil)
	unlimited.MaxRetries = nil // max_retries caps retries; it never asks for them
	for _, kind := range []ErrorKind{KindTransient, KindTaskError} {
		if d := p.Decide(unlimited, kind); d.Action != DeadLetter || d.Class != ClassTaskError || d.Next != 1 {
			t.Fatalf("kind %v without x-retry-policy: %+v", kind, d)
		}
	}
	if d := p.Decide(unlimited, KindTimeout); d.Action != DeadLetter || d.Class != ClassTimeout {
		t.Fatalf("timeout without x-retry-policy: %+v", d)
	}
	other := New("a", nil)
	other.Headers[HeaderRetryPolicy] = "something-else"
	if d := p.Decide(other, KindTransient); d.Action != DeadLetter {
		t.Fatalf("an unknown policy: %+v", d)
	}
}

func TestDefaultIsTransient(t *testing.T) {
	if !DefaultIsTransient(Transient(errors.New("x"))) || !DefaultIsTransient(ErrTransient) {
		t.Fatal("marked errors are transient")
	}
	if DefaultIsTransient(errors.New("x")) || DefaultIsTransient(InvalidPayload(errors.New("x"))) {
		t.Fatal("plain errors are not transient")
	}
}

func TestEncodeDecodeRoundTrip(t *testing.T) {
	e := New("reports.render", []byte(`{"report":"weekly","blob":"`+strings.Repeat("x", 9000)+`"}`))
	idem := "order-1"
	e.IdempotencyKey = &idem
	e.Headers["traceparent"] = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	e.Ext = []ExtEntry{{"celery", []byte(`{"root_id":null}`)}}
	fields, err := EncodeEntry(e, GzipMinBytes, DefaultLimits)
	if err != nil {
		t.Fatal(err)
	}
	if fields[3] != EncJSONGzip {
		t.Fatalf("a %d-byte body is not compressed", len(e.JSON()))
	}
	r, err := gzip.NewReader(strings.NewReader(fields[5]))
	if err != nil {
		t.Fatal(err)
	}
	plain, _ := io.ReadAll(r)
	if !bytes.Equal(plain, e.JSON()) {
		t.Fatal("gzip body does not inflate to the Envelope")
	}
	got, err := DecodeEntry(map[string]string{"v": fields[1], "enc": fields[3], "body": fields[5], "n": "1"}, DefaultLimits)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got.JSON(), e.JSON()) {
		t.Fatalf("round trip changed the Envelope:\n%s\n%s", e.JSON(), got.JSON())
	}
	small := New("a", nil)
	if fields, _ := EncodeEntry(small, GzipMinBytes, DefaultLimits); fields[3] != EncJSON {
		t.Fatal("a small body is compressed")
	}
	keyed := e.Clone()
	key := "order:1"
	keyed.OrderingKey = &key
	fields, err = EncodeEntry(keyed, GzipMinBytes, DefaultLimits)
	if err != nil || fields[3] != EncJSON || fields[5] != string(keyed.JSON()) {
		t.Fatalf("a %d-byte keyed body is compressed (the scripts read its key): %v %v", len(keyed.JSON()), fields[3], err)
	}
	got, err = DecodeEntry(map[string]string{"v": fields[1], "enc": fields[3], "body": fields[5]}, DefaultLimits)
	if err != nil || got.OrderingKey == nil || *got.OrderingKey != key || got.Clone().OrderingKey == got.OrderingKey {
		t.Fatalf("the ordering_key did not round-trip (or Clone shares it): %v", err)
	}
}

func TestEnvelopeBuiltInGoValidates(t *testing.T) {
	e := New("order.close_timeout", []byte(`{"order_id":"202509110001"}`))
	if err := e.Validate(DefaultLimits); err != nil {
		t.Fatal(err)
	}
	e.Priority = 256
	err := e.Validate(DefaultLimits)
	if v := violationsOf(err); len(v) != 1 || v[0].Field != "priority" || v[0].Rule != "range" {
		t.Fatalf("got %v", err)
	}
	e.Priority = 100
	far := NewTimestamp(time.Now().Add(91 * 24 * time.Hour))
	e.ScheduleTime = &far
	if err := e.Validate(DefaultLimits); err != nil {
		t.Fatalf("max_delay is a publish-time rule only: %v", err)
	}
	v := violationsOf(CheckPublishable(e, DefaultLimits, time.Now()))
	if len(v) != 1 || v[0].Rule != "max_delay" {
		t.Fatalf("got %v", v)
	}
}

func TestParseJSONKeepsOrderAndRefusesBadText(t *testing.T) {
	v, err := ParseJSON([]byte(` {"b": 1, "a": [true, null, "\u00e9\n"], "b": -0, "c": 1.50} `))
	if err != nil {
		t.Fatal(err)
	}
	if got := string(AppendCanonical(nil, v)); got != `{"b":0,"a":[true,null,"é\n"],"c":1.50}` {
		t.Fatalf("canonical form %s", got)
	}
	for _, bad := range []string{``, `{`, `{"a":1,}`, `[1 2]`, `01`, `1.`, `"\ud800"`, `"\x"`, "\"\x01\"",
		`{"a":1} x`, "\xff", `NaN`, `Infinity`} {
		if _, err := ParseJSON([]byte(bad)); err == nil {
			t.Errorf("%q parsed", bad)
		}
	}
}
