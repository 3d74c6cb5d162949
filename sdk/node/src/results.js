// Results for Celery callers (docs/protocol.md section 12).
//
// An Envelope whose ext.celery.result is {"key", "expires_s"} asks the worker
// to write its final state where Celery's Redis result backend reads it:
// SET <key> <meta> EX <expires_s> (plain SET without expiry) and
// PUBLISH <key> <meta>, in one MULTI, on the result backend's client. <meta>
// is compact JSON: status, result, traceback, children, date_done, task_id.
// A handler's value that cannot be written as JSON fails the attempt with a
// ResultEncodeError (exception type EncodeError, as in Celery).

import { retryWhileAway } from './outage.js';

/** The exception Celery raises for a revoked task, as the REVOKED result names it. */
const REVOKED_ERROR = Object.freeze({ type: 'TaskRevokedError', module: 'celery.exceptions' });

/** The result request is not {"key": non-empty string, "expires_s": number >= 0 | null}. */
export class InvalidResultRequest extends Error {
  constructor(field, rule, message) {
    super(`${field}: ${message} [${rule}]`);
    this.name = 'InvalidResultRequest';
    this.field = field;
    this.rule = rule;
  }
}

/**
 * The whole seconds a result lives (section 12): a fraction is rounded up;
 * 0, null or absent is null (no expiry). Throws InvalidResultRequest for a
 * negative value, one beyond 2^53 - 1 or one that is not a number.
 * @param {unknown} value
 * @returns {number | null}
 */
function expirySeconds(value) {
  const field = 'ext.celery.result.expires_s';
  if (value === undefined || value === null) return null;
  if (typeof value !== 'number' && typeof value !== 'bigint') {
    throw new InvalidResultRequest(field, 'type', `must be a number of seconds or null, not ${JSON.stringify(value)}`);
  }
  const seconds = typeof value === 'number' ? Math.ceil(value) : value;
  if (value < 0 || typeof seconds !== 'number' || !Number.isSafeInteger(seconds)) {
    throw new InvalidResultRequest(field, 'range', `must be >= 0 and at most 2^53 - 1 seconds, not ${String(value)}`);
  }
  return seconds === 0 ? null : seconds;
}

/**
 * The result an Envelope asks for: { key, expiresS (whole seconds, null: no
 * expiry) }, or null when it asks for none. Throws InvalidResultRequest
 * naming the field.
 * @param {any} env
 * @returns {{ key: string, expiresS: number | null } | null}
 */
export function resultRequestOf(env) {
  const request = env?.ext?.celery?.result;
  if (request === undefined || request === null) return null;
  const field = 'ext.celery.result';
  if (typeof request !== 'object' || Array.isArray(request)) {
    throw new InvalidResultRequest(field, 'type', 'must be an object {"key", "expires_s"}');
  }
  if (typeof request.key !== 'string' || !request.key) {
    throw new InvalidResultRequest(`${field}.key`, 'type', 'must be a non-empty string');
  }
  return { key: request.key, expiresS: expirySeconds(request.expires_s) };
}

/**
 * A handler's value that cannot be written as JSON, for an Envelope that asks
 * for a result: the attempt fails as a task error whose exception type (its
 * name) is `EncodeError`, as in Celery.
 */
export class ResultEncodeError extends Error {
  /** @param {Error} cause what JSON could not write */
  constructor(cause) {
    super(`the handler's value cannot be written as JSON: ${cause.message}`, { cause });
    this.name = 'EncodeError';
  }
}

/** JSON.stringify's replacer that refuses what JSON cannot hold instead of dropping or changing it. */
function refuseNonJson(key, value) {
  const where = key === '' ? 'the value' : `the member ${JSON.stringify(key)}`;
  if (typeof value === 'number' && !Number.isFinite(value)) throw new TypeError(`${where} is ${value}, not a JSON number`);
  if (typeof value === 'function' || typeof value === 'symbol' || typeof value === 'bigint') {
    throw new TypeError(`${where} is a ${typeof value}, not a JSON value`);
  }
  return value;
}

/**
 * Compact JSON of a handler's value, as JSON.stringify writes it (a Date is
 * its toJSON() string, undefined at the top level is null, undefined members
 * are left out), except that NaN, infinities, functions, symbols and BigInt
 * are refused. Throws ResultEncodeError for those and for circular objects.
 * @param {unknown} value
 * @returns {string}
 */
