// Publishing (docs/protocol.md section 4): fill in the identity (task_id,
// trace_id, created_at) when absent, validate (publish rules included), encode,
// then enqueue.lua into the priority bucket's stream when due (it removes a
// delayed copy of the same task_id), or SADD <prefix>:queues + schedule.lua
// into the delayed set, in one round trip, when ahead. cancel() marks a task_id
// cancelled for every queue (src/cancel.js).

import crypto from 'node:crypto';
import { cancelTask } from './cancel.js';
import { encodeBody, DEFAULT_GZIP_MIN_BYTES } from './codec.js';
import { DEFAULT_LIMITS, Timestamp, dueMs, isDue, newEnvelope } from './envelope.js';
import { KeySpace, bucketFor } from './keys.js';
import Redis from 'ioredis';
import { Scripts } from './scripts.js';
import { parseRedisUrl } from './url.js';

/** How long enqueue.lua and schedule.lua remember a publish token (ms, docs/protocol.md section 4). */
export const PUBLISH_DEDUPE_MS = 90_000;

/** A new publish token: one per publish, the same for every try of it. */
export const publishToken = () => crypto.randomBytes(8).toString('hex');

/** `fields` with `expires` = now + expiresInMs (UTC) when that option is given. */
function withExpiry(fields, expiresInMs, nowMs) {
  if (expiresInMs === undefined) return fields;
  if (!Number.isSafeInteger(expiresInMs) || expiresInMs < 0) {
    throw new RangeError(`expiresInMs must be an integer number of milliseconds >= 0, not ${expiresInMs}`);
  }
  if (fields.expires !== undefined && fields.expires !== null) {
    throw new TypeError('give the expires field or the expiresInMs option, not both');
  }
  return { ...fields, expires: Timestamp.fromEpochMs(nowMs + expiresInMs) };
}

/** An ioredis client or Cluster (anything with defineCommand). */
const isClient = (value) => value !== null && typeof value === 'object' && typeof value.defineCommand === 'function';

export class Producer {
  /**
   * Two forms:
   *
   *   new Producer({ connection, prefix })   // connection: ioredis client or Cluster, redis:// URL, or ioredis options
   *   new Producer(client, { prefix })       // client: an ioredis client or Cluster
   *
   * A connection the producer opened itself (URL or options) is closed by
   * close(); a client that was given stays open.
   * @param {any} clientOrOptions
   * @param {{ prefix?: string, limits?: object, gzipMinBytes?: number, scripts?: any }} [options]
   */
  constructor(clientOrOptions, options = {}) {
    let client;
    let opts;
    if (isClient(clientOrOptions)) {
      client = clientOrOptions;
      opts = options;
    } else {
      const { connection, ...rest } = clientOrOptions ?? {};
      opts = rest;
      if (isClient(connection)) {
        client = connection;
      } else {
        const base = typeof connection === 'string' ? parseRedisUrl(connection) : { ...(connection ?? {}) };
        client = new Redis({ connectionName: 'envelope-node-producer', ...base });
        this.owned = true;
      }
    }
    const { prefix, limits = DEFAULT_LIMITS, gzipMinBytes = DEFAULT_GZIP_MIN_BYTES, scripts } = opts;
    this.client = client;
    this.keys = new KeySpace(prefix);
    this.limits = { ...DEFAULT_LIMITS, ...limits };
    this.gzipMinBytes = gzipMinBytes;
    this.scripts = scripts ?? new Scripts(client);
  }

  /**
   * The Envelope publish() would write: identity filled in, `expiresInMs`
   * turned into `expires`, every publish rule checked.
   * @param {object} fields
   * @param {PublishOptions} [options]
   */
  prepare(fields, { nowMs = Date.now(), expiresInMs } = {}) {
    return newEnvelope(withExpiry(fields, expiresInMs, nowMs), { limits: this.limits, publish: true, now: nowMs });
  }

