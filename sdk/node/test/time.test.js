// RFC 3339 parsing: numbers and naive strings are refused, offsets are kept,
// instants compare across offsets.

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { dueMs, isDue, newEnvelope, validateEnvelope } from '../src/envelope.js';
import { TimeError, Timestamp, formatOffset, parseOffset } from '../src/time.js';

const rule = (fn) => {
  try {
    fn();
  } catch (err) {
    assert.ok(err instanceof TimeError, String(err));
    return err.rule;
  }
  return assert.fail('expected a TimeError');
};

describe('refused inputs', () => {
  test('epoch milliseconds (the seed incident) are a type error, never a time', () => {
    assert.equal(rule(() => Timestamp.parse(1757565900000)), 'type');
    assert.equal(rule(() => Timestamp.parse(1757565900)), 'type');
    assert.equal(rule(() => Timestamp.parse(1757565900.25)), 'type');
    assert.equal(rule(() => Timestamp.parse(1757565900000n)), 'type');
    assert.equal(rule(() => Timestamp.parse('1757565900000')), 'rfc3339');
  });

  test('an envelope with an epoch schedule_time is refused, not parked for months', () => {
    const result = validateEnvelope('{"task_id":"t-1","trace_id":"tr-1","created_at":"2025-09-11T04:40:00Z","task_type":"order.close_timeout","schedule_time":1757565900000}');
    assert.equal(result.ok, false);
    assert.deepEqual(result.violations.map((v) => [v.field, v.rule]), [['schedule_time', 'type']]);
  });

  test('naive date-times need an offset', () => {
    assert.equal(rule(() => Timestamp.parse('2025-09-11T12:45:00')), 'timezone_required');
    assert.equal(rule(() => Timestamp.parse('2025-09-11T12:45:00.250')), 'timezone_required');
    assert.equal(rule(() => Timestamp.parse('2025-09-11 12:45:00')), 'rfc3339');
  });

  test('Date objects, null and other types are refused', () => {
    assert.equal(rule(() => Timestamp.parse(new Date())), 'type');
    assert.equal(rule(() => Timestamp.parse(null)), 'type');
    assert.equal(rule(() => Timestamp.parse({})), 'type');
  });

  test('impossible dates, times and offsets', () => {
    for (const text of [
      '2025-02-29T00:00:00Z', '2025-04-31T00:00:00Z', '2025-09-11T24:00:00Z', '2016-12-31T23:59:60Z',
      '2025-09-11T12:60:00Z', '2025-09-11T12:45:00+24:00', '2025-09-11T12:45:00+05:60', '0000-01-01T00:00:00Z',
      '2025-09-11T12:45:00+0800', '2025-09-11T12:45:00+08', '2025-09-11T12:45:00.1234567891Z', '2025-09-11T12:45:00Z\n',
      '0001-01-01T00:30:00+01:00', '9999-12-31T23:30:00-01:00',
    ]) {
      assert.equal(rule(() => Timestamp.parse(text)), 'rfc3339', text);
    }
    assert.equal(Timestamp.parse('2024-02-29T00:00:00Z').toString(), '2024-02-29T00:00:00Z');
    assert.equal(Timestamp.parse('2000-02-29T00:00:00Z').toString(), '2000-02-29T00:00:00Z');
    assert.equal(rule(() => Timestamp.parse('1900-02-29T00:00:00Z')), 'rfc3339');
  });

  test('there is no constructor from a bare number of unknown unit', () => {
    assert.throws(() => Timestamp.fromEpochMs(1.5), TypeError);
    assert.throws(() => Timestamp.fromEpochMs('1757565900000'), TypeError);
  });
});

describe('offsets', () => {
  test('+08:00 is preserved and is the right instant', () => {
    const local = Timestamp.parse('2025-09-11T12:45:00+08:00');
    assert.equal(local.toString(), '2025-09-11T12:45:00+08:00');
    assert.equal(local.offsetMinutes, 480);
    assert.equal(local.epochMs, Date.UTC(2025, 8, 11, 4, 45, 0));
    assert.ok(local.equals('2025-09-11T04:45:00Z'));
    assert.ok(local.equals('2025-09-10T23:15:00-05:30'));
    assert.ok(local.compare('2025-09-11T04:45:00.001Z') < 0);
  });

  test('validation keeps the offset the writer gave', () => {
    const result = validateEnvelope({ task_id: 't-1', trace_id: 'tr-1', task_type: 'a.b', schedule_time: '2025-09-11T12:45:00+08:00', created_at: '2025-09-11T12:30:00-05:30' });
    assert.equal(result.envelope.schedule_time, '2025-09-11T12:45:00+08:00');
    assert.equal(result.envelope.created_at, '2025-09-11T12:30:00-05:30');
    assert.equal(dueMs(result.envelope), Date.UTC(2025, 8, 11, 4, 45, 0));
  });

  test('UTC is written Z, lower-case t and z upper-cased, fractions kept', () => {
    assert.equal(Timestamp.parse('2025-09-11t04:45:00z').toString(), '2025-09-11T04:45:00Z');
    assert.equal(Timestamp.parse('2025-09-11T04:45:00+00:00').toString(), '2025-09-11T04:45:00Z');
    assert.equal(Timestamp.parse('2025-09-11T04:45:00-00:00').toString(), '2025-09-11T04:45:00Z');
    const nanos = Timestamp.parse('2025-09-11T12:45:00.123456789+08:00');
    assert.equal(nanos.toString(), '2025-09-11T12:45:00.123456789+08:00');
    assert.equal(nanos.epochMs % 1000, 123);
    assert.equal(nanos.subMsNanos, 456789);
  });

  test('writing an instant at another offset', () => {
    const ts = Timestamp.fromEpochMs(Date.UTC(2025, 8, 11, 20, 0, 0, 250), 480);
    assert.equal(ts.toString(), '2025-09-12T04:00:00.250+08:00');
    assert.equal(ts.withOffset(-330).toString(), '2025-09-11T14:30:00.250-05:30');
    assert.ok(ts.equals(ts.withOffset(-330)));
    assert.equal(Timestamp.fromEpochMs(0).toString(), '1970-01-01T00:00:00Z');
    assert.equal(Timestamp.fromEpochMs(-1).toString(), '1969-12-31T23:59:59.999Z');
    assert.equal(Timestamp.parse('0001-01-01T00:00:00Z').toString(), '0001-01-01T00:00:00Z');
    assert.equal(Timestamp.parse('0099-03-01T00:00:00Z').toString(), '0099-03-01T00:00:00Z');
  });

  test('offset syntax', () => {
    assert.equal(parseOffset('+08:00'), 480);
    assert.equal(parseOffset('-05:30'), -330);
    assert.equal(parseOffset('Z'), 0);
    assert.throws(() => parseOffset('+8'), TimeError);
    assert.equal(formatOffset(0), 'Z');
    assert.equal(formatOffset(-330), '-05:30');
  });

  test('due time compares instants, whatever the offset', () => {
    const now = Date.UTC(2025, 8, 11, 4, 45, 0);
    const env = (schedule_time) => newEnvelope({ task_type: 'a', schedule_time });
    assert.equal(isDue(env('2025-09-11T12:45:00+08:00'), now), true);
    assert.equal(isDue(env('2025-09-11T12:45:01+08:00'), now), false);
    assert.equal(isDue(env('2025-09-11T04:44:59Z'), now), true);
    assert.equal(isDue(newEnvelope({ task_type: 'a' }), now), true);
  });
});
