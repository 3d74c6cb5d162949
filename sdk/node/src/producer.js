// Publishing (docs/protocol.md section 4): fill in the identity (task_id,
// trace_id, created_at) when absent, validate (publish rules included), encode,
// then enqueue.lua into the priority bucket's stream when due (it removes a
// delayed copy of the same task_id), or SADD <prefix>:queues, then schedule.lua
// into the delayed set, when ahead. Each try of a publish sends the same publish
// token, so a publish retried while Redis is away (a failover) is stored once.
// With waitReplicas, WAIT follows every publish. cancel() marks a task_id
// cancelled for every queue (src/cancel.js).
// Before writing, payloads are checked against their schemas (src/schemas.js)
// and, with requireServed, against what the queue's workers announce
// (src/announce.js). Each publish writes its task record (src/records.js) and
// carries the current trace context in headers.traceparent (src/tracing.js).
// taskLimits sets and reads the limits per task type of section 19 (src/limits.js).
// A keyed task (ordering_key, section 20) registers its queue in <prefix>:queues like a
// delayed one, so promoters release it when its turn comes; enqueue.lua answers
// "waiting" when that turn has not come yet.

import crypto from 'node:crypto';
import { notServed, readAnnouncements } from './announce.js';
import { cancelTask } from './cancel.js';
import { encodeBody, DEFAULT_GZIP_MIN_BYTES } from './codec.js';
import { DEFAULT_LIMITS, Timestamp, dueMs, isDue, newEnvelope } from './envelope.js';
import { closeClient, isRedisClient, openConnection } from './connection.js';
import { KeySpace, bucketFor } from './keys.js';
import { TaskLimits } from './limits.js';
import { createLogger } from './log.js';
import { OUTAGE_TOLERANCE_MS, retryWhileAway } from './outage.js';
import { TaskRecords, publishedFields, recordTime, withRecord } from './records.js';
import { registerThen } from './registry.js';
import { ReplicaWait } from './replicas.js';
import { PayloadSchemas, SCHEMA_CACHE_MS } from './schemas.js';
import { Scripts } from './scripts.js';
import { getTask } from './tasks.js';
import { PublishTrace } from './tracing.js';

/** How long enqueue.lua and schedule.lua remember a publish token (ms, docs/protocol.md section 4). */
export const PUBLISH_DEDUPE_MS = 90_000;

/** What enqueue.lua and replay.lua answer for a keyed task whose turn has not come (section 20). */
export const WAITING = 'waiting';

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

export class Producer {
  /**
   * Two forms:
   *
   *   new Producer({ connection, prefix })   // connection: ioredis client (Sentinel-managed or not) or Cluster,
   *                                          // a Redis URL (src/url.js: redis, sentinel, cluster), or ioredis options
   *   new Producer(client, { prefix })       // client: an ioredis client or Cluster
   *
   * A connection the producer opened itself (URL or options) is closed by
   * close(); a client that was given stays open.
   * Options: prefix, limits, gzipMinBytes, outageToleranceMs (how long a
   * publish is retried while Redis is away), waitReplicas and waitTimeoutMs
   * (WAIT for that many replicas after each publish; 0: no wait), logger,
   * taskRecordRetentionMs (task_record_retention: how long the record of a
   * finished task is kept, default 3,600,000; 0 writes no records),
   * schemaCacheMs (schema_cache_s: how long payload schemas read from Redis
   * are used, default 30,000), requireServed (refuse a task that no live or
   * recently seen worker of its queue serves, with NotServed; default false).
   * @param {any} clientOrOptions
   * @param {ProducerOptions} [options]
   * @typedef {{ prefix?: string, limits?: object, gzipMinBytes?: number, scripts?: any, outageToleranceMs?: number,
   *   waitReplicas?: number, waitTimeoutMs?: number, logger?: any, taskRecordRetentionMs?: number,
   *   schemaCacheMs?: number, requireServed?: boolean }} ProducerOptions
   */
  constructor(clientOrOptions, options = {}) {
    const direct = isRedisClient(clientOrOptions);
    const { connection, ...rest } = direct ? {} : clientOrOptions ?? {};
    const opts = direct ? options : rest;
    const {
      prefix, limits = DEFAULT_LIMITS, gzipMinBytes = DEFAULT_GZIP_MIN_BYTES, scripts,
      outageToleranceMs = OUTAGE_TOLERANCE_MS, waitReplicas = 0, waitTimeoutMs = 1000, logger,
      taskRecordRetentionMs, schemaCacheMs = SCHEMA_CACHE_MS, requireServed = false,
    } = opts;
    this.log = logger ?? createLogger();
    const { client, owned } = openConnection(direct ? clientOrOptions : connection, 'envelope-node-producer', this.log);
    this.owned = owned;
    this.client = client;
    this.outageToleranceMs = outageToleranceMs;
    this.replicas = new ReplicaWait({ replicas: waitReplicas, timeoutMs: waitTimeoutMs, log: this.log });
    this.keys = new KeySpace(prefix);
    this.limits = { ...DEFAULT_LIMITS, ...limits };
    this.gzipMinBytes = gzipMinBytes;
    this.scripts = scripts ?? new Scripts(client);
    this.records = new TaskRecords(taskRecordRetentionMs);
    this.schemas = new PayloadSchemas({ client, keys: this.keys, cacheMs: schemaCacheMs, log: this.log });
    this.requireServed = requireServed === true;
    /** The limits per task type of each queue (section 19): set, get, list, remove. */
    this.taskLimits = new TaskLimits(client, { prefix });
  }

