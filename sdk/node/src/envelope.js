// The Envelope (docs/protocol.md section 1): validation with errors that name
// the field and the neutral rule, defaults, and the canonical JSON writer.
//
// Every violation is { field, rule, message }. `field` is a dotted path
// ("priority", "headers.x-attempt", "ext.Celery") or "envelope" for the
// document itself; `rule` is one of the neutral names of the conformance
// vectors (required, unknown_field, type, json, json_value, pattern, length,
// range, rfc3339, timezone_required, max_depth, max_bytes,
// retry_count_le_max_retries, max_delay).

import crypto from 'node:crypto';
import { JsonSyntaxError, isIntegerLiteral, parseJson, stringifyJson } from './json.js';
import { TimeError, Timestamp } from './time.js';

export { Timestamp, TimeError } from './time.js';

export const PRIORITY_MIN = 0;
export const PRIORITY_MAX = 255;
export const PRIORITY_DEFAULT = 100;
export const MAX_RETRIES_DEFAULT = 3;
export const MAX_SAFE_INTEGER = Number.MAX_SAFE_INTEGER;

export const TASK_TYPE_PATTERN = /^[A-Za-z_][A-Za-z0-9_-]*(\.[A-Za-z_][A-Za-z0-9_-]*)*$/;
export const TOKEN_PATTERN = /^[\x21-\x7e]+$/;
export const EXT_NAMESPACE_PATTERN = /^[a-z][a-z0-9_.-]*$/;

/** Configurable limits (the defaults are the protocol's). */
export const DEFAULT_LIMITS = Object.freeze({
  maxDelayMs: 90 * 24 * 3600 * 1000,
  maxPayloadDepth: 5,
  maxPayloadBytes: 1024 * 1024,
});

const EXT_MAX_DEPTH = 64;

/** Envelope fields in their canonical order. */
export const FIELDS = Object.freeze([
  'task_id', 'task_type', 'payload_version', 'payload', 'schedule_time', 'timeout_ms', 'expires',
  'max_retries', 'retry_count', 'priority', 'trace_id', 'created_at', 'idempotency_key',
  'ordering_key', 'headers', 'ext',
]);
// Optional fields whose default is null: left out of the JSON when null.
const NULL_BY_DEFAULT = new Set(['schedule_time', 'timeout_ms', 'expires', 'idempotency_key', 'ordering_key']);
const KNOWN = new Set(FIELDS);
const REQUIRED_IDENTITY = 'the field is required (producers fill it in; readers never invent it)';

export class InvalidEnvelope extends Error {
  constructor(violations) {
    super(`invalid envelope: ${violations.map(formatViolation).join('; ')}`);
    this.name = 'InvalidEnvelope';
    this.violations = violations;
  }
}

export function formatViolation(v) {
  return `${v.field}: ${v.message} [${v.rule}]`;
}

class Check {
  constructor() {
    this.violations = [];
  }

  add(field, rule, message) {
    this.violations.push({ field, rule, message });
    return undefined;
  }
}

const isPlainObject = (value) =>
  typeof value === 'object' && value !== null && !Array.isArray(value) &&
  [Object.prototype, null].includes(Object.getPrototypeOf(value));

function codePoints(text) {
  let count = 0;
  for (let i = 0; i < text.length; i += 1) {
    const c = text.charCodeAt(i);
    if (c >= 0xd800 && c <= 0xdbff && i + 1 < text.length) {
      const d = text.charCodeAt(i + 1);
      if (d >= 0xdc00 && d <= 0xdfff) i += 1;
    }
    count += 1;
  }
  return count;
}

function describe(value) {
  if (value === null) return 'null';
  if (Array.isArray(value)) return 'an array';
  if (typeof value === 'bigint') return 'a number';
  return `a ${typeof value}`;
}

function checkString(check, field, value, { min, max, pattern, patternText }) {
  if (typeof value !== 'string') return check.add(field, 'type', `must be a string, not ${describe(value)}`);
  if (!value.isWellFormed()) return check.add(field, 'json_value', 'contains a lone surrogate, which UTF-8 cannot encode');
  const length = codePoints(value);
  if (length < min || length > max) {
    return check.add(field, 'length', `must be ${min} to ${max} characters long, not ${length}`);
  }
  if (pattern && !pattern.test(value)) return check.add(field, 'pattern', `must match ${patternText ?? pattern.source}`);
  return value;
}

