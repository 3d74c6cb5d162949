// Limits per task type (docs/protocol.md section 19): the configuration operators and
// producers write, one JSON object per task type in the hash <prefix>:{<queue>}:limits.
//
//   concurrency  integer >= 1: attempts of the type running at once on the queue
//   rate         number > 0: starts per second (GCRA)
//   burst        integer >= 1: starts allowed back to back above the rate
//   smooth       boolean: every start spaced evenly
//   breaker      object: a circuit breaker, failure_ratio (0 < r <= 1, required),
//                min_attempts, window_s, cooldown_s, probes
//
// At least one of concurrency, rate and breaker (kombu_envelope/schemas/limits.schema.json).
// read.lua enforces them; a change takes effect at each consumer's next read.

import { KeySpace } from './keys.js';

/** The reserved consumer that holds parked entries: never a worker's name, never taken over. */
export const PARKED_CONSUMER = 'parked';

/**
 * What an object must hold: each member's JSON type, minimum (exclusive when
 * `exclusive`), maximum and, for an object, its own members; the members required.
 */
const BREAKER = Object.freeze({
  members: {
    cooldown_s: { type: 'number', minimum: 0, exclusive: true },
    failure_ratio: { type: 'number', minimum: 0, exclusive: true, maximum: 1 },
    min_attempts: { type: 'integer', minimum: 1 },
    probes: { type: 'integer', minimum: 1 },
    window_s: { type: 'number', minimum: 0, exclusive: true },
  },
  required: ['failure_ratio'],
});

const LIMITS = Object.freeze({
  members: {
    breaker: { type: 'object', ...BREAKER },
    burst: { type: 'integer', minimum: 1 },
    concurrency: { type: 'integer', minimum: 1 },
    rate: { type: 'number', minimum: 0, exclusive: true },
    smooth: { type: 'boolean' },
  },
  required: [],
});

/** Limits that break the schema: `field` names the member ('' for the whole value), `rule` the rule broken. */
export class InvalidLimits extends Error {
  constructor(field, rule, message) {
    super(`limits${field ? `.${field}` : ''}: ${rule}: ${message}`);
    this.name = 'InvalidLimits';
    this.field = field;
    this.rule = rule;
  }
}

const isObject = (value) => value !== null && typeof value === 'object' && !Array.isArray(value);

const isType = (type, value) => {
  if (type === 'object') return isObject(value);
  if (type === 'boolean') return typeof value === 'boolean';
  if (typeof value !== 'number' || !Number.isFinite(value)) return false;
  return type === 'number' || Number.isInteger(value);
};

const A_TYPE = { integer: 'an integer', number: 'a number', boolean: 'a boolean', object: 'a JSON object' };

/**
 * `value` checked against `spec` (LIMITS or BREAKER), its members named `<path><name>`:
 * unknown members first, then each member's type, minimum and maximum (an object's
 * own members within), then the required ones. A copy with the members given, in name order.
 */
function checkObject(value, spec, path) {
  const unknown = Object.keys(value).filter((name) => !Object.hasOwn(spec.members, name));
  if (unknown.length) {
    throw new InvalidLimits(path + unknown[0], 'unknown_field', `unknown member (known: ${Object.keys(spec.members).join(', ')})`);
  }
  const out = {};
  for (const [name, rule] of Object.entries(spec.members)) {
    if (!Object.hasOwn(value, name)) continue;
    const field = path + name;
    const given = value[name];
    if (!isType(rule.type, given)) throw new InvalidLimits(field, 'type', `must be ${A_TYPE[rule.type]}, not ${JSON.stringify(given)}`);
    if (rule.minimum !== undefined && (rule.exclusive ? given <= rule.minimum : given < rule.minimum)) {
      throw new InvalidLimits(field, 'minimum', `must be ${rule.exclusive ? '>' : '>='} ${rule.minimum}, not ${given}`);
    }
    if (rule.maximum !== undefined && given > rule.maximum) {
      throw new InvalidLimits(field, 'maximum', `must be <= ${rule.maximum}, not ${given}`);
    }
    out[name] = rule.members ? checkObject(given, rule, `${field}.`) : given;
  }
  const missing = spec.required.find((name) => !Object.hasOwn(out, name));
  if (missing) throw new InvalidLimits(path + missing, 'required', 'must be given');
  return out;
}

