// Retry rules (docs/protocol.md section 8), as pure functions.
//
//   InvalidPayloadError / RejectedError: dead-lettered at once (invalid_payload /
//     rejected), never retried (the worker checks them before deciding).
//   An Envelope without the header x-retry-policy: tiered is not retried: its failure
//     is final (timeout for a timeout, task_error otherwise).
//   next = retry_count + 1; past max_retries (unless null) the task is dead:
//     transient_exhausted (transient error), timeout (timeout), task_error (otherwise).
//   Fast tier: a transient error (not a timeout) while headers["x-fast-retries"]
//     is below fastRetries retries at once and increments the header.
//   Backoff tier: min(backoff * 2^(next - f - 1) * j, maxBackoff) with j random in
//     [0.8, 1.2] (applied before the cap), f being the fast retries already taken.
//   The next attempt carries schedule_time = now + delay (left out for a delay of 0)
//     and x-first-failure-at, set on the first failure.

import { Timestamp } from './time.js';

export const FAST_RETRIES_HEADER = 'x-fast-retries';
/** When the first attempt failed, carried across attempts for the dead-letter entry. */
export const FIRST_FAILURE_HEADER = 'x-first-failure-at';
/** Asks for automatic retries; TIERED is the one policy defined. */
export const RETRY_POLICY_HEADER = 'x-retry-policy';
export const TIERED = 'tiered';

/** True when the Envelope asks for automatic retries under the tiered policy. */
export function asksForTiered(env) {
  return env.headers?.[RETRY_POLICY_HEADER] === TIERED;
}

export const RETRY_DEFAULTS = Object.freeze({
  fastRetries: 2,
  backoffMs: 30_000,
  maxBackoffMs: 3_600_000,
});

/** An error worth retrying at once: connection errors, lock conflicts. */
export class TransientError extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = 'TransientError';
    this.transient = true;
  }
}

/** The attempt ran longer than timeout_ms: retried on the backoff tier, class timeout. */
export class TaskTimeoutError extends Error {
  constructor(timeoutMs) {
    super(`the attempt ran longer than timeout_ms (${timeoutMs} ms)`);
    this.name = 'TaskTimeoutError';
    this.timeoutMs = timeoutMs;
  }
}

/** The payload can never be processed: dead-lettered at once as invalid_payload. */
export class InvalidPayloadError extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = 'InvalidPayloadError';
  }
}

/** The handler refuses the task: dead-lettered at once as rejected. */
export class RejectedError extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = 'RejectedError';
  }
}

/** The failure class of an error that is never retried, or null. */
export function permanentClassOf(err) {
  if (err instanceof InvalidPayloadError) return 'invalid_payload';
  if (err instanceof RejectedError) return 'rejected';
  return null;
}

const TRANSIENT_CODES = new Set([
  'ECONNRESET', 'ECONNREFUSED', 'ECONNABORTED', 'ETIMEDOUT', 'EPIPE', 'EHOSTUNREACH',
  'ENETUNREACH', 'ENETDOWN', 'EAI_AGAIN', 'UND_ERR_CONNECT_TIMEOUT', 'UND_ERR_SOCKET',
]);

/** Default transient test; workers accept an extra predicate to mark more errors. */
export function isTransientError(err) {
  if (!err || typeof err !== 'object') return false;
  if (err instanceof TaskTimeoutError) return false; // its own class: backoff tier only
  if (err.transient === true) return true;
  if (err.name === 'TimeoutError') return true; // AbortSignal.timeout(), fetch timeouts: I/O the task waited on
  if (typeof err.code === 'string' && TRANSIENT_CODES.has(err.code)) return true;
  return err.cause !== undefined && err.cause !== err ? isTransientError(err.cause) : false;
}

/** Fast retries already taken, from the x-fast-retries header (absent or unreadable = 0). */
export function fastRetriesTaken(headers) {
  const raw = headers?.[FAST_RETRIES_HEADER];
  return typeof raw === 'string' && /^[0-9]{1,9}$/.test(raw) ? Number(raw) : 0;
}

/**
 * Backoff-tier delay in ms before attempt `next`: min(backoff * 2^(next - f - 1) * j,
 * maxBackoff), the jitter j = 0.8 + 0.4 * random() applied before the cap.
 */
export function backoffDelayMs(next, fastTaken, { backoffMs, maxBackoffMs }, random = Math.random) {
  const exponent = Math.max(0, next - fastTaken - 1);
  const jitter = 0.8 + 0.4 * random();
  return Math.round(Math.min(backoffMs * 2 ** Math.min(exponent, 1024) * jitter, maxBackoffMs));
}

/** The dead-letter failure class of a failed attempt. */
export function failureClassOf({ transient, timeout }) {
  if (timeout) return 'timeout';
  return transient ? 'transient_exhausted' : 'task_error';
}

/**
 * What to do after a failed attempt of `env`:
 *   { action: 'dead', failureClass, attempts }
 *   { action: 'retry', tier: 'fast' | 'backoff', delayMs, retryCount, headers }
 */
export function decideFailure(env, { transient = false, timeout = false }, options = {}, random = Math.random) {
  const opts = { ...RETRY_DEFAULTS, ...options };
  const next = env.retry_count + 1;
  if (!asksForTiered(env)) {
    return { action: 'dead', failureClass: timeout ? 'timeout' : 'task_error', attempts: next };
  }
  if (env.max_retries !== null && next > env.max_retries) {
    return { action: 'dead', failureClass: failureClassOf({ transient, timeout }), attempts: next };
  }
  const fastTaken = fastRetriesTaken(env.headers);
  if (transient && !timeout && fastTaken < opts.fastRetries) {
    return {
      action: 'retry', tier: 'fast', delayMs: 0, retryCount: next,
      headers: { ...env.headers, [FAST_RETRIES_HEADER]: String(fastTaken + 1) },
    };
  }
  return {
    action: 'retry', tier: 'backoff', delayMs: backoffDelayMs(next, fastTaken, opts, random),
    retryCount: next, headers: { ...env.headers },
  };
}

/** Offset (minutes) to write new times of `env` in: its schedule_time's, else its created_at's. */
export function offsetOf(env) {
  try {
    return Timestamp.parse(env.schedule_time ?? env.created_at).offsetMinutes;
  } catch {
    return 0;
  }
}

/**
 * The Envelope of the next attempt: same task_id, retry_count and headers as
 * decided, schedule_time = now + delay (in the task's own offset), or no
 * schedule_time at all when the delay is 0.
 */
export function nextAttempt(env, { retryCount = env.retry_count, headers = env.headers, delayMs }, nowMs = Date.now()) {
  return {
    ...env,
    retry_count: retryCount,
    headers,
    schedule_time: delayMs > 0 ? Timestamp.fromEpochMs(nowMs + delayMs, offsetOf(env)).toString() : null,
  };
}