function checkInteger(check, field, value, raw, { min, max }) {
  if (typeof value === 'bigint') {
    return check.add(field, 'range', `must be between ${min} and ${max}`);
  }
  if (typeof value !== 'number' || !Number.isInteger(value) || (raw !== undefined && !isIntegerLiteral(raw))) {
    const written = raw !== undefined ? raw : describe(value);
    return check.add(field, 'type', `must be an integer written without fraction or exponent, not ${written}`);
  }
  if (value < min || value > max) return check.add(field, 'range', `must be between ${min} and ${max}, not ${value}`);
  return value;
}

function checkTime(check, field, value) {
  try {
    return Timestamp.parse(value).toString();
  } catch (err) {
    if (err instanceof TimeError) return check.add(field, err.rule, err.message);
    throw err;
  }
}

// Check a tree holds only JSON values and is at most maxDepth deep; the root is level 1.
function checkJsonTree(check, field, root, maxDepth) {
  const stack = [[root, field, 1]];
  while (stack.length) {
    const [value, where, level] = stack.pop();
    if (Array.isArray(value) || isPlainObject(value)) {
      if (level > maxDepth) {
        return check.add(field, 'max_depth', `nested deeper than ${maxDepth} levels at ${where}`);
      }
      if (Array.isArray(value)) {
        value.forEach((item, i) => stack.push([item, `${where}[${i}]`, level + 1]));
      } else {
        for (const key of Object.keys(value)) {
          if (!key.isWellFormed()) return check.add(field, 'json_value', `a key at ${where} contains a lone surrogate`);
          stack.push([value[key], `${where}.${key}`, level + 1]);
        }
      }
      continue;
    }
    if (value === null || typeof value === 'boolean' || typeof value === 'bigint') continue;
    if (typeof value === 'number') {
      if (!Number.isFinite(value)) return check.add(field, 'json_value', `NaN and infinity are not JSON (${where})`);
      continue;
    }
    if (typeof value === 'string') {
      if (!value.isWellFormed()) return check.add(field, 'json_value', `a string at ${where} contains a lone surrogate`);
      continue;
    }
    return check.add(field, 'json_value', `${describe(value)} at ${where} is not a JSON value`);
  }
  return root;
}

/**
 * Validate an Envelope given as JSON text (string or UTF-8 Buffer) or as an
 * already-decoded object, as a reader: task_id, trace_id and created_at must be
 * there. Returns { ok: true, envelope } with every other default filled in and
 * times in canonical form, or { ok: false, violations }.
 * Options: limits, publish (also apply the publish-time rules), now (ms).
 */
