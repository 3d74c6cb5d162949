// Limits per task type (docs/protocol.md section 19): the configuration operators and
// producers write, one JSON object per task type in the hash <prefix>:{<queue>}:limits.
//
//   concurrency  integer >= 1: attempts of the type running at once on the queue
//   rate         number > 0: starts per second (GCRA)
//   burst        integer >= 1: starts allowed back to back above the rate
//   smooth       boolean: every start spaced evenly
//
// At least one of concurrency and rate (kombu_envelope/schemas/limits.schema.json).
// read.lua enforces them; a change takes effect at each consumer's next read.

import { KeySpace } from './keys.js';

/** The reserved consumer that holds parked entries: never a worker's name, never taken over. */
export const PARKED_CONSUMER = 'parked';

/** What each member must be: its JSON type, and its minimum (exclusive for rate). */
const MEMBERS = Object.freeze({
  burst: { type: 'integer', minimum: 1 },
  concurrency: { type: 'integer', minimum: 1 },
  rate: { type: 'number', minimum: 0, exclusive: true },
  smooth: { type: 'boolean' },
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

const isType = (type, value) => {
  if (type === 'boolean') return typeof value === 'boolean';
  if (typeof value !== 'number' || !Number.isFinite(value)) return false;
  return type === 'number' || Number.isInteger(value);
};

/**
 * The limits of one task type, checked against the schema: unknown members first,
 * then each member's type and minimum, then that concurrency or rate is given.
 * Returns a copy with only the members given, in name order; throws InvalidLimits.
 * @typedef {{ concurrency?: number, rate?: number, burst?: number, smooth?: boolean }} Limits
 * @param {unknown} value
 * @returns {Limits}
 */
export function validateLimits(value) {
  if (value === null || typeof value !== 'object' || Array.isArray(value)) {
    throw new InvalidLimits('', 'type', `must be a JSON object, not ${Array.isArray(value) ? 'an array' : JSON.stringify(value)}`);
  }
  const unknown = Object.keys(value).filter((name) => !Object.hasOwn(MEMBERS, name));
  if (unknown.length) {
    throw new InvalidLimits(unknown[0], 'unknown_field', `unknown member (known: ${Object.keys(MEMBERS).join(', ')})`);
  }
  const out = {};
  for (const [name, rule] of Object.entries(MEMBERS)) {
    if (!Object.hasOwn(value, name)) continue;
    const given = value[name];
    if (!isType(rule.type, given)) throw new InvalidLimits(name, 'type', `must be ${rule.type === 'integer' ? 'an integer' : `a ${rule.type}`}, not ${JSON.stringify(given)}`);
    if (rule.minimum !== undefined && (rule.exclusive ? given <= rule.minimum : given < rule.minimum)) {
      throw new InvalidLimits(name, 'minimum', `must be ${rule.exclusive ? '>' : '>='} ${rule.minimum}, not ${given}`);
    }
    out[name] = given;
  }
  if (out.concurrency === undefined && out.rate === undefined) {
    throw new InvalidLimits('concurrency', 'required', 'give concurrency, rate or both');
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
