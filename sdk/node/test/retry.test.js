// Retry decisions and delays (docs/protocol.md section 8).

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { envelopeToJson, newEnvelope, validateEnvelope } from '../src/envelope.js';
import {
  FAST_RETRIES_HEADER, InvalidPayloadError, RETRY_POLICY_HEADER, RejectedError, TIERED, TaskTimeoutError,
  TransientError, backoffDelayMs,
  decideFailure, fastRetriesTaken, isTransientError, nextAttempt, permanentClassOf,
} from '../src/retry.js';
import { Timestamp } from '../src/time.js';

const plain = (fields) => newEnvelope({ task_type: 'a.b', created_at: '2025-09-11T12:00:00+08:00', ...fields });
const TIERED_HEADERS = { [RETRY_POLICY_HEADER]: TIERED };
// An Envelope that asks for automatic retries (its own headers are added to the policy's).
const env = (fields) => plain({ ...fields, headers: { ...TIERED_HEADERS, ...fields.headers } });
const opts = { backoffMs: 30_000, maxBackoffMs: 3_600_000, fastRetries: 2 };
const mid = () => 0.5; // jitter factor exactly 1.0

describe('backoff delay', () => {
  test('30, 60, 120 s ... with the defaults, capped at max_backoff', () => {
    assert.deepEqual([1, 2, 3, 4].map((n) => backoffDelayMs(n, 0, opts, mid)), [30_000, 60_000, 120_000, 240_000]);
    assert.equal(backoffDelayMs(20, 0, opts, mid), 3_600_000);
    assert.equal(backoffDelayMs(5000, 0, opts, mid), 3_600_000); // no Infinity/NaN
  });

  test('fast retries already taken do not count in the exponent', () => {
    assert.equal(backoffDelayMs(3, 2, opts, mid), 30_000);
    assert.equal(backoffDelayMs(4, 2, opts, mid), 60_000);
    assert.equal(backoffDelayMs(1, 5, opts, mid), 30_000); // a bogus header never shortens below base
  });

  test('the jitter factor is applied before the cap', () => {
    // A capped delay is exactly max_backoff, whatever the jitter...
    assert.equal(backoffDelayMs(20, 0, opts, () => 0.999999), 3_600_000);
    // ...and a delay just above the cap may be jittered below it: 30 s x 2^7 x 0.8 = 51.2 min.
    assert.equal(backoffDelayMs(8, 0, opts, () => 0), 3_072_000);
    for (let i = 0; i < 200; i += 1) assert.ok(backoffDelayMs(30, 0, opts) <= 3_600_000);
  });

  test('jitter stays within [0.8, 1.2]', () => {
    assert.equal(backoffDelayMs(1, 0, opts, () => 0), 24_000);
    assert.ok(backoffDelayMs(1, 0, opts, () => 0.999999) <= 36_000);
    for (let i = 0; i < 200; i += 1) {
      const d = backoffDelayMs(2, 0, { backoffMs: 200, maxBackoffMs: 1000 });
      assert.ok(d >= 320 && d <= 480, String(d));
    }
  });

  test('small test settings: base 200 ms, cap 1 s', () => {
    const small = { backoffMs: 200, maxBackoffMs: 1000 };
    assert.deepEqual([1, 2, 3, 4, 5].map((n) => backoffDelayMs(n, 0, small, mid)), [200, 400, 800, 1000, 1000]);
  });
});

