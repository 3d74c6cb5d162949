// The dead-letter tools as a library (docs/protocol.md, dead letters): list and show the
// entries of <prefix>:{<queue>}:dead, and replay one, edited first, with replay.lua, which
// publishes it and moves the entry to <prefix>:{<queue>}:replayed in one step (two
// operators replaying the same entry publish it once). The same operations as the Python
// tools (kombu_envelope.store.dead_letters.DeadLetters), on the same keys.

import os from 'node:os';
import { DEFAULT_GZIP_MIN_BYTES, MalformedEntry, decodeEntry, encodeBody } from './codec.js';
import { DEFAULT_LIMITS, envelopeToJson, newEnvelope } from './envelope.js';
import { parseJson } from './json.js';
import { KeySpace, bucketFor } from './keys.js';
import { TaskRecords, publishedFields, withRecord } from './records.js';
import { registerThen } from './registry.js';
import { PayloadSchemas } from './schemas.js';
import { Scripts } from './scripts.js';
import { Timestamp } from './time.js';
import { closeClient, isRedisClient, openConnection } from './connection.js';
import { createLogger } from './log.js';
const text = (value) => (Buffer.isBuffer(value) ? value.toString('utf8') : String(value));

/** RFC 7386 JSON merge patch of `target` by `patch`. */
export function jsonMergePatch(target, patch) {
  if (patch === null || typeof patch !== 'object' || Array.isArray(patch)) return patch;
  const result = target !== null && typeof target === 'object' && !Array.isArray(target) ? { ...target } : {};
  for (const [key, value] of Object.entries(patch)) {
    if (value === null) delete result[key];
    else result[key] = jsonMergePatch(result[key], value);
  }
  return result;
}

/**
 * One dead-letter entry.
 * @typedef {{ queue: string, id: string, fields: Record<string, string>, raw: Record<string, Buffer>,
 *   envelope: object | null, decodeError: string | null, failureClass: string, taskType: string | null,
 *   taskId: string | null, deadAt: Date }} DeadLetter
 */

/**
 * How to change a dead-lettered Envelope before it is published again: `payload`
 * replaces the payload, `mergePatch` is applied to it (RFC 7386), `payloadVersion`
 * sets the version (`bumpVersion` adds one instead), `retryCount` (default 0) and
 * `maxRetries` override those fields. A replay runs now: `schedule_time` is dropped.
 * @typedef {{ payload?: object, mergePatch?: object, payloadVersion?: number, bumpVersion?: boolean,
 *   retryCount?: number, maxRetries?: number | null, operator?: string }} ReplayEdit
 */

export class DeadLetters {
  /**
   * new DeadLetters({ connection, prefix }) or new DeadLetters(client, { prefix });
   * connection: an ioredis client or Cluster, a Redis URL (any form of src/url.js) or ioredis options.
   * Connection errors of a connection opened here go to `logger` (JSON lines on stderr by default).
   * taskRecordRetentionMs and schemaCacheMs as for the Producer: a replay is a
   * publish, which writes the task record and enforces the payload schema.
   * @param {any} clientOrOptions
   * @param {{ prefix?: string, limits?: object, gzipMinBytes?: number, logger?: any,
   *   taskRecordRetentionMs?: number, schemaCacheMs?: number }} [options]
   */
  constructor(clientOrOptions, options = {}) {
    const direct = isRedisClient(clientOrOptions);
    const { connection, ...rest } = direct ? {} : clientOrOptions ?? {};
    const opts = direct ? options : rest;
    const log = opts.logger ?? createLogger();
    const { client, owned } = openConnection(direct ? clientOrOptions : connection, 'envelope-node-dead-letters', log);
    this.client = client;
    this.owned = owned;
    this.keys = new KeySpace(opts.prefix);
    this.limits = { ...DEFAULT_LIMITS, ...(opts.limits ?? {}) };
    this.gzipMinBytes = opts.gzipMinBytes ?? DEFAULT_GZIP_MIN_BYTES;
    this.scripts = new Scripts(this.client);
    this.records = new TaskRecords(opts.taskRecordRetentionMs);
    this.schemas = new PayloadSchemas({ client, keys: this.keys, cacheMs: opts.schemaCacheMs, log });
  }

  /** Queues that have had dead-letter entries (<prefix>:dead-queues), sorted. */
  async queues() {
    return (await this.client.smembers(this.keys.deadQueues)).sort();
  }

  /**
   * Entries of `queue`, oldest first, that match every given criterion.
   * @param {string} queue
   * @param {{ taskType?: string, failureClass?: string, since?: Date, until?: Date, limit?: number }} [where]
   * @returns {Promise<DeadLetter[]>}
   */
  async list(queue, { taskType, failureClass, since, until, limit = 100 } = {}) {
    const stream = this.keys.queue(queue).dead;
    let low = since ? String(since.getTime()) : '-';
    const high = until ? String(until.getTime()) : '+';
    const found = [];
    const batch = 200;
    for (;;) {
      const entries = await this.client.xrangeBuffer(stream, low, high, 'COUNT', batch);
      for (const [id, flat] of entries) {
        const entry = this.entry(queue, text(id), flat);
        if ((taskType === undefined || entry.taskType === taskType) &&
            (failureClass === undefined || entry.failureClass === failureClass)) {
          found.push(entry);
          if (found.length >= limit) return found;
        }
      }
      if (entries.length < batch) return found;
      low = `(${text(entries[entries.length - 1][0])}`;
    }
  }

