// RFC 3339 timestamps with a mandatory offset (docs/protocol.md section 1.1).
//
// There is deliberately no way to build a Timestamp from a bare number: a
// number is refused, whatever its size, because epoch seconds read as
// milliseconds (or the other way round) parks a task for months. Code that
// holds an epoch says which unit it is with Timestamp.fromEpochMs().
// Date.parse is never used either: it accepts naive strings as local time.

export class TimeError extends Error {
  /** `rule` is the neutral rule name: "type", "rfc3339" or "timezone_required". */
  constructor(rule, message) {
    super(message);
    this.name = 'TimeError';
    this.rule = rule;
  }
}

const RFC3339 =
  /^([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?([Zz]|[+-][0-9]{2}:[0-9]{2})$/;
// What a date-time looks like when its offset is missing.
const RFC3339_LOCAL = /^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?$/;
const OFFSET = /^([+-])([0-9]{2}):([0-9]{2})$/;

const MS_PER_DAY = 86_400_000;
// 0001-01-01T00:00:00Z and 9999-12-31T23:59:59.999Z: the instants every language can hold.
const MIN_EPOCH_MS = -62_135_596_800_000;
const MAX_EPOCH_MS = 253_402_300_799_999;

function isLeap(year) {
  return (year % 4 === 0 && year % 100 !== 0) || year % 400 === 0;
}

function daysInMonth(year, month) {
  return [31, isLeap(year) ? 29 : 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][month - 1];
}

// Days since 1970-01-01 of a proleptic Gregorian date (no Date quirks for years < 100).
function daysFromCivil(year, month, day) {
  const y = month <= 2 ? year - 1 : year;
  const era = Math.floor(y / 400);
  const yoe = y - era * 400;
  const doy = Math.floor((153 * (month + (month > 2 ? -3 : 9)) + 2) / 5) + day - 1;
  const doe = yoe * 365 + Math.floor(yoe / 4) - Math.floor(yoe / 100) + doy;
  return era * 146097 + doe - 719468;
}

function civilFromDays(days) {
  const z = days + 719468;
  const era = Math.floor(z / 146097);
  const doe = z - era * 146097;
  const yoe = Math.floor((doe - Math.floor(doe / 1460) + Math.floor(doe / 36524) - Math.floor(doe / 146096)) / 365);
  const doy = doe - (365 * yoe + Math.floor(yoe / 4) - Math.floor(yoe / 100));
  const mp = Math.floor((5 * doy + 2) / 153);
  const day = doy - Math.floor((153 * mp + 2) / 5) + 1;
  const month = mp < 10 ? mp + 3 : mp - 9;
  return { year: yoe + era * 400 + (month <= 2 ? 1 : 0), month, day };
}

const pad = (value, width) => String(value).padStart(width, '0');

/** Parse "+08:00" / "-05:30" / "Z" into minutes east of UTC. */
export function parseOffset(text) {
  if (text === 'Z' || text === 'z') return 0;
  const match = OFFSET.exec(text);
  if (!match || Number(match[2]) > 23 || Number(match[3]) > 59) {
    throw new TimeError('rfc3339', `offset ${JSON.stringify(text)} is not Z or ±hh:mm (00:00 to 23:59)`);
  }
  const minutes = Number(match[2]) * 60 + Number(match[3]);
  return match[1] === '-' ? -minutes : minutes;
}

export function formatOffset(minutes) {
  if (minutes === 0) return 'Z';
  const sign = minutes < 0 ? '-' : '+';
  const abs = Math.abs(minutes);
  return `${sign}${pad(Math.floor(abs / 60), 2)}:${pad(abs % 60, 2)}`;
}

/** An instant plus the offset it was written in. */
export class Timestamp {
  constructor(epochMs, subMsNanos, offsetMinutes, fraction) {
    this.epochMs = epochMs; // integer milliseconds since the Unix epoch (floor)
    this.subMsNanos = subMsNanos; // 0..999999, the part below a millisecond
    this.offsetMinutes = offsetMinutes;
    this.fraction = fraction; // fraction digits to write ("" for none)
    Object.freeze(this);
  }

  /**
   * Parse an RFC 3339 string with an explicit offset. Throws TimeError with
   * rule "type" for non-strings (numbers included), "timezone_required" for a
   * date-time without offset, "rfc3339" for anything else that is wrong.
   */
  static parse(value) {
    if (value instanceof Timestamp) return value;
    if (typeof value === 'number' || typeof value === 'bigint') {
      throw new TypeErrorForTime('numeric timestamps are not accepted (epoch seconds or milliseconds?); use an RFC 3339 string with an offset');
    }
    if (value instanceof Date) {
      throw new TypeErrorForTime('a Date has no offset of its own; use Timestamp.fromDate(date, offsetMinutes) or an RFC 3339 string');
    }
    if (typeof value !== 'string') throw new TypeErrorForTime('must be an RFC 3339 string with an offset');
    const m = RFC3339.exec(value);
    if (!m) {
      if (RFC3339_LOCAL.test(value)) {
        throw new TimeError('timezone_required', 'no timezone offset: add Z or ±hh:mm, e.g. 2025-09-11T12:45:00+08:00');
      }
      throw new TimeError('rfc3339', 'must be RFC 3339 with an explicit offset, e.g. 2025-09-11T12:45:00+08:00');
    }
    const [year, month, day, hour, minute, second] = m.slice(1, 7).map(Number);
    const fraction = m[7] ?? '';
    if (year < 1) throw new TimeError('rfc3339', 'year 0000 does not exist');
    if (month < 1 || month > 12 || day < 1 || day > daysInMonth(year, month)) {
      throw new TimeError('rfc3339', `${m[1]}-${m[2]}-${m[3]} is not a date`);
    }
    if (hour > 23 || minute > 59 || second > 59) {
      throw new TimeError('rfc3339', `${m[4]}:${m[5]}:${m[6]} is not a time of day (no leap seconds)`);
    }
    const offsetMinutes = parseOffset(m[8]);
    const nanos = Number(fraction.padEnd(9, '0'));
    const localMs = daysFromCivil(year, month, day) * MS_PER_DAY + ((hour * 60 + minute) * 60 + second) * 1000;
    const epochMs = localMs - offsetMinutes * 60_000 + Math.floor(nanos / 1e6);
    if (epochMs < MIN_EPOCH_MS || epochMs > MAX_EPOCH_MS) {
      throw new TimeError('rfc3339', 'outside the years 0001-9999 once converted to UTC');
    }
    return new Timestamp(epochMs, nanos % 1e6, offsetMinutes, fraction);
  }

  /** The instant `epochMs` (integer milliseconds, explicitly) written at `offsetMinutes`. */
  static fromEpochMs(epochMs, offsetMinutes = 0) {
    if (!Number.isSafeInteger(epochMs)) throw new TypeError('epochMs must be an integer number of milliseconds');
    if (epochMs < MIN_EPOCH_MS || epochMs > MAX_EPOCH_MS) throw new RangeError('outside the years 0001-9999');
    if (!Number.isInteger(offsetMinutes) || Math.abs(offsetMinutes) > 23 * 60 + 59) {
      throw new RangeError('offset must be whole minutes within ±23:59');
    }
    const ms = ((epochMs % 1000) + 1000) % 1000;
    return new Timestamp(epochMs, 0, offsetMinutes, ms === 0 ? '' : pad(ms, 3));
  }

  static fromDate(date, offsetMinutes = 0) {
    return Timestamp.fromEpochMs(date.getTime(), offsetMinutes);
  }

  static now(offsetMinutes = 0) {
    return Timestamp.fromEpochMs(Date.now(), offsetMinutes);
  }

  /** The same instant written at another offset. */
  withOffset(offsetMinutes) {
    const moved = Timestamp.fromEpochMs(this.epochMs, offsetMinutes);
    return new Timestamp(this.epochMs, this.subMsNanos, offsetMinutes, this.fraction || moved.fraction);
  }

  toDate() {
    return new Date(this.epochMs);
  }

  /** Compare instants (not strings): negative, 0 or positive. */
  compare(other) {
    const o = Timestamp.parse(other);
    return this.epochMs - o.epochMs || this.subMsNanos - o.subMsNanos;
  }

  equals(other) {
    return this.compare(other) === 0;
  }

  /** Canonical RFC 3339 text: upper-case T, the offset kept, UTC written Z. */
  toString() {
    const localMs = this.epochMs + this.offsetMinutes * 60_000;
    const days = Math.floor(localMs / MS_PER_DAY);
    const msOfDay = localMs - days * MS_PER_DAY;
    const { year, month, day } = civilFromDays(days);
    const seconds = Math.floor(msOfDay / 1000);
    const hh = Math.floor(seconds / 3600);
    const mm = Math.floor((seconds % 3600) / 60);
    const ss = seconds % 60;
    const frac = this.fraction ? `.${this.fraction}` : '';
    return `${pad(year, 4)}-${pad(month, 2)}-${pad(day, 2)}T${pad(hh, 2)}:${pad(mm, 2)}:${pad(ss, 2)}${frac}${formatOffset(this.offsetMinutes)}`;
  }

  toJSON() {
    return this.toString();
  }
}

class TypeErrorForTime extends TimeError {
  constructor(message) {
    super('type', message);
  }
}

/** Parse a timestamp; the rule-carrying TimeError is thrown on failure. */
export function parseRfc3339(value) {
  return Timestamp.parse(value);
}