  /**
   * Publish one task. `fields` are Envelope fields (task_type required; times
   * as RFC 3339 strings with offset, or Timestamp objects; task_id, trace_id
   * and created_at are filled in when absent; `expires` is the instant after
   * which the task must not start). Throws InvalidEnvelope before anything
   * reaches Redis when a rule is broken.
   * Options: nowMs, expiresInMs (sets `expires` to now + this many ms, in UTC).
   * Returns { taskId, envelope, entryId (null when delayed), delayed, dueMs }.
   * @typedef {{ nowMs?: number, expiresInMs?: number }} PublishOptions
   * @param {string} queue
   * @param {object} fields
   * @param {PublishOptions} [options]
   * @returns {Promise<PublishResult>}
   */
  async publish(queue, fields, { nowMs = Date.now(), expiresInMs } = {}) {
    return this.write(queue, this.prepare(fields, { nowMs, expiresInMs }), nowMs);
  }

  /**
   * Publish several tasks to one queue. Every Envelope is built and checked
   * first: when one breaks a rule, InvalidEnvelope is thrown and nothing is
   * written. Each task is then written on its own (one script call each, sent
   * together); results are in the order of `list`.
   * `expiresInMs` applies to each.
   * @param {string} queue
   * @param {object[]} list
   * @param {PublishOptions} [options]
   * @returns {Promise<PublishResult[]>}
   */
  async publishMany(queue, list, { nowMs = Date.now(), expiresInMs } = {}) {
    const envelopes = list.map((fields) => this.prepare(fields, { nowMs, expiresInMs }));
    return Promise.all(envelopes.map((envelope) => this.write(queue, envelope, nowMs)));
  }

  /**
   * Cancel a task by its task_id (docs/protocol.md section 10): mark it in
   * <prefix>:cancelled, then remove it from the delayed set of every queue in
   * <prefix>:queues, or of `queue` only when given. A consumer that receives a
   * marked task acknowledges it without running it, for 7 days.
   * Answers { outcome: 'removed', queue } when it was delayed there, else
   * { outcome: 'marked' | 'already', queue: null }.
   * @param {string} taskId
   * @param {{ queue?: string, nowMs?: number }} [options]
   * @returns {Promise<import('./cancel.js').CancelResult>}
   */
  async cancel(taskId, options = {}) {
    return cancelTask(this.client, this.scripts, this.keys, taskId, options);
  }

  /** Close the connection when the producer opened it. */
  async close() {
    if (this.owned) await this.client.quit().catch(() => this.client.disconnect());
  }

  /**
   * @typedef {{ taskId: string, envelope: object, entryId: string | null, delayed: boolean, dueMs: number }} PublishResult
   * @returns {Promise<PublishResult>}
   */
  async write(queue, envelope, nowMs) {
    const qk = this.keys.queue(queue);
    const { enc, body } = encodeBody(envelope, { gzipMinBytes: this.gzipMinBytes, limits: this.limits });
    const bucket = bucketFor(envelope.priority);
    if (isDue(envelope, nowMs)) {
      // enqueue.lua: an XADD that also removes a delayed copy of the same task_id,
      // so a task first scheduled and then published to run now is delivered once.
      const entryId = await this.scripts.run('enqueue',
        [qk.stream(bucket), qk.delayed, qk.delayedData, qk.published(envelope.task_id)],
        [envelope.task_id, enc, body, publishToken(), PUBLISH_DEDUPE_MS]);
      return { taskId: envelope.task_id, envelope, entryId, delayed: false, dueMs: nowMs };
    }
    // Register the queue on every delayed publish, in the same round trip and
    // before schedule.lua wakes the promoters: a registry lost with a Redis
    // restart is rebuilt by the next publish.
    const due = dueMs(envelope, nowMs);
    const pipeline = this.client.pipeline().sadd(this.keys.queues, queue);
    this.scripts.run('schedule', [qk.delayed, qk.delayedData, qk.published(envelope.task_id)],
      [envelope.task_id, due, bucket, enc, body, this.keys.wakeup, publishToken(), PUBLISH_DEDUPE_MS],
      pipeline);
    for (const [err] of await pipeline.exec()) if (err) throw err;
    return { taskId: envelope.task_id, envelope, entryId: null, delayed: true, dueMs: due };
  }
}
