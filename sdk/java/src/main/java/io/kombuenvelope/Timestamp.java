package io.kombuenvelope;

import java.time.Instant;
import java.time.OffsetDateTime;
import java.time.ZoneOffset;
import java.time.temporal.ChronoUnit;
import java.util.Objects;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

/**
 * An instant with the UTC offset it was written in (docs/protocol.md section 1.1). The offset is
 * kept when the Envelope is written again; {@link #compareTo} compares instants.
 */
public final class Timestamp implements Comparable<Timestamp> {
    private static final Pattern RFC3339 = Pattern.compile(
            "([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\\.([0-9]{1,9}))?([Zz]|[+-][0-9]{2}:[0-9]{2})");
    private static final Pattern LOCAL = Pattern.compile(
            "[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\\.[0-9]{1,9})?");
    private static final Instant MIN = Instant.parse("0001-01-01T00:00:00Z");
    private static final Instant MAX = Instant.parse("9999-12-31T23:59:59.999999999Z");

    private final OffsetDateTime time;

    private Timestamp(OffsetDateTime time) {
        this.time = time;
    }

    /** A time field that breaks rule {@code rfc3339} or {@code timezone_required}. */
    static final class TimeError extends Exception {
        final String rule;

        TimeError(String rule, String message) {
            super(message);
            this.rule = rule;
        }
    }

    /**
     * Parses an RFC 3339 string with an explicit offset, truncated to microseconds.
     *
     * @throws IllegalArgumentException naming the rule ({@code rfc3339} or {@code timezone_required})
     */
    public static Timestamp parse(String text) {
        try {
            return parseChecked(text);
        } catch (TimeError e) {
            throw new IllegalArgumentException(e.getMessage() + " [" + e.rule + "]");
        }
    }

    static Timestamp parseChecked(String text) throws TimeError {
        Matcher m = RFC3339.matcher(text);
        if (!m.matches()) {
            if (LOCAL.matcher(text).matches()) {
                throw new TimeError("timezone_required",
                        "no timezone offset: add Z or ±hh:mm, e.g. 2025-09-11T12:45:00+08:00");
            }
            throw new TimeError("rfc3339", "must be RFC 3339 with an explicit offset, e.g. 2025-09-11T12:45:00+08:00");
        }
        int year = Integer.parseInt(m.group(1));
        int month = Integer.parseInt(m.group(2));
        int day = Integer.parseInt(m.group(3));
        int hour = Integer.parseInt(m.group(4));
        int minute = Integer.parseInt(m.group(5));
        int second = Integer.parseInt(m.group(6));
        int micros = 0;
        String frac = m.group(7);
        if (frac != null) {
            StringBuilder f = new StringBuilder(frac);
            while (f.length() < 6) {
                f.append('0');
            }
            micros = Integer.parseInt(f.substring(0, 6));
        }
        int offset = 0;
        String o = m.group(8);
        if (!o.equalsIgnoreCase("Z")) {
            int oh = Integer.parseInt(o.substring(1, 3));
            int om = Integer.parseInt(o.substring(4, 6));
            if (oh > 23 || om > 59) {
                throw new TimeError("rfc3339", "offset " + o + " is not ±00:00 to ±23:59");
            }
            offset = oh * 3600 + om * 60;
            if (o.charAt(0) == '-') {
                offset = -offset;
            }
        }
        if (year < 1 || month < 1 || month > 12 || day < 1 || day > daysIn(year, month)
                || hour > 23 || minute > 59 || second > 59) {
            throw new TimeError("rfc3339", "not a valid date, time or offset");
        }
        OffsetDateTime t = OffsetDateTime.of(year, month, day, hour, minute, second, micros * 1000,
                ZoneOffset.ofTotalSeconds(offset));
        Instant instant = t.toInstant();
        if (instant.isBefore(MIN) || instant.isAfter(MAX)) {
            throw new TimeError("rfc3339", "outside the years 0001-9999 once converted to UTC");
        }
        return new Timestamp(t);
    }

    private static int daysIn(int year, int month) {
        switch (month) {
            case 2:
                return (year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)) ? 29 : 28;
            case 4: case 6: case 9: case 11:
                return 30;
            default:
                return 31;
        }
    }

    /** Keeps the instant (to the microsecond) and the offset (UTC when not whole minutes). */
    public static Timestamp of(OffsetDateTime t) {
        Objects.requireNonNull(t, "time");
        OffsetDateTime truncated = t.truncatedTo(ChronoUnit.MICROS);
        if (truncated.getOffset().getTotalSeconds() % 60 != 0) {
            truncated = truncated.withOffsetSameInstant(ZoneOffset.UTC);
        }
        return new Timestamp(truncated);
    }

    /** An instant, written in UTC. */
    public static Timestamp of(Instant instant) {
        return of(instant.atOffset(ZoneOffset.UTC));
    }

    public static Timestamp ofEpochMilli(long ms) {
        return of(Instant.ofEpochMilli(ms));
    }

    /** The current time in UTC. */
    public static Timestamp now() {
        return of(Instant.now());
    }

    public OffsetDateTime toOffsetDateTime() {
        return time;
    }

    public Instant toInstant() {
        return time.toInstant();
    }

    /** Milliseconds since the Unix epoch, floored. */
    public long toEpochMilli() {
        return time.toInstant().toEpochMilli();
    }

    public boolean isAfter(Instant other) {
        return time.toInstant().isAfter(other);
    }

    /** RFC 3339 keeping the offset: UTC as {@code Z}, microseconds only when not zero. */
    @Override
    public String toString() {
        StringBuilder b = new StringBuilder(32);
        int year = time.getYear();
        b.append(String.format("%04d-%02d-%02dT%02d:%02d:%02d", year, time.getMonthValue(),
                time.getDayOfMonth(), time.getHour(), time.getMinute(), time.getSecond()));
        int micros = time.getNano() / 1000;
        if (micros != 0) {
            b.append(String.format(".%06d", micros));
        }
        int offset = time.getOffset().getTotalSeconds();
        if (offset == 0) {
            return b.append('Z').toString();
        }
        char sign = offset < 0 ? '-' : '+';
        offset = Math.abs(offset);
        return b.append(String.format("%c%02d:%02d", sign, offset / 3600, offset / 60 % 60)).toString();
    }

    @Override
    public int compareTo(Timestamp o) {
        return time.toInstant().compareTo(o.time.toInstant());
    }

    @Override
    public boolean equals(Object o) {
        return o instanceof Timestamp && ((Timestamp) o).time.equals(time);
    }

    @Override
    public int hashCode() {
        return time.hashCode();
    }
}