  /**
   * The Envelope publish() would write: identity filled in, `expiresInMs`
   * turned into `expires`, every publish rule checked; publish() adds the
   * current trace context first (headers.traceparent, section 18).
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
   * Returns { taskId, envelope, entryId (null when delayed), delayed, waiting, dueMs }.
   * A task with an `ordering_key` (section 20) whose key's turn has not come is
   * stored but in no stream yet: entryId is then "waiting" and waiting true.
   * @typedef {{ nowMs?: number, expiresInMs?: number }} PublishOptions
   * @param {string} queue
   * @param {object} fields
   * @param {PublishOptions} [options]
   * @returns {Promise<PublishResult>}
   */
  async publish(queue, fields, { nowMs = Date.now(), expiresInMs } = {}) {
    const [result] = await this.publishTraced(queue, [fields], { nowMs, expiresInMs });
    return result;
  }

  /**
   * Publish several tasks to one queue. Every Envelope is built and checked
   * first (its schema, and with requireServed whether it is served, included):
   * when one breaks a rule, InvalidEnvelope (or NotServed) is thrown and nothing is
   * written. Each task is then written on its own (one script call each, sent
   * together); results are in the order of `list`.
   * `expiresInMs` applies to each.
   * @param {string} queue
   * @param {object[]} list
   * @param {PublishOptions} [options]
   * @returns {Promise<PublishResult[]>}
   */
  async publishMany(queue, list, { nowMs = Date.now(), expiresInMs } = {}) {
    return this.publishTraced(queue, list, { nowMs, expiresInMs });
  }

  /**
   * Publish `list`, each task with its trace context (section 18): a send span
   * per task, whose context (or the running task's) goes into headers.traceparent.
   */
  async publishTraced(queue, list, { nowMs, expiresInMs }) {
    const traces = list.map((fields) => new PublishTrace(queue, fields));
    let envelopes;
    try {
      envelopes = traces.map((trace) => this.prepare(trace.fields, { nowMs, expiresInMs }));
      envelopes.forEach((envelope, i) => traces[i].identify(envelope));
      await this.admit(queue, envelopes);
    } catch (err) {
      for (const trace of traces) trace.fail(err).end();
      throw err;
    }
    return Promise.all(envelopes.map(async (envelope, i) => {
      try {
        const result = await this.write(queue, envelope, nowMs);
        traces[i].end();
        return result;
      } catch (err) {
        traces[i].fail(err).end();
        throw err;
      }
    }));
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
    return cancelTask(this.client, this.scripts, this.keys, taskId, { ...options, records: this.records });
  }

  /**
   * What became of a task (docs/protocol.md section 14): { taskId, queue,
   * state, record }. `state` is scheduled, queued, running, retrying,
   * succeeded, dead, cancelled, failed (dead, its dead-letter entry purged) or
   * unknown. Without `queue`, every queue of the registries and of the
   * announced workers is looked in.
   * @param {string} taskId
   * @param {{ queue?: string }} [options]
   * @returns {Promise<import('./tasks.js').TaskInfo>}
   */
  async getTask(taskId, { queue } = {}) {
    return getTask(this.client, this.keys, taskId, { queue, log: this.log });
  }