export function validateEnvelope(input, options = {}) {
  const limits = { ...DEFAULT_LIMITS, ...(options.limits ?? {}) };
  let data = input;
  let raw = null;
  if (typeof input === 'string' || Buffer.isBuffer(input)) {
    let text = input;
    if (Buffer.isBuffer(input)) {
      try {
        text = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true }).decode(input);
      } catch {
        return { ok: false, violations: [{ field: 'envelope', rule: 'json', message: 'not valid UTF-8' }] };
      }
    }
    try {
      ({ value: data, raw } = parseJson(text));
    } catch (err) {
      if (!(err instanceof JsonSyntaxError)) throw err;
      return { ok: false, violations: [{ field: 'envelope', rule: 'json', message: `not JSON: ${err.message}` }] };
    }
  }
  const check = new Check();
  if (!isPlainObject(data)) {
    check.add('envelope', 'type', `an Envelope is a JSON object, not ${describe(data)}`);
    return { ok: false, violations: check.violations };
  }
  const rawOf = (name) => (raw ? raw.get(name) : undefined);
  const has = (name) => Object.hasOwn(data, name) && data[name] !== undefined;
  const env = {};

  // task_id, trace_id and created_at are required on the wire: producers fill
  // them in (newEnvelope), a reader never invents them.
  if (!has('task_id')) check.add('task_id', 'required', REQUIRED_IDENTITY);
  else {
    env.task_id = checkString(check, 'task_id', data.task_id, { min: 1, max: 255, pattern: TOKEN_PATTERN, patternText: 'printable ASCII without spaces' });
  }
  if (!has('task_type')) check.add('task_type', 'required', 'the field is required');
  else {
    env.task_type = checkString(check, 'task_type', data.task_type, {
      min: 1, max: 255, pattern: TASK_TYPE_PATTERN, patternText: 'dotted identifiers, e.g. order.close_timeout',
    });
  }
  env.payload_version = has('payload_version')
    ? checkInteger(check, 'payload_version', data.payload_version, rawOf('payload_version'), { min: 1, max: MAX_SAFE_INTEGER })
    : 1;
  if (!has('payload')) env.payload = {};
  else if (!isPlainObject(data.payload)) check.add('payload', 'type', `must be a JSON object, not ${describe(data.payload)}`);
  else if (checkJsonTree(check, 'payload', data.payload, limits.maxPayloadDepth) !== undefined) {
    const size = Buffer.byteLength(stringifyJson(data.payload));
    if (size > limits.maxPayloadBytes) {
      check.add('payload', 'max_bytes', `payload is ${size} bytes of JSON, above the limit of ${limits.maxPayloadBytes}`);
    } else env.payload = data.payload;
  }
  env.schedule_time = has('schedule_time') && data.schedule_time !== null ? checkTime(check, 'schedule_time', data.schedule_time) : null;
  env.timeout_ms = has('timeout_ms') && data.timeout_ms !== null
    ? checkInteger(check, 'timeout_ms', data.timeout_ms, rawOf('timeout_ms'), { min: 1, max: MAX_SAFE_INTEGER })
    : null;
  env.expires = has('expires') && data.expires !== null ? checkTime(check, 'expires', data.expires) : null;
  let maxRetriesValid = true;
  if (!has('max_retries')) env.max_retries = MAX_RETRIES_DEFAULT;
  else if (data.max_retries === null) env.max_retries = null;
  else {
    const before = check.violations.length;
    env.max_retries = checkInteger(check, 'max_retries', data.max_retries, rawOf('max_retries'), { min: 0, max: MAX_SAFE_INTEGER });
    maxRetriesValid = check.violations.length === before;
  }
  env.retry_count = has('retry_count')
    ? checkInteger(check, 'retry_count', data.retry_count, rawOf('retry_count'), { min: 0, max: MAX_SAFE_INTEGER })
    : 0;
  if (maxRetriesValid && env.max_retries !== null && env.retry_count !== undefined && env.retry_count > env.max_retries) {
    check.add('retry_count', 'retry_count_le_max_retries', `retry_count (${env.retry_count}) exceeds max_retries (${env.max_retries})`);
  }
  env.priority = has('priority')
    ? checkInteger(check, 'priority', data.priority, rawOf('priority'), { min: PRIORITY_MIN, max: PRIORITY_MAX })
    : PRIORITY_DEFAULT;
  if (!has('trace_id')) check.add('trace_id', 'required', REQUIRED_IDENTITY);
  else {
    env.trace_id = checkString(check, 'trace_id', data.trace_id, { min: 1, max: 128, pattern: TOKEN_PATTERN, patternText: 'printable ASCII without spaces' });
  }
  if (!has('created_at')) check.add('created_at', 'required', REQUIRED_IDENTITY);
  else env.created_at = checkTime(check, 'created_at', data.created_at);
  env.idempotency_key = has('idempotency_key') && data.idempotency_key !== null
    ? checkString(check, 'idempotency_key', data.idempotency_key, { min: 1, max: 512 })
    : null;
  // Tasks with the same ordering_key on a queue run one at a time, in the order they joined it (section 20).
  env.ordering_key = has('ordering_key') && data.ordering_key !== null
    ? checkString(check, 'ordering_key', data.ordering_key, { min: 1, max: 255, pattern: TOKEN_PATTERN, patternText: 'printable ASCII without spaces' })
    : null;
  if (!has('headers')) env.headers = {};
  else if (!isPlainObject(data.headers)) check.add('headers', 'type', `must be an object of strings, not ${describe(data.headers)}`);
  else {
    const before = check.violations.length;
    for (const [key, value] of Object.entries(data.headers)) {
      if (typeof value !== 'string') check.add(`headers.${key}`, 'type', `header values are strings, not ${describe(value)}`);
      else if (!value.isWellFormed() || !key.isWellFormed()) check.add(`headers.${key}`, 'json_value', 'contains a lone surrogate');
    }
    if (check.violations.length === before) env.headers = data.headers;
  }
  if (!has('ext')) env.ext = {};
  else if (!isPlainObject(data.ext)) check.add('ext', 'type', `must be an object of namespaces, not ${describe(data.ext)}`);
  else {
    const before = check.violations.length;
    for (const [key, value] of Object.entries(data.ext)) {
      if (!EXT_NAMESPACE_PATTERN.test(key)) check.add(`ext.${key}`, 'pattern', `namespaces must match ${EXT_NAMESPACE_PATTERN.source}`);
      if (!isPlainObject(value)) check.add(`ext.${key}`, 'type', `each namespace holds an object, not ${describe(value)}`);
    }
    if (check.violations.length === before && checkJsonTree(check, 'ext', data.ext, EXT_MAX_DEPTH) !== undefined) {
      env.ext = data.ext;
    }
  }
  for (const key of Object.keys(data)) {
    if (!KNOWN.has(key)) check.add(key, 'unknown_field', 'not an Envelope field (language-specific data goes under ext)');
  }
  if (check.violations.length === 0 && options.publish) {
    checkPublishRules(check, env, limits, options.now ?? Date.now());
  }
  if (check.violations.length) return { ok: false, violations: check.violations };
  return { ok: true, envelope: env };
}