  /**
   * Counts per queue, task type and failure class of the matching entries of `queues`
   * (default: every queue with dead letters), as [{ queue, taskType, failureClass, count }].
   * @param {string[]} [queues]
   * @param {{ taskType?: string, failureClass?: string, since?: Date, until?: Date }} [where]
   */
  async stats(queues, where = {}) {
    const counts = new Map();
    for (const queue of queues ?? await this.queues()) {
      for (const entry of await this.list(queue, { ...where, limit: Infinity })) {
        const key = JSON.stringify([queue, entry.taskType ?? '?', entry.failureClass]);
        counts.set(key, (counts.get(key) ?? 0) + 1);
      }
    }
    return [...counts].map(([key, count]) => {
      const [queue, taskType, failureClass] = JSON.parse(key);
      return { queue, taskType, failureClass, count };
    });
  }

  /**
   * Delete the matching entries of `queue`; returns how many.
   * @param {string} queue
   * @param {{ taskType?: string, failureClass?: string, since?: Date, until?: Date }} [where]
   * @returns {Promise<number>}
   */
  async purge(queue, where = {}) {
    const ids = (await this.list(queue, { ...where, limit: Infinity })).map((entry) => entry.id);
    for (let i = 0; i < ids.length; i += 500) await this.client.xdel(this.keys.queue(queue).dead, ...ids.slice(i, i + 500));
    return ids.length;
  }

  /**
   * One entry by id, or null.
   * @returns {Promise<DeadLetter | null>}
   */
  async get(queue, id) {
    const entries = await this.client.xrangeBuffer(this.keys.queue(queue).dead, id, id);
    return entries.length ? this.entry(queue, id, entries[0][1]) : null;
  }

  /**
   * Publish a dead-lettered task again, edited first; returns the new stream entry id,
   * "waiting" for a task with an ordering_key whose key's turn has not come (section 20;
   * the replay of the head its key halted for runs again as the head), or null when the
   * entry is gone (replayed or purged by someone else first). Throws
   * InvalidEnvelope when the edited Envelope breaks a rule (its payload schema included), MalformedEntry when the
   * entry holds no valid Envelope.
   * @param {string} queue
   * @param {string} id
   * @param {ReplayEdit} [edit]
   * @returns {Promise<string | null>}
   */
  async replay(queue, id, edit = {}) {
    const entry = await this.get(queue, id);
    if (entry === null) return null;
    if (entry.envelope === null) {
      throw new MalformedEntry('envelope', `dead-letter entry ${id} holds no valid Envelope: ${entry.decodeError}`);
    }
    const envelope = this.edited(entry.envelope, edit);
    await this.schemas.check(envelope);
    const { enc, body } = encodeBody(envelope, { gzipMinBytes: this.gzipMinBytes, limits: this.limits });
    const qk = this.keys.queue(queue);
    const operator = edit.operator ?? `${os.userInfo().username}@${os.hostname()}`;
    const [keys, args] = withRecord(this.records.active(qk, envelope.task_id, 0, publishedFields(envelope, queue)),
      [qk.dead, qk.stream(bucketFor(envelope.priority)), qk.replayed],
      [id, enc, body, 'replayed_at', Timestamp.now().toString(), 'operator', operator], 3);
    // A keyed task registers its queue first, as a publish does: promoters release it (section 20).
    const run = () => this.scripts.run('replay', keys, args);
    const reply = await (envelope.ordering_key !== null ? registerThen(this.client, this.keys.queues, queue, run) : run());
    return reply ? text(reply) : null;
  }

  /** The Envelope a replay publishes: `edit` applied, checked with the publish rules. */
  edited(envelope, { payload, mergePatch, payloadVersion, bumpVersion = false, retryCount = 0, maxRetries } = {}) {
    const data = parseJson(envelopeToJson(envelope)).value;
    if (payload !== undefined) data.payload = payload;
    if (mergePatch !== undefined) data.payload = jsonMergePatch(data.payload ?? {}, mergePatch);
    if (payloadVersion !== undefined) data.payload_version = payloadVersion;
    else if (bumpVersion) data.payload_version = envelope.payload_version + 1;
    if (maxRetries !== undefined) data.max_retries = maxRetries;
    data.retry_count = retryCount;
    delete data.schedule_time;
    return newEnvelope(data, { limits: this.limits, publish: true });
  }

  /** Close the connection when it was opened here. */
  async close() {
    if (this.owned) await closeClient(this.client);
  }

  entry(queue, id, flat) {
    return readDeadLetter(queue, id, flat, this.limits);
  }
}

/**
 * A dead-letter entry from its XRANGE reply ([name, value, ...]): the failure
 * fields, the original entry's raw fields and its Envelope (null, with
 * decodeError, when it cannot be decoded).
 * @returns {DeadLetter}
 */
export function readDeadLetter(queue, id, flat, limits = DEFAULT_LIMITS) {
  const fields = {};
  const raw = {};
  for (let i = 0; i + 1 < flat.length; i += 2) {
    const name = text(flat[i]);
    if (name.startsWith('raw.')) raw[name.slice(4)] = flat[i + 1];
    else fields[name] = text(flat[i + 1]);
  }
  let envelope = null;
  let decodeError = null;
  try {
    envelope = decodeEntry(raw, { limits });
  } catch (err) {
    if (!(err instanceof MalformedEntry)) throw err;
    decodeError = err.reason ?? err.message;
  }
  return {
    queue, id, fields, raw, envelope, decodeError,
    failureClass: fields.failure_class ?? '',
    taskType: envelope ? envelope.task_type : fields.task_type ?? null,
    taskId: envelope ? envelope.task_id : fields.task_id ?? null,
    deadAt: new Date(Number(id.split('-')[0])),
  };
}