  /**
   * The announcements of the workers live or recently seen (docs/protocol.md section 15).
   * @returns {Promise<import('./announce.js').Announcement[]>}
   */
  async announcements() {
    return readAnnouncements(this.client, this.keys, this.log);
  }

  /**
   * The checks that need Redis, before anything is written: payload schemas
   * (InvalidEnvelope, rule schema) and, with requireServed, NotServed.
   * Reads are retried while Redis is away, then their error is thrown.
   */
  async admit(queue, envelopes) {
    const retrying = (what, fn) => retryWhileAway(fn, {
      toleranceMs: this.outageToleranceMs,
      onRetry: (err, attempt) => this.log.warn(`${what} failed while Redis is away; retrying`, { err, attempt, queue }),
    });
    for (const envelope of envelopes) await retrying('reading the payload schemas', () => this.schemas.check(envelope));
    if (!this.requireServed) return;
    const announced = await retrying('reading the worker announcements', () => this.announcements());
    for (const envelope of envelopes) {
      const refused = notServed(announced, queue, envelope);
      if (refused) throw refused;
    }
  }

  /** Close the connection when the producer opened it. */
  async close() {
    if (this.owned) await closeClient(this.client);
  }

  /**
   * @typedef {{ taskId: string, envelope: object, entryId: string | null, delayed: boolean, waiting: boolean,
   *   dueMs: number }} PublishResult
   * @returns {Promise<PublishResult>}
   */
  async write(queue, envelope, nowMs) {
    const qk = this.keys.queue(queue);
    const { enc, body } = encodeBody(envelope, { gzipMinBytes: this.gzipMinBytes, limits: this.limits });
    const bucket = bucketFor(envelope.priority);
    const token = publishToken(); // the same for every try of this publish
    const recordFields = { ...publishedFields(envelope, queue), published_at: recordTime(nowMs) };
    const log = this.log.child({ task_id: envelope.task_id, trace_id: envelope.trace_id, queue });
    const retrying = (fn) => retryWhileAway(fn, {
      toleranceMs: this.outageToleranceMs,
      onRetry: (err, attempt) => log.warn('publish failed while Redis is away; retrying', { err, attempt }),
    });
    if (isDue(envelope, nowMs)) {
      // enqueue.lua: an XADD that also removes a delayed copy of the same task_id,
      // so a task first scheduled and then published to run now is delivered once.
      // A keyed task registers its queue first, as a delayed one: promoters release
      // it from its key's waiting hash (section 20).
      const stream = qk.stream(bucket);
      const [keys, args] = withRecord(this.records.active(qk, envelope.task_id, 0, recordFields),
        [stream, qk.delayed, qk.delayedData, qk.published(envelope.task_id)],
        [envelope.task_id, enc, body, token, PUBLISH_DEDUPE_MS], 5);
      const run = () => this.scripts.run('enqueue', keys, args);
      const entryId = await retrying(async () => {
        const id = await (envelope.ordering_key !== null ? registerThen(this.client, this.keys.queues, queue, run) : run());
        await this.replicas.after(this.client, stream, 'publish', log);
        return id;
      });
      return { taskId: envelope.task_id, envelope, entryId, delayed: false, waiting: entryId === WAITING, dueMs: nowMs };
    }
    // Register the queue on every delayed publish, before schedule.lua stores
    // it and wakes the promoters: a registry lost with its node is rebuilt by
    // the next publish.
    const due = dueMs(envelope, nowMs);
    const [keys, args] = withRecord(this.records.active(qk, envelope.task_id, due, { ...recordFields, due_at: recordTime(due) }),
      [qk.delayed, qk.delayedData, qk.published(envelope.task_id)],
      [envelope.task_id, due, bucket, enc, body, this.keys.wakeup, token, PUBLISH_DEDUPE_MS], 8);
    await retrying(async () => {
      await registerThen(this.client, this.keys.queues, queue, () => this.scripts.run('schedule', keys, args));
      await this.replicas.after(this.client, qk.delayed, 'publish', log);
    });
    return { taskId: envelope.task_id, envelope, entryId: null, delayed: true, waiting: false, dueMs: due };
  }
}