describe('decisions', () => {
  test('a task error goes to the backoff tier, then to the dead-letter stream as task_error', () => {
    const first = decideFailure(env({ max_retries: 2 }), { transient: false }, opts, mid);
    assert.deepEqual(first, { action: 'retry', tier: 'backoff', delayMs: 30_000, retryCount: 1, headers: TIERED_HEADERS });
    const second = decideFailure(env({ max_retries: 2, retry_count: 1 }), { transient: false }, opts, mid);
    assert.equal(second.delayMs, 60_000);
    assert.equal(second.retryCount, 2);
    assert.deepEqual(decideFailure(env({ max_retries: 2, retry_count: 2 }), { transient: false }, opts, mid),
      { action: 'dead', failureClass: 'task_error', attempts: 3 });
  });

  test('without x-retry-policy: tiered a failure is final, whatever max_retries says', () => {
    for (const maxRetries of [3, null]) {
      assert.deepEqual(decideFailure(plain({ max_retries: maxRetries }), { transient: true }, opts),
        { action: 'dead', failureClass: 'task_error', attempts: 1 });
    }
    assert.deepEqual(decideFailure(plain({ retry_count: 2 }), { timeout: true }, opts),
      { action: 'dead', failureClass: 'timeout', attempts: 3 });
    const other = plain({ headers: { [RETRY_POLICY_HEADER]: 'something-else' } });
    assert.equal(decideFailure(other, { transient: true }, opts).action, 'dead');
  });

  test('max_retries 0 means never retried', () => {
    assert.deepEqual(decideFailure(env({ max_retries: 0 }), { transient: true }, opts),
      { action: 'dead', failureClass: 'transient_exhausted', attempts: 1 });
  });

  test('transient errors use the fast tier first, counting in x-fast-retries', () => {
    const a = decideFailure(env({}), { transient: true }, opts, mid);
    assert.deepEqual(a, { action: 'retry', tier: 'fast', delayMs: 0, retryCount: 1, headers: { ...TIERED_HEADERS, [FAST_RETRIES_HEADER]: '1' } });
    const b = decideFailure(env({ retry_count: 1, headers: { [FAST_RETRIES_HEADER]: '1' } }), { transient: true }, { ...opts, maxRetries: 9 }, mid);
    assert.equal(b.tier, 'fast');
    assert.equal(b.headers[FAST_RETRIES_HEADER], '2');
    const c = decideFailure(env({ max_retries: 5, retry_count: 2, headers: { [FAST_RETRIES_HEADER]: '2', other: 'kept' } }), { transient: true }, opts, mid);
    assert.deepEqual(c, { action: 'retry', tier: 'backoff', delayMs: 30_000, retryCount: 3, headers: { ...TIERED_HEADERS, [FAST_RETRIES_HEADER]: '2', other: 'kept' } });
    const none = decideFailure(env({}), { transient: true }, { ...opts, fastRetries: 0 }, mid);
    assert.equal(none.tier, 'backoff');
  });

  test('exhausted transient errors and timeouts have their own classes', () => {
    const last = env({ max_retries: 1, retry_count: 1 });
    assert.equal(decideFailure(last, { transient: true }, opts).failureClass, 'transient_exhausted');
    assert.equal(decideFailure(last, { transient: true, timeout: true }, opts).failureClass, 'timeout');
  });

  test('timeouts skip the fast tier', () => {
    const d = decideFailure(env({}), { timeout: true }, opts, mid);
    assert.deepEqual(d, { action: 'retry', tier: 'backoff', delayMs: 30_000, retryCount: 1, headers: TIERED_HEADERS });
    assert.equal(decideFailure(env({}), { transient: true, timeout: true }, opts, mid).tier, 'backoff');
  });

  test('invalid payloads and rejections are never retried', () => {
    assert.equal(permanentClassOf(new InvalidPayloadError('x')), 'invalid_payload');
    assert.equal(permanentClassOf(new RejectedError('x')), 'rejected');
    assert.equal(permanentClassOf(new TransientError('x')), null);
    assert.equal(permanentClassOf(new Error('x')), null);
  });

  test('max_retries null retries forever on the backoff tier, capped', () => {
    const d = decideFailure(env({ max_retries: null, retry_count: 1000 }), { transient: false }, opts, mid);
    assert.equal(d.action, 'retry');
    assert.equal(d.delayMs, 3_600_000);
  });

  test('x-fast-retries is read strictly', () => {
    assert.equal(fastRetriesTaken({}), 0);
    assert.equal(fastRetriesTaken({ [FAST_RETRIES_HEADER]: '3' }), 3);
    assert.equal(fastRetriesTaken({ [FAST_RETRIES_HEADER]: 'x' }), 0);
    assert.equal(fastRetriesTaken({ [FAST_RETRIES_HEADER]: '-1' }), 0);
  });

  test('what counts as transient', () => {
    assert.equal(isTransientError(new TransientError('x')), true);
    assert.equal(isTransientError(new TaskTimeoutError(5)), false); // its own class: timeout
    assert.equal(isTransientError(Object.assign(new Error('x'), { code: 'ECONNRESET' })), true);
    assert.equal(isTransientError(new Error('wrap', { cause: Object.assign(new Error('x'), { code: 'ETIMEDOUT' }) })), true);
    assert.equal(isTransientError(new Error('x')), false);
    assert.equal(isTransientError('string'), false);
  });
});

describe('the next attempt', () => {
  test('same task, retry_count bumped, schedule_time = now + delay in the task\'s offset', () => {
    const e = env({ max_retries: 3 });
    const now = Date.UTC(2025, 8, 11, 4, 0, 0);
    const next = nextAttempt(e, { retryCount: 1, headers: { h: '1' }, delayMs: 30_000 }, now);
    assert.equal(next.task_id, e.task_id);
    assert.equal(next.trace_id, e.trace_id);
    assert.equal(next.retry_count, 1);
    assert.deepEqual(next.headers, { h: '1' });
    assert.equal(next.schedule_time, '2025-09-11T12:00:30+08:00');
    assert.equal(Timestamp.parse(next.schedule_time).epochMs, now + 30_000);
    assert.equal(validateEnvelope(next).ok, true);
  });

  test('a delay of 0 leaves schedule_time out', () => {
    const e = env({ schedule_time: '2025-09-11T12:00:00+08:00' });
    const next = nextAttempt(e, { retryCount: 1, delayMs: 0 });
    assert.equal(next.schedule_time, null);
    assert.equal(JSON.parse(envelopeToJson(next)).schedule_time, undefined);
  });

  test('the ordering_key travels with the next attempt, and stays out of the JSON when unset', () => {
    const next = nextAttempt(env({ ordering_key: 'order:42' }), { retryCount: 1, delayMs: 50 });
    assert.equal(JSON.parse(envelopeToJson(next)).ordering_key, 'order:42');
    assert.equal('ordering_key' in JSON.parse(envelopeToJson(nextAttempt(env({}), { delayMs: 0 }))), false);
  });
});