export function encodeResult(value) {
  try {
    return JSON.stringify(value, refuseNonJson) ?? 'null';
  } catch (err) {
    throw new ResultEncodeError(err);
  }
}

/**
 * Throws ResultEncodeError when env asks for a result (ext.celery.result,
 * readable or not) and value cannot be written as JSON.
 * @param {any} env
 * @param {unknown} value
 */
export function checkResult(env, value) {
  const request = env?.ext?.celery?.result;
  if (request !== undefined && request !== null) encodeResult(value);
}

/** `YYYY-MM-DDThh:mm:ss.ffffff+00:00` (UTC) of a time in ms since the epoch. */
export function formatDateDone(epochMs) {
  return `${new Date(epochMs).toISOString().slice(0, 23)}000+00:00`;
}

/**
 * The compact JSON Celery's result backend stores for a task. Throws
 * ResultEncodeError when `result` cannot be written as JSON (encodeResult).
 * @param {{ status: 'SUCCESS' | 'FAILURE' | 'REVOKED', result?: any, traceback?: string | null,
 *   taskId: string, nowMs?: number }} outcome
 * @returns {string}
 */
export function resultMeta({ status, result = null, traceback = null, taskId, nowMs = Date.now() }) {
  return encodeResult({
    status, result, traceback, children: [], date_done: formatDateDone(nowMs), task_id: taskId,
  });
}

/** Celery's error object: { exc_type, exc_message: [message], exc_module }. */
export function errorResult(type, message, module = null) {
  return { exc_type: type, exc_message: [message], exc_module: module };
}

/**
 * Writes the results Envelopes ask for, on the result backend's client (or
 * logs, once per task type, that it cannot when the worker has none). A write
 * is retried while that Redis is away and then logged: it never throws.
 */
export class ResultWriter {
  /**
   * @param {{ client: any | null, log: any, toleranceMs?: number }} options
   */
  constructor({ client, log, toleranceMs }) {
    this.client = client;
    this.log = log;
    this.toleranceMs = toleranceMs;
    this.unwritten = new Set(); // task types already logged as asking without a backend
  }

  /** SUCCESS with the handler's value (one checkResult accepted). */
  success(env, value, log) {
    return this.write(env, { status: 'SUCCESS', result: value ?? null }, log);
  }

  /** FAILURE of a dead-lettered task: exc_type, the message and the stack trace (or null). */
  failure(env, { type, message, traceback = null }, log) {
    return this.write(env, { status: 'FAILURE', result: errorResult(type, message), traceback }, log);
  }

  /** REVOKED of a cancelled (`revoked`) or expired (`expired`) task. */
  revoked(env, why, log) {
    return this.write(env, { status: 'REVOKED', result: errorResult(REVOKED_ERROR.type, why, REVOKED_ERROR.module) }, log);
  }

  async write(env, outcome, log) {
    let request;
    try {
      request = resultRequestOf(env);
    } catch (err) {
      log.warn('the Envelope asks for a result in a form this worker cannot write; no result written', {
        field: err.field, rule: err.rule, error: err.message,
      });
      return false;
    }
    if (request === null) return false;
    if (!this.client) {
      if (!this.unwritten.has(env.task_type)) {
        this.unwritten.add(env.task_type);
        log.warn('a result was asked for and not written: this worker has no result backend (resultBackend)', {
          result_key: request.key,
        });
      }
      return false;
    }
    const meta = resultMeta({ ...outcome, taskId: env.task_id });
    try {
      await retryWhileAway(async () => {
        const multi = this.client.multi();
        if (request.expiresS === null) multi.set(request.key, meta);
        else multi.set(request.key, meta, 'EX', request.expiresS);
        const replies = await multi.publish(request.key, meta).exec();
        for (const [err] of replies ?? []) if (err) throw err;
      }, {
        toleranceMs: this.toleranceMs,
        onRetry: (err, attempt) => {
          if (attempt === 1) log.warn('the result backend is away; retrying the result write', { err });
        },
      });
    } catch (err) {
      log.error('could not write the result; the task outcome stands', { err, status: outcome.status, result_key: request.key });
      return false;
    }
    log.debug('result written', { status: outcome.status, result_key: request.key });
    return true;
  }
}
