// Results for Celery callers (docs/protocol.md section 12).
//
// An Envelope whose ext.celery.result is {"key", "expires_s"} asks the worker
// to write its final state where Celery's Redis result backend reads it:
// SET <key> <meta> EX <expires_s> (plain SET without expiry) and
// PUBLISH <key> <meta>, in one MULTI, on the result backend's client. <meta>
// is compact JSON: status, result, traceback, children, date_done, task_id.

import { stringifyJson } from './json.js';
import { retryWhileAway } from './outage.js';

/** The exception Celery raises for a revoked task, as the REVOKED result names it. */
const REVOKED_ERROR = Object.freeze({ type: 'TaskRevokedError', module: 'celery.exceptions' });

/** The result request is not {"key": non-empty string, "expires_s": integer >= 1 | null}. */
export class InvalidResultRequest extends Error {
  constructor(field, rule, message) {
    super(`${field}: ${message} [${rule}]`);
    this.name = 'InvalidResultRequest';
    this.field = field;
    this.rule = rule;
  }
}

/**
 * The result an Envelope asks for: { key, expiresS (null: no expiry) }, or
 * null when it asks for none. Throws InvalidResultRequest naming the field.
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
  const expires = request.expires_s ?? null;
  if (expires !== null && (typeof expires !== 'number' || !Number.isSafeInteger(expires) || expires < 1)) {
    throw new InvalidResultRequest(`${field}.expires_s`, 'range', `must be an integer number of seconds >= 1 or null, not ${String(expires)}`);
  }
  return { key: request.key, expiresS: expires };
}

/** `YYYY-MM-DDThh:mm:ss.ffffff+00:00` (UTC) of a time in ms since the epoch. */
export function formatDateDone(epochMs) {
  return `${new Date(epochMs).toISOString().slice(0, 23)}000+00:00`;
}

/**
 * The compact JSON Celery's result backend stores for a task.
 * @param {{ status: 'SUCCESS' | 'FAILURE' | 'REVOKED', result?: any, traceback?: string | null,
 *   taskId: string, nowMs?: number }} outcome
 * @returns {string}
 */
export function resultMeta({ status, result = null, traceback = null, taskId, nowMs = Date.now() }) {
  return stringifyJson({
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

  /** SUCCESS with the handler's value (a JSON value; anything else is written as null and logged). */
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
    let meta;
    try {
      meta = resultMeta({ ...outcome, taskId: env.task_id });
    } catch (err) {
      log.warn('the handler returned a value that is not JSON; its result is written as null', { err });
      meta = resultMeta({ ...outcome, result: null, taskId: env.task_id });
    }
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