function checkPublishRules(check, env, limits, nowMs) {
  if (env.schedule_time === null) return;
  const due = Timestamp.parse(env.schedule_time);
  if (due.epochMs > nowMs + limits.maxDelayMs) {
    check.add('schedule_time', 'max_delay',
      `${env.schedule_time} is more than ${limits.maxDelayMs / 86_400_000} days (the maximum delay) ahead of now`);
  }
}

/** The publish-time rules alone, on a valid Envelope: [] or [violation]. */
export function publishViolations(env, options = {}) {
  const check = new Check();
  checkPublishRules(check, env, { ...DEFAULT_LIMITS, ...(options.limits ?? {}) }, options.now ?? Date.now());
  return check.violations;
}

/** Validate or throw InvalidEnvelope; returns the normalized Envelope. */
export function parseEnvelope(input, options = {}) {
  const result = validateEnvelope(input, options);
  if (!result.ok) throw new InvalidEnvelope(result.violations);
  return result.envelope;
}

/** A new task_id: a random UUID. */
export function newTaskId() {
  return crypto.randomUUID();
}

/** A new trace_id: 32 random hex digits (use the trace id of the request being served when there is one). */
export function newTraceId() {
  return crypto.randomUUID().replaceAll('-', '');
}

/**
 * Build a new Envelope from fields, as a producer: task_id, trace_id and
 * created_at are filled in when absent (they are required on the wire), every
 * other default too. Throws InvalidEnvelope.
 */
export function newEnvelope(fields, options = {}) {
  const given = (name) => Object.hasOwn(fields, name) && fields[name] !== undefined;
  const filled = { ...fields };
  if (!given('task_id')) filled.task_id = newTaskId();
  if (!given('trace_id')) filled.trace_id = newTraceId();
  if (!given('created_at')) filled.created_at = Timestamp.now().toString();
  return parseEnvelope(filled, options);
}

/** Canonical compact JSON (fields in protocol order, null optional fields left out). */
export function envelopeToJson(env) {
  const out = {};
  for (const name of FIELDS) {
    const value = env[name];
    if (value === undefined || (value === null && NULL_BY_DEFAULT.has(name))) continue;
    out[name] = value;
  }
  return stringifyJson(out);
}

/** Due time in ms since the epoch: schedule_time, or now when there is none. */
export function dueMs(env, nowMs = Date.now()) {
  return env.schedule_time === null || env.schedule_time === undefined
    ? nowMs
    : Timestamp.parse(env.schedule_time).epochMs;
}

/** True when the task carries `expires` and it is at or before nowMs (section 5.1, step 3). */
export function isExpired(env, nowMs = Date.now()) {
  return env.expires !== null && env.expires !== undefined && Timestamp.parse(env.expires).epochMs <= nowMs;
}

/** True when the task may run at nowMs. */
export function isDue(env, nowMs = Date.now()) {
  return dueMs(env, nowMs) <= nowMs;
}
