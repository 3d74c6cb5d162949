package envelope

import (
	"context"
	"strings"
	"testing"
	"time"
)

func TestExpiresIsKeptAsWrittenAndComparedAsAnInstant(t *testing.T) {
	in := `{"task_id":"t1","task_type":"jobs.run","trace_id":"tr","created_at":"2025-09-11T04:40:00Z",` +
		`"expires":"2025-09-11T12:45:00.5+08:00"}`
	e, err := Parse([]byte(in), DefaultLimits)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(e.JSON()), `"payload":{},"expires":"2025-09-11T12:45:00.500000+08:00","max_retries":3`) {
		t.Fatalf("written %s", e.JSON())
	}
	at := time.Date(2025, 9, 11, 4, 45, 0, 500_000_000, time.UTC) // the same instant
	if !e.IsExpired(at) || e.IsExpired(at.Add(-time.Microsecond)) {
		t.Fatal("expires is at or before now: expired")
	}
	if c := e.Clone(); c.Expires == e.Expires || c.Expires.String() != e.Expires.String() {
		t.Fatal("Clone shares or loses expires")
	}
	never := New("jobs.run", nil)
	if never.IsExpired(time.Now().Add(1000*time.Hour)) || strings.Contains(string(never.JSON()), "expires") {
		t.Fatal("an Envelope without expires expires, or writes it")
	}
}

func TestPublishOptionsSetExpires(t *testing.T) {
	at := time.Date(2030, 1, 2, 3, 4, 5, 0, time.FixedZone("", 8*3600))
	e, err := NewTask(context.Background(), "jobs.run", nil, WithExpires(at))
	if err != nil {
		t.Fatal(err)
	}
	if e.Expires.String() != "2030-01-02T03:04:05+08:00" {
		t.Fatalf("WithExpires wrote %s", e.Expires)
	}
	before := time.Now()
	e, err = NewTask(context.Background(), "jobs.run", nil, WithExpiresIn(time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	if d := e.Expires.Sub(before); d < time.Minute-time.Millisecond || d > time.Minute+5*time.Second {
		t.Fatalf("WithExpiresIn(1m) wrote %s, %s after now", e.Expires, d)
	}
	if err := e.Validate(DefaultLimits); err != nil {
		t.Fatal(err)
	}
}
