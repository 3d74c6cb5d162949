package envelope

import (
	"fmt"
	"regexp"
	"strconv"
	"time"
)

// Timestamp is an instant together with the UTC offset it was written in.
// The offset is kept when the Envelope is written again; comparisons use the instant.
type Timestamp struct {
	time.Time
}

var (
	// RFC 3339 date-time with a mandatory offset (Z or ±hh:mm), at most 9 fraction digits.
	rfc3339Re = regexp.MustCompile(
		`^([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?([Zz]|[+-][0-9]{2}:[0-9]{2})$`)
	// What a date-time looks like when its offset is missing.
	rfc3339LocalRe = regexp.MustCompile(
		`^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?$`)

	minInstant = time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC)
	maxInstant = time.Date(9999, 12, 31, 23, 59, 59, 999999999, time.UTC)
)

// TimeError is a time field that breaks rule "rfc3339" or "timezone_required".
type TimeError struct {
	Rule    string
	Message string
}

func (e *TimeError) Error() string { return e.Message + " [" + e.Rule + "]" }

func timeErr(rule, format string, args ...any) *TimeError {
	return &TimeError{Rule: rule, Message: fmt.Sprintf(format, args...)}
}

// ParseTimestamp parses an RFC 3339 string that carries an explicit offset
// (Z or ±hh:mm), e.g. "2025-09-11T12:45:00+08:00". Strings without an offset
// fail rule "timezone_required"; anything else that is not such a string
// (dates only, space separators, offsets without a colon, invalid dates,
// leap seconds, instants outside years 0001-9999 in UTC) fails rule
// "rfc3339". Fractions finer than a microsecond are truncated, so every
// language writes the same text back. Numbers never reach this function: a
// JSON number in a time field fails rule "type" before.
func ParseTimestamp(text string) (Timestamp, error) {
	m := rfc3339Re.FindStringSubmatch(text)
	if m == nil {
		if rfc3339LocalRe.MatchString(text) {
			return Timestamp{}, timeErr("timezone_required",
				"no timezone offset: add Z or ±hh:mm, e.g. 2025-09-11T12:45:00+08:00")
		}
		return Timestamp{}, timeErr("rfc3339",
			"must be RFC 3339 with an explicit offset, e.g. 2025-09-11T12:45:00+08:00")
	}
	num := func(s string) int { n, _ := strconv.Atoi(s); return n }
	year, month, day := num(m[1]), num(m[2]), num(m[3])
	hour, minute, second := num(m[4]), num(m[5]), num(m[6])
	micros := 0
	if frac := m[7]; frac != "" {
		for len(frac) < 6 {
			frac += "0"
		}
		micros = num(frac[:6])
	}
	offset := 0
	if o := m[8]; o != "Z" && o != "z" {
		oh, om := num(o[1:3]), num(o[4:6])
		if oh > 23 || om > 59 {
			return Timestamp{}, timeErr("rfc3339", "offset %s is not ±00:00 to ±23:59", o)
		}
		offset = oh*3600 + om*60
		if o[0] == '-' {
			offset = -offset
		}
	}
	if year < 1 || month < 1 || month > 12 || day < 1 || day > daysIn(year, month) ||
		hour > 23 || minute > 59 || second > 59 {
		return Timestamp{}, timeErr("rfc3339", "not a valid date, time or offset")
	}
	zone := time.UTC
	if offset != 0 {
		zone = time.FixedZone("", offset)
	}
	t := time.Date(year, time.Month(month), day, hour, minute, second, micros*1000, zone)
	if t.Before(minInstant) || t.After(maxInstant) {
		return Timestamp{}, timeErr("rfc3339", "outside the years 0001-9999 once converted to UTC")
	}
	return Timestamp{t}, nil
}

func daysIn(year, month int) int {
	switch month {
	case 2:
		if year%4 == 0 && (year%100 != 0 || year%400 == 0) {
			return 29
		}
		return 28
	case 4, 6, 9, 11:
		return 30
	}
	return 31
}

// NewTimestamp keeps t's instant (to the microsecond) and its offset, rounded
// to whole minutes as RFC 3339 requires (otherwise t is written in UTC).
func NewTimestamp(t time.Time) Timestamp {
	t = t.Truncate(time.Microsecond).Round(0)
	if _, offset := t.Zone(); offset%60 != 0 {
		t = t.UTC()
	} else if offset == 0 {
		t = t.UTC()
	} else {
		t = t.In(time.FixedZone("", offset))
	}
	return Timestamp{t}
}

// Now is the current time in UTC, as a Timestamp.
func Now() Timestamp { return NewTimestamp(time.Now()) }

// String writes the timestamp as RFC 3339 keeping its offset: UTC is written
// "Z", microseconds appear only when not zero (2025-09-11T12:45:00.25+08:00).
func (t Timestamp) String() string {
	b := make([]byte, 0, 32)
	b = t.Time.AppendFormat(b, "2006-01-02T15:04:05")
	if us := t.Nanosecond() / 1000; us != 0 {
		b = append(b, fmt.Sprintf(".%06d", us)...)
	}
	_, offset := t.Zone()
	if offset == 0 {
		return string(append(b, 'Z'))
	}
	sign := byte('+')
	if offset < 0 {
		sign, offset = '-', -offset
	}
	return string(append(b, fmt.Sprintf("%c%02d:%02d", sign, offset/3600, offset/60%60)...))
}

// UnixMilli is the instant in whole milliseconds since the Unix epoch (floored).
func (t Timestamp) UnixMilli() int64 {
	return t.Time.UnixMilli()
}