/**
 * A circuit breaker: the failure ratio that opens it, and the attempts, window (s), cool-down (s) and probes it uses.
 * @typedef {{ failure_ratio: number, min_attempts?: number, window_s?: number, cooldown_s?: number, probes?: number }} Breaker
 */

/**
 * The limits of one task type on one queue.
 * @typedef {{ concurrency?: number, rate?: number, burst?: number, smooth?: boolean, breaker?: Breaker }} Limits
 */

/**
 * The limits of one task type, checked against the schema: unknown members first,
 * then each member's type, minimum and maximum (the breaker's members within: unknown,
 * type, minimum, maximum, then failure_ratio required), then that concurrency, rate
 * or breaker is given. Returns a copy with only the members given, in name order at
 * each level; throws InvalidLimits.
 * @param {unknown} value
 * @returns {Limits}
 */
export function validateLimits(value) {
  if (!isObject(value)) {
    throw new InvalidLimits('', 'type', `must be a JSON object, not ${Array.isArray(value) ? 'an array' : JSON.stringify(value)}`);
  }
  const out = checkObject(value, LIMITS, '');
  if (out.concurrency === undefined && out.rate === undefined && out.breaker === undefined) {
    throw new InvalidLimits('concurrency', 'required', 'give concurrency, rate or breaker (or several)');
  }
  return out;
}

/** The canonical JSON of valid limits: compact, only the members given, in name order. */
export function limitsToJson(value) {
  return JSON.stringify(validateLimits(value));
}

const taskTypeOf = (taskType) => {
  if (typeof taskType !== 'string' || !taskType) throw new TypeError('the task type must be a non-empty string');
  return taskType;
};

/**
 * A stored value back as an object; one that is not JSON (which read.lua ignores:
 * that type is not limited) fails naming its queue and task type.
 */
function parseStored(queue, taskType, text) {
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new Error(`the limits of ${taskType} on queue ${queue} are not JSON (read.lua ignores them): ${err.message}`);
  }
}

/** Set, read and remove the limits of task types, queue by queue, on one ioredis client or Cluster. */
export class TaskLimits {
  /**
   * @param {any} client
   * @param {{ prefix?: string }} [options]
   */
  constructor(client, { prefix } = {}) {
    this.client = client;
    this.keys = new KeySpace(prefix);
  }

  /**
   * Validate `limits` and store them for `taskType` on `queue` (HSET), replacing
   * any before; InvalidLimits before anything is written. Returns the JSON stored.
   * @param {string} queue
   * @param {string} taskType
   * @param {Limits} limits
   * @returns {Promise<string>}
   */
  async set(queue, taskType, limits) {
    const key = this.keys.queue(queue).limits;
    const json = limitsToJson(limits);
    await this.client.hset(key, taskTypeOf(taskType), json);
    return json;
  }

  /**
   * The limits of `taskType` on `queue`, or null when it has none.
   * @returns {Promise<Limits | null>}
   */
  async get(queue, taskType) {
    const text = await this.client.hget(this.keys.queue(queue).limits, taskTypeOf(taskType));
    return text === null ? null : parseStored(queue, taskType, text);
  }

  /**
   * Every limited task type of `queue` with its limits.
   * @returns {Promise<Record<string, Limits>>}
   */
  async list(queue) {
    const all = await this.client.hgetall(this.keys.queue(queue).limits);
    return Object.fromEntries(Object.entries(all).map(([taskType, text]) => [taskType, parseStored(queue, taskType, text)]));
  }

  /**
   * Remove the limits of `taskType` on `queue` (HDEL); true when it had some.
   * @returns {Promise<boolean>}
   */
  async remove(queue, taskType) {
    return Number(await this.client.hdel(this.keys.queue(queue).limits, taskTypeOf(taskType))) === 1;
  }
}
