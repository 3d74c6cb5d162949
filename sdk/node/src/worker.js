// A worker shell that follows docs/protocol.md sections 5-10.
//
//   - reads one queue or several, in their configured order; joins consumer
//     group `workers` on each queue's high/normal/low streams;
//   - keeps <prefix>:consumer:<consumer> alive every lease/3 from a timer;
//     only renewals answered at once count toward a takeover (renewals.js);
//   - reads queue by queue with read.lua (an exact count, the credit left,
//     most urgent stream first, never blocking); when nothing is there it
//     waits with XREAD BLOCK from the group's last-delivered ids, one wait per
//     queue on a connection of its own, which takes nothing;
//   - limits per task type (section 19): read.lua gets the lease and the free
//     run capacity, hands out limited entries within their limits and parks the
//     others; while entries are parked the queue is read again within the
//     wait_ms it answered; the slots of the entries held are renewed with each
//     liveness renewal and freed in the MULTI of their acknowledgement;
//   - per read (section 5.1): decodes and validates every entry, a malformed
//     one goes to the dead-letter stream with its raw bytes (never dropped,
//     never left pending); moves entries that are not due yet to the delayed
//     set; looks the rest up in <prefix>:cancelled (one ZMSCORE) and
//     acknowledges cancelled ones without running them (the marks stay);
//   - then, per entry: acknowledges expired tasks without running them,
//     dead-letters unknown task types and unaccepted payload versions, claims
//     the idempotency key (marked in memory until settled: another attempt of
//     the key here is deferred; a claim Redis failed is released before the
//     entry is left pending), takes a retry slot for retries, runs the handler
//     with a timeout, acknowledges only on success, and otherwise applies the
//     retry rules; an attempt abandoned at its timeout keeps its idempotency
//     claim until its handler's promise settles (abandoned.js);
//   - writes the result an Envelope asks for (ext.celery.result, section 12)
//     before settling its entry: SUCCESS, FAILURE when dead-lettered, REVOKED
//     when cancelled or expired;
//   - takes over the entries of dead consumers with requeue.lua and forgets
//     dead consumers that hold nothing with forget_consumer.lua;
//   - promotes delayed tasks (promote.lua), like every other worker;
//   - dead-letters a payload that breaks its schema (section 16) as
//     invalid_payload, before claiming its idempotency key;
//   - writes the task record (section 14) in each step's script call or MULTI;
//   - ordering keys (section 20): the acknowledgement that settles a keyed task for
//     good advances its key in its MULTI, then wakes the promoters, which release the
//     key's next task; retries, deferrals and put-backs keep the key's place;
//   - announces itself (section 15) with every liveness renewal;
//   - counts each attempt's outcome, run time and wait (section 17) and writes
//     the counts with every liveness renewal and on stop (statistics.js);
//   - runs each handler with its task's trace context current (section 18,
//     tracing.js): a process span with OpenTelemetry, the traceparent that tasks
//     published from the handler continue;
//   - on stop: prefetched, unstarted entries go back with requeue.lua, running
//     tasks get a grace period, the liveness key is deleted, and the
//     announcement is written once more with stopped_at.
// Every dead-letter write is preceded by SADD <prefix>:dead-queues <queue>, every
// delayed store by SADD <prefix>:queues, each on its own (no step crosses a
// Cluster slot). Failover errors and resets are outages: settling steps are
// retried for outageToleranceMs, reads re-arm, and entries a lost read reply
// left pending to this consumer are read again. With waitReplicas, WAIT follows
// every settling step (idempotency done marker, ack, retry, dead letter) and
// every promotion.
// Logs are JSON lines on stderr, each with trace_id and task_id.

import crypto from 'node:crypto';
import { EventEmitter } from 'node:events';
import os from 'node:os';
import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import { AbandonedClaims } from './abandoned.js';
import { ANNOUNCE_KEEP_MS, announce } from './announce.js';
import { closeClient, disconnectClient, isRedisClient, logConnectionErrors, roleConnection } from './connection.js';
import { MalformedEntry, decodeEntry, encodeBody, entryFields } from './codec.js';
import { readDeadLetter } from './deadletters.js';
import { DEFAULT_LIMITS, Timestamp, dueMs, isExpired } from './envelope.js';
import { DEFAULT_GROUP, DEFAULT_PREFIX, KeySpace, bucketFor } from './keys.js';
/** @typedef {import('./keys.js').QueueKeys} QueueKeys */
import { PARKED_CONSUMER } from './limits.js';
import { createLogger } from './log.js';
import { OUTAGE_TOLERANCE_MS, isRedisAway, retryWhileAway } from './outage.js';
import { PUBLISH_DEDUPE_MS } from './producer.js';
import { Promoter } from './promoter.js';
import { TASK_RECORD_RETENTION_MS, TASK_STATES, TaskRecords, publishedFields, recordError, recordTime, withRecord } from './records.js';
import { Renewals, WaitedForRedis } from './renewals.js';
import { registerThen } from './registry.js';
import { ReplicaWait } from './replicas.js';
import {
  FIRST_FAILURE_HEADER, RETRY_DEFAULTS, TaskTimeoutError, asksForTiered, backoffDelayMs,
  decideFailure, fastRetriesTaken, isTransientError, nextAttempt, permanentClassOf,
} from './retry.js';
import { ResultWriter, checkResult } from './results.js';
import { PayloadSchemas, SCHEMA_CACHE_MS, schemaDeadLetterReason } from './schemas.js';
import { Scripts } from './scripts.js';
import { TaskStatistics, UNDECODED_TASK_TYPE } from './statistics.js';
import { AttemptTrace } from './tracing.js';
import { parseRedisUrl } from './url.js';

export { parseRedisUrl, isRedisClient };

export const WORKER_DEFAULTS = Object.freeze({
  prefix: DEFAULT_PREFIX,
  group: DEFAULT_GROUP,
  leaseMs: 30_000,
  blockMs: 1_000,
  concurrency: 1,
  // Entries held at most (running + read ahead); null: the concurrency.
  prefetch: null,
  ...RETRY_DEFAULTS,
  retryConcurrency: 5,
  maxRedeliveries: 10,
  deferMs: 3_000,
  idemDoneTtlMs: 24 * 3600 * 1000,
  // Safety net of an idempotency claim when the task has no timeout_ms (else timeout_ms + leaseMs).
  idemClaimMs: 3600 * 1000,
  // How long a retry slot is held if never released, when the task has no timeout_ms.
  retrySlotHoldMs: 15 * 60 * 1000,
  // Dead consumers that hold nothing are forgotten once idle this long (at least leaseMs).
  forgetAfterMs: 3600 * 1000,
  // Bound on attempts of tasks without timeout_ms (null: unbounded).
  defaultTimeoutMs: null,
  shutdownGraceMs: 30_000,
  takeoverBatch: 100,
  gzipMinBytes: 8192,
  limits: DEFAULT_LIMITS,
  promoter: true,
  promoterMaxIdleMs: 5_000,
  isTransient: null,
  // Celery's result backend: an ioredis client (used as it is), a redis:// URL or ioredis options.
  resultBackend: null,
  // How long a settling step (or a result write) is retried while Redis is away or failing over.
  outageToleranceMs: OUTAGE_TOLERANCE_MS,
  // WAIT for this many replicas after each settling step (0: no wait), at most waitTimeoutMs.
  waitReplicas: 0,
  waitTimeoutMs: 1_000,
  // task_record_retention: how long the record of a finished task is kept (0: no records).
  taskRecordRetentionMs: TASK_RECORD_RETENTION_MS,
  // schema_cache_s: how long the payload schemas read from Redis are used.
  schemaCacheMs: SCHEMA_CACHE_MS,
  // announce_keep_ms: how long this worker's announcement is kept after each write.
  announceKeepMs: ANNOUNCE_KEEP_MS,
});

const LANGUAGE = 'node';

class ShutdownAbort extends Error {
  constructor() {
    super('the worker is shutting down');
    this.name = 'ShutdownAbort';
  }
}

/**
 * Whether `promise` settles within `ms`; the timer never outlives the wait, so
 * a stopped worker leaves nothing that keeps the process alive.
 */
async function settlesWithin(promise, ms) {
  let timer;
  const late = new Promise((resolve) => { timer = setTimeout(resolve, ms, false); });
  try {
    return await Promise.race([promise.then(() => true, () => true), late]);
  } finally {
    clearTimeout(timer);
  }
}

const text = (value) => (Buffer.isBuffer(value) ? value.toString('utf8') : String(value));
/** The x-first-failure-at header of env when it holds an RFC 3339 time, else undefined. */
function firstFailureOf(env) {
  try {
    return Timestamp.parse(env.headers[FIRST_FAILURE_HEADER]).toString();
  } catch {
    return undefined;
  }
}

/** An object from a flat [name, value, ...] reply (XINFO). */
const pairsOf = (flat) => {
  const out = {};
  for (let i = 0; i + 1 < flat.length; i += 2) out[text(flat[i])] = flat[i + 1];
  return out;
};

function positiveInt(name, value, { allowZero = false } = {}) {
  if (!Number.isSafeInteger(value) || value < (allowZero ? 0 : 1)) {
    throw new RangeError(`${name} must be an integer ${allowZero ? '>= 0' : '>= 1'}, not ${value}`);
  }
}

/**
 * The queue names of the options: `queues` (in their order) or `queue`, not both.
 * @param {{ queue?: string, queues?: string[] }} o
 */
function queueNames(o) {
  if (o.queue !== undefined && o.queues !== undefined) throw new Error('give queue or queues, not both');
  if (o.queues === undefined) {
    if (!o.queue) throw new Error('a queue is required');
    return [o.queue];
  }
  if (!Array.isArray(o.queues) || o.queues.length === 0) throw new Error('queues must be a non-empty array of queue names');
  if (new Set(o.queues).size !== o.queues.length) throw new Error(`queues must not repeat a name: ${JSON.stringify(o.queues)}`);
  return [...o.queues];
}

/**
 * Handlers given to the Worker constructor: task_type -> function, or
 * task_type -> { handler, payloadVersions, timeoutMs }.
 * A handler's value (or what its promise resolves to) is the task's result,
 * written as JSON (JSON.stringify's) as the SUCCESS result when the Envelope
 * asks for one; a value JSON cannot hold (NaN, a function, a BigInt, a
 * circular object) fails the attempt with a ResultEncodeError (EncodeError).
 * @typedef {(payload: any, ctx: TaskContext) => any} Handler
 * @typedef {{ handler: Handler, payloadVersions?: number[], timeoutMs?: number | null }} HandlerSpec
 * @typedef {{ envelope: any, taskId: string, traceId: string, attempt: number,
 *   signal: AbortSignal, log: any, redis: any, keys: KeySpace }} TaskContext
 * @typedef {{ connection?: any, redis?: any, queue?: string, queues?: string[], prefix?: string, group?: string,
 *   leaseMs?: number, blockMs?: number, concurrency?: number, prefetch?: number | null,
 *   fastRetries?: number, backoffMs?: number, maxBackoffMs?: number, retryConcurrency?: number,
 *   maxRedeliveries?: number, deferMs?: number, shutdownGraceMs?: number, limits?: object,
 *   isTransient?: ((err: unknown) => boolean) | null, logger?: any, consumer?: string,
 *   promoter?: boolean, promoterMaxIdleMs?: number, defaultTimeoutMs?: number | null,
 *   forgetAfterMs?: number, idemClaimMs?: number, idemDoneTtlMs?: number, retrySlotHoldMs?: number,
 *   takeoverBatch?: number, gzipMinBytes?: number, autorun?: boolean,
 *   resultBackend?: any, outageToleranceMs?: number, waitReplicas?: number, waitTimeoutMs?: number,
 *   taskRecordRetentionMs?: number, schemaCacheMs?: number, announceKeepMs?: number }} WorkerOptions
 */

/** @extends {EventEmitter<any>} */
export class Worker extends EventEmitter {
  /**
   * Two forms:
   *
   *   new Worker(queue, handlers, { connection, concurrency, ... })  // starts at once unless autorun: false
   *   new Worker({ redis, queue, concurrency, ... })                  // then worker.register(...) and await worker.start()
   *
   * A worker reads one queue (`queue`), or several: `queues: [q1, q2]` or
   * new Worker([q1, q2], handlers, options), served in that order (an earlier
   * queue first, with the credit left for the next one, as Celery's -Q).
   *
   * connection (or redis): an ioredis client, Sentinel-managed or not, or a
   * Cluster (each role gets a duplicate() of it), a Redis URL (redis://,
   * rediss://, redis-sentinel://, redis-cluster://: src/url.js), or ioredis options.
   * Options: prefix, group, leaseMs, blockMs, concurrency, prefetch,
   * fastRetries, backoffMs, maxBackoffMs, retryConcurrency, maxRedeliveries,
   * deferMs, shutdownGraceMs, limits, isTransient(err) (extra transient
   * errors), logger, consumer, promoter, autorun, resultBackend (the Redis of
   * Celery's result backend: client, URL or options), outageToleranceMs,
   * waitReplicas and waitTimeoutMs (WAIT after each settling step),
   * taskRecordRetentionMs (how long the record of a finished task is kept;
   * 0: no records), schemaCacheMs (how long payload schemas are cached),
   * announceKeepMs (how long the worker's announcement is kept).
   *
   * Events: 'ready', 'completed' (envelope, { result, durationMs }),
   * 'failed' (envelope, error, { retrying, delayMs }) for every failed attempt,
   * 'dead' (envelope | null, failure) for every dead-lettered entry,
   * 'error' (error) when autorun could not start, 'closed' (stats).
   * @param {string | string[] | WorkerOptions} queueOrOptions
   * @param {Record<string, Handler | HandlerSpec>} [handlers]
   * @param {WorkerOptions} [options]
   */
  constructor(queueOrOptions, handlers, options) {
    super();
    const modern = typeof queueOrOptions === 'string' || Array.isArray(queueOrOptions);
    const named = typeof queueOrOptions === 'string' ? { queue: queueOrOptions } : { queues: queueOrOptions };
    const given = modern ? { autorun: true, ...(options ?? {}), ...named } : { ...(queueOrOptions ?? {}) };
    if (given.connection !== undefined) {
      if (given.redis !== undefined) throw new Error('give connection or redis, not both');
      given.redis = given.connection;
    }
    delete given.connection;
    const autorun = given.autorun === true;
    delete given.autorun;
    const o = { ...WORKER_DEFAULTS, ...Object.fromEntries(Object.entries(given).filter(([, v]) => v !== undefined)) };
    o.queues = queueNames(o);
    delete o.queue;
    for (const name of ['leaseMs', 'blockMs', 'concurrency', 'backoffMs', 'maxBackoffMs', 'retryConcurrency', 'deferMs', 'takeoverBatch', 'forgetAfterMs', 'retrySlotHoldMs', 'idemClaimMs', 'announceKeepMs']) {
      positiveInt(name, o[name]);
    }
    for (const name of ['fastRetries', 'maxRedeliveries', 'shutdownGraceMs', 'outageToleranceMs', 'waitReplicas', 'waitTimeoutMs', 'taskRecordRetentionMs', 'schemaCacheMs']) positiveInt(name, o[name], { allowZero: true });
    if (o.prefetch !== null) positiveInt('prefetch', o.prefetch);
    this.opts = o;
    this.keys = new KeySpace(o.prefix);
    /** @type {QueueKeys[]} The queues read, in their configured order (an earlier one is served first). */
    this.queues = o.queues.map((name) => this.keys.queue(name));
    this.queueOfStream = new Map(this.queues.flatMap((qk) => qk.taskStreams.map((stream) => [stream, qk])));
    this.host = os.hostname();
    // No spaces: the idempotency holder is "<consumer> <task_id>".
    this.consumer = o.consumer ?? `${this.host.replace(/\s/g, '_')}-${process.pid}-${crypto.randomBytes(4).toString('hex')}`;
    if (/\s/.test(this.consumer)) throw new Error(`consumer name ${JSON.stringify(this.consumer)} must not contain spaces`);
    if (this.consumer === PARKED_CONSUMER) throw new Error(`consumer name ${JSON.stringify(PARKED_CONSUMER)} is reserved for parked entries (protocol section 19)`);
    this.log = (o.logger ?? createLogger()).child({ consumer: this.consumer, queues: o.queues });
    this.queueLogs = new Map(this.queues.map((qk) => [qk, this.log.child({ queue: qk.queue })]));
    this.replicas = new ReplicaWait({ replicas: o.waitReplicas, timeoutMs: o.waitTimeoutMs, log: this.log });
    this.records = new TaskRecords(o.taskRecordRetentionMs);
    this.handlers = new Map();
    this.inflight = new Map(); // "<stream> <id>" -> { entry, abort, promise }
    this.waiting = []; // read, not started (most urgent first)
    this.held = new Set(); // "<stream> <id>" of waiting and running entries
    this.waits = new Map(); // QueueKeys -> its blocking wait in flight
    // QueueKeys -> what its last read.lua answered: limited (the queue has limits), and
    // readAgainAt (ms; null when nothing is parked), when entries parked may start.
    this.readState = new Map();
    this.claiming = new Set(); // idempotency keys claimed by attempts running here, until settled
    this.abandoned = new AbandonedClaims({
      renew: async (claim) => (await this.scripts.run('idem_begin', [claim.key], [claim.holder, claim.claimMs, '']))[0],
      finish: (claim, how, log) => this.finishClaim(claim, how, log), // retried while Redis is away (section 9)
    });
    this.running = false;
    this.recoverAt = null;
    this.renewals = new Renewals(Math.max(1, Math.floor(o.leaseMs / 3)));
    /** The counts of section 17, written to the queues' statistics hashes. */
    this.statistics = new TaskStatistics({ keys: this.keys, language: LANGUAGE, log: this.log });
    this.stats = { succeeded: 0, retried: 0, dead: 0, duplicates: 0, deferred: 0, scheduled: 0, requeued: 0, taken_over: 0, cancelled: 0, expired: 0 };
    for (const [taskType, spec] of Object.entries(modern ? handlers ?? {} : {})) {
      if (typeof spec === 'function') this.register(taskType, spec);
      else this.register(taskType, spec?.handler, { payloadVersions: spec?.payloadVersions, timeoutMs: spec?.timeoutMs });
    }
    if (autorun) {
      this.starting = this.start().catch((err) => {
        this.log.error('the worker could not start', { err });
        if (this.listenerCount('error')) this.emit('error', err);
        throw err;
      });
      this.starting.catch(() => {});
    }
  }

  /** Resolves once the worker reads its queue (after autorun or start()). */
  async waitUntilReady() {
    if (this.starting) return this.starting;
    return this.start();
  }

  /** emit() that never lets a listener break the handling of an entry. */
  notify(event, ...args) {
    try {
      this.emit(event, ...args);
    } catch (err) {
      this.log.warn(`a listener of '${event}' threw`, { err });
    }
  }

  /**
   * Register the handler of a task_type: fn(payload, ctx) returning a promise.
   * ctx: { envelope, taskId, traceId, attempt, signal, log, redis, keys }.
   * Options: payloadVersions (accepted payload_version values, default [1]),
   * timeoutMs (bound for tasks that carry no timeout_ms).
   */
  register(taskType, fn, { payloadVersions = [1], timeoutMs = null } = {}) {
    if (typeof fn !== 'function') throw new TypeError(`the handler of ${taskType} is not a function`);
    this.handlers.set(taskType, { fn, payloadVersions: new Set(payloadVersions ?? [1]), timeoutMs: timeoutMs ?? null });
    return this;
  }

  client(role, given = this.opts.redis) {
    // BullMQ's way: every role gets its own connection, a duplicate of a given client.
    const client = roleConnection(given, `envelope-node-${role}`);
    logConnectionErrors(client, this.log, { role });
    return client;
  }

  async start() {
    if (this.running) return;
    this.cmd = this.client('cmd');
    // One blocking wait per queue, each on its own connection (on a Cluster, to the node of its slot).
    this.readers = new Map(this.queues.map((qk) => [qk, this.client('reader')]));
    this.leaseClient = this.client('lease');
    this.scripts = new Scripts(this.cmd);
    this.schemas = new PayloadSchemas({ client: this.cmd, keys: this.keys, cacheMs: this.opts.schemaCacheMs, log: this.log });
    this.startedAt = recordTime();
    // Takeovers trust what these two answer only when it came at once (renewals.js).
    this.renewals.watch(this.cmd);
    this.renewals.watch(this.leaseClient);
    const backend = this.opts.resultBackend;
    // A given client is used as it is (and left open); one opened here is closed by stop().
    if (backend !== null && !isRedisClient(backend)) this.resultClient = this.client('results', backend);
    this.results = new ResultWriter({
      client: isRedisClient(backend) ? backend : this.resultClient ?? null,
      log: this.log, toleranceMs: this.opts.outageToleranceMs,
    });
    await this.ensureGroups();
    await this.renew();
    this.running = true;
    const tick = this.renewals.intervalMs;
    this.leaseTimer = setInterval(() => this.renewOrRetry(), tick);
    this.takeoverTimer = setInterval(() => this.takeoverTick(), tick);
    if (this.opts.promoter) {
      this.subscriber = this.client('promoter');
      this.promoter = new Promoter({
        client: this.cmd, subscriber: this.subscriber, prefix: this.opts.prefix,
        maxIdleMs: this.opts.promoterMaxIdleMs, log: this.log, scripts: this.scripts,
        waitReplicas: this.opts.waitReplicas, waitTimeoutMs: this.opts.waitTimeoutMs,
      });
      await this.promoter.start();
    }
    this.loopDone = this.loop();
    this.takeoverTick();
    // What this worker serves, in one line: the queue, and each task type with its payload versions.
    this.log.info('worker ready', {
      group: this.opts.group, lease_ms: this.opts.leaseMs, concurrency: this.opts.concurrency,
      task_types: [...this.handlers.keys()],
      handlers: Object.fromEntries([...this.handlers].map(([type, h]) => [type, [...h.payloadVersions]])),
      result_backend: this.results.client !== null,
    });
    this.notify('ready');
  }

  /**
   * XGROUP CREATE ... MKSTREAM on every task stream of every queue, retried
   * while Redis is away or failing over, ignoring BUSYGROUP (also as the last
   * error of a Cluster command redirected too often: a try before it created the group).
   */
  async ensureGroups() {
    for (const stream of this.queueOfStream.keys()) {
      try {
        await this.retrying('create the consumer group', this.log,
          () => this.cmd.xgroup('CREATE', stream, this.opts.group, '0', 'MKSTREAM'));
      } catch (err) {
        if (!/\bBUSYGROUP\b/.test(String(err.message))) throw err;
      }
    }
  }

  /**
   * Mark this consumer alive for another lease. Only renewals answered at once
   * count toward a takeover: one that waited for Redis starts the count again.
   */
  async renew() {
    const counted = await this.renewals.renew(this.leaseClient,
      () => this.leaseClient.set(this.keys.consumer(this.consumer), `${this.host} ${process.pid} ${LANGUAGE}`, 'PX', this.opts.leaseMs));
    if (!counted) this.log.info('a liveness renewal waited for Redis; takeovers wait for two renewals answered at once');
    await this.renewSlots().catch((err) => this.log.warn('could not renew the concurrency slots; they are renewed with the next renewal', { err }));
    await this.announceSelf().catch((err) => this.log.warn('could not write the worker announcement', { err }));
    this.statistics.flush(this.leaseClient); // never throws; a write that waits never holds the renewal up
  }

  /**
   * The deadline of the concurrency slot (section 19) of every entry held from a
   * limited queue, one MULTI per queue of ZADD <running key> XX <now + lease> <member>:
   * XX, so a slot freed meanwhile (or a type without a concurrency limit) is not taken.
   */
  async renewSlots() {
    const byQueue = new Map();
    const entries = [...this.waiting, ...[...this.inflight.values()].map((task) => task.entry)];
    for (const entry of entries) {
      if (!entry.slotType) continue;
      const qk = this.queueOf(entry.stream);
      if (!byQueue.has(qk)) byQueue.set(qk, []);
      byQueue.get(qk).push(entry);
    }
    for (const [qk, held] of byQueue) {
      const multi = this.leaseClient.multi();
      const deadline = Date.now() + this.opts.leaseMs;
      for (const entry of held) multi.zadd(qk.running(entry.slotType), 'XX', deadline, `${entry.stream} ${entry.id}`);
      for (const [err] of await multi.exec()) if (err) throw err;
    }
  }

  /**
   * This consumer's announcement (section 15): its queues, the task types it
   * serves with their payload versions, its concurrency; `stopped` marks a clean shutdown.
   * @returns {import('./announce.js').Announcement}
   */
  announcement(stopped = false) {
    const seenAt = recordTime();
    const serves = Object.fromEntries([...this.handlers].filter(([, h]) => h.payloadVersions.size)
      .map(([type, h]) => [type, [...h.payloadVersions].sort((a, b) => a - b)]));
    return {
      consumer: this.consumer, language: LANGUAGE, host: this.host, pid: process.pid, queues: [...this.opts.queues],
      serves, concurrency: this.opts.concurrency, started_at: this.startedAt, seen_at: seenAt,
      heartbeat_ms: this.renewals.intervalMs,
      ...(stopped ? { stopped_at: seenAt } : {}),
    };
  }

  /** Write the announcement: ZADD <prefix>:workers first and awaited, then SET PX announceKeepMs. */
  announceSelf(stopped = false) {
    return announce(this.leaseClient, this.keys, this.announcement(stopped), this.opts.announceKeepMs);
  }

  /**
   * A renewal of the liveness key; one that failed is tried again within a
   * tenth of the renewal interval until one succeeds (docs/protocol.md section
   * 5), so that the key is back soon after the primary is found again.
   */
  async renewOrRetry() {
    try {
      await this.renew();
    } catch (err) {
      if (this.leaseTimer === null) return;
      this.log.warn('liveness renewal failed; trying again shortly', { err });
      clearTimeout(this.renewRetry);
      this.renewRetry = setTimeout(() => this.renewOrRetry(), Math.max(1, Math.floor(this.renewals.intervalMs / 10)));
    }
  }

  // ---------------------------------------------------------------- reading

  // Holds at most max(prefetch, concurrency) entries (running + waiting); tops up
  // with read.lua (an exact count, most urgent first) and, only when nothing is
  // there and nothing waits locally, waits for new entries without taking any,
  // so a freed slot never waits behind a read and credit is never exceeded.
  async loop() {
    const maxHeld = Math.max(this.opts.prefetch ?? this.opts.concurrency, this.opts.concurrency);
    while (this.running) {
      try {
        if (this.recoverAt !== null && Date.now() >= this.recoverAt) {
          this.recoverAt = null;
          await this.recoverOwnPending();
        }
        if (this.waiting.length && this.inflight.size < this.opts.concurrency) {
          this.dispatch(this.waiting.shift());
          continue;
        }
        const room = maxHeld - this.held.size;
        if (room > 0) {
          const entries = await this.readNow(room);
          if (entries.length) {
            await this.admit(entries);
            continue;
          }
          if (!this.waiting.length && this.running) {
            await this.waitForEntries();
            continue;
          }
        }
        if (this.inflight.size) await Promise.race([...this.inflight.values()].map((t) => t.promise));
      } catch (err) {
        if (!this.running) break;
        // A failover (UNBLOCKED, READONLY, MOVED, a reset...) is an outage: read again soon.
        const away = isRedisAway(err);
        if (away) this.log.warn('reading interrupted (Redis away or failing over); reading again', { err });
        else this.log.error('reading failed; retrying in 1 s', { err });
        this.recoverAt = Date.now();
        await sleep(away ? 200 : 1000);
        if (/NOGROUP|no such key/.test(String(err?.message))) {
          // A stream or its group was deleted under us (or Redis lost its data): create them again.
          await this.ensureGroups().catch((e) => this.log.error('could not create the consumer groups', { err: e }));
        }
      }
    }
  }

  static entriesOf(reply) {
    const entries = [];
    for (const [stream, items] of reply ?? []) {
      for (const [id, fields] of items ?? []) {
        entries.push({ stream: text(stream), id: text(id), fields: fields ?? null });
      }
    }
    return entries;
  }

  /**
   * Exactly up to `credit` new entries without blocking: read.lua queue by queue
   * in their order with the credit left (one call never spans two queues),
   * most urgent stream first within a queue. Entries of limited types are taken
   * only up to the free run capacity (the concurrency less every entry held,
   * read ahead ones included), so no slot waits in the prefetch.
   */
  async readNow(credit) {
    const entries = [];
    for (const qk of this.queues) {
      if (entries.length >= credit) break;
      const capacity = Math.max(0, this.opts.concurrency - this.held.size - entries.length);
      const [reply, waitMs, limited, freedAfter] = await this.scripts.runBuffer('read', qk.taskStreams,
        [this.opts.group, this.consumer, credit - entries.length, this.opts.leaseMs, capacity]);
      const state = {
        limited: Number(limited) === 1,
        readAgainAt: Number(waitMs) >= 0 ? Date.now() + Number(waitMs) : null,
        freedAfter: text(freedAfter), // entries wait for a slot: wait on slot-freed from here
      };
      this.readState.set(qk, state);
      for (const entry of Worker.entriesOf(reply)) entries.push({ ...entry, limited: state.limited });
    }
    return entries;
  }

  /**
   * Wait up to blockMs until a task stream of some queue has entries the group
   * has not delivered. Each queue keeps one wait in flight on its own
   * connection; a wait still blocked when another queue woke the worker is
   * waited on again next time, never sent twice.
   */
  async waitForEntries() {
    for (const qk of this.queues) {
      if (this.waits.has(qk)) continue;
      const wait = this.waitOn(qk).finally(() => this.waits.delete(qk));
      wait.catch(() => {}); // settled after the worker stopped waiting (shutdown): nothing to report
      this.waits.set(qk, wait);
    }
    const wakes = [...this.waits.values()];
    let timer = null;
    const readAgainAt = Math.min(...[...this.readState.values()].map((s) => s.readAgainAt ?? Infinity));
    if (Number.isFinite(readAgainAt)) {
      // Parked entries may start by then (section 19): read again even if nothing new comes;
      // with no run capacity left, only once an attempt here ends.
      if (this.held.size < this.opts.concurrency) {
        wakes.push(new Promise((resolve) => { timer = setTimeout(resolve, Math.max(0, readAgainAt - Date.now())); }));
      } else {
        wakes.push(...[...this.inflight.values()].map((t) => t.promise));
      }
    }
    try {
      await Promise.race(wakes);
    } finally {
      clearTimeout(timer);
    }
  }

  /**
   * XREAD BLOCK on the streams of one queue from the group's last-delivered
   * ids: it takes nothing, so the next read.lua takes exactly the credit
   * whatever the Redis version and however many streams have entries. While
   * entries of the queue wait for a slot, slot-freed is in it too, from the id
   * the last read.lua answered, so a settle freeing one ends it (section 19).
   * @param {QueueKeys} qk
   */
  async waitOn(qk) {
    const freedAfter = this.readState.get(qk)?.freedAfter ?? '';
    const streams = qk.taskStreams;
    const pipeline = this.cmd.pipeline();
    for (const stream of streams) pipeline.xinfo('GROUPS', stream);
    const ids = [];
    for (const [i, [err, groups]] of (await pipeline.exec()).entries()) {
      if (err) throw err;
      const group = (groups ?? []).map(pairsOf).find((g) => g.name === this.opts.group);
      if (!group) throw new Error(`NOGROUP: group ${this.opts.group} is missing on ${streams[i]}`);
      ids.push(text(group['last-delivered-id']));
    }
    const watched = freedAfter ? [...streams, qk.slotFreed] : streams;
    if (freedAfter) ids.push(freedAfter);
    await this.readers.get(qk).xread('COUNT', 1, 'BLOCK', this.opts.blockMs, 'STREAMS', ...watched, ...ids);
  }

  /** After an error: entries this consumer read but did not settle are handled again, queue by queue. */
  async recoverOwnPending() {
    for (const qk of this.queues) {
      const streams = qk.taskStreams;
      const reply = await this.cmd.xreadgroupBuffer(
        'GROUP', this.opts.group, this.consumer, 'COUNT', 1000, 'STREAMS', ...streams, ...streams.map(() => '0'));
      const limited = this.readState.get(qk)?.limited ?? false;
      const entries = Worker.entriesOf(reply).filter((e) => !this.held.has(`${e.stream} ${e.id}`)).map((e) => ({ ...e, limited }));
      if (entries.length) this.queueLogs.get(qk).warn('handling again entries left pending by an error', { count: entries.length });
      await this.admit(entries);
    }
  }

  /** The queue of one of this worker's task streams. */
  queueOf(stream) {
    return this.queueOfStream.get(stream);
  }

  /**
   * Steps 1 to 3 of section 5.1 for the entries of one read: decode and validate
   * (malformed entries are dead-lettered), move entries not due yet to the
   * delayed set, look the task ids of the rest up in the cancel marks with one
   * ZMSCORE and acknowledge cancelled ones. What is left waits to be dispatched.
   */
  async admit(entries) {
    const fresh = [];
    for (const entry of entries) {
      const tag = `${entry.stream} ${entry.id}`;
      if (this.held.has(tag)) continue;
      this.held.add(tag);
      fresh.push(entry);
    }
    const release = (entry) => this.held.delete(`${entry.stream} ${entry.id}`);
    const failedToSettle = (entry, err) => {
      this.log.error('could not settle the entry; it stays pending and is handled again', {
        err, stream: entry.stream, entry_id: entry.id, task_id: entry.taskId ?? null, trace_id: entry.traceId ?? null,
      });
      this.recoverAt = Date.now() + 1000;
    };
    const due = [];
    for (const entry of fresh) {
      try {
        if (await this.screen(entry)) {
          due.push(entry);
          continue;
        }
      } catch (err) {
        failedToSettle(entry, err);
      }
      release(entry);
    }
    const cancelled = await this.cancelledAmong(due);
    for (const entry of due) {
      if (!cancelled.has(entry.env.task_id)) {
        this.waiting.push(entry);
        continue;
      }
      try {
        await this.skipCancelled(entry);
      } catch (err) {
        failedToSettle(entry, err);
      }
      release(entry);
    }
  }

  /** Decode one entry; true when it is due and waits to be handled. */
  async screen(entry) {
    if (entry.fields === null) {
      // Deleted while pending (seen when re-reading this consumer's history).
      await this.cmd.xack(entry.stream, this.opts.group, entry.id);
      return false;
    }
    const fields = entryFields(entry.fields);
    let env;
    try {
      env = decodeEntry(fields, { limits: this.opts.limits });
    } catch (err) {
      if (!(err instanceof MalformedEntry)) throw err;
      await this.malformed(entry, err);
      return false;
    }
    entry.env = env;
    entry.taskId = env.task_id;
    entry.traceId = env.trace_id;
    // The type whose concurrency slot it may hold (section 19): field t, else the Envelope's.
    if (entry.limited) entry.slotType = fields.get('t')?.toString('utf8') ?? env.task_type;
    entry.log = this.queueLogs.get(this.queueOf(entry.stream)).child({ task_id: env.task_id, trace_id: env.trace_id, task_type: env.task_type, stream: entry.stream, entry_id: entry.id });
    const nowMs = Date.now();
    if (dueMs(env, nowMs) > nowMs) {
      await this.scheduleEntry(entry, fields, env, entry.log);
      return false;
    }
    return true;
  }

  /**
   * Task ids of `entries` marked in <prefix>:cancelled (section 10), in one
   * ZMSCORE; none on an error (cancelling is best effort once a task is in a stream).
   */
  async cancelledAmong(entries) {
    if (!entries.length) return new Set();
    try {
      const scores = await this.cmd.zmscore(this.keys.cancelled, ...entries.map((e) => e.env.task_id));
      return new Set(entries.filter((_, i) => scores[i] !== null).map((e) => e.env.task_id));
    } catch (err) {
      this.log.warn('cancel check failed; running the tasks', { err });
      return new Set();
    }
  }

  /**
   * A cancelled task: its REVOKED result when asked, then acknowledged without
   * running. The mark stays, so the same task_id published again is not run either.
   */
  async skipCancelled(entry) {
    await this.results.revoked(entry.env, 'revoked', entry.log);
    await this.ack(entry, entry.log, { state: TASK_STATES.cancelled, reason: 'cancelled' });
    this.stats.cancelled += 1;
    entry.log.info('task was cancelled; acknowledged without running it');
  }

  /** An expired task (section 5.1, step 3): its REVOKED result when asked, then acknowledged without running. */
  async skipExpired(entry) {
    await this.results.revoked(entry.env, 'expired', entry.log);
    await this.ack(entry, entry.log, { state: TASK_STATES.cancelled, reason: 'expired' });
    this.stats.expired += 1;
    entry.log.info('task expired; acknowledged without running it', { expires: entry.env.expires });
  }

  dispatch(entry) {
    const tag = `${entry.stream} ${entry.id}`;
    const abort = new AbortController();
    const task = { entry, abort };
    task.promise = this.handle(entry, abort)
      .catch((err) => {
        this.log.error('could not settle the entry; it stays pending and is handled again', {
          err, stream: entry.stream, entry_id: entry.id, task_id: entry.taskId ?? null, trace_id: entry.traceId ?? null,
        });
        this.recoverAt = Date.now() + 1000;
      })
      .finally(() => {
        this.inflight.delete(tag);
        this.held.delete(tag);
      });
    this.inflight.set(tag, task);
  }

  // ---------------------------------------------------------------- handling

  /** Steps 3 (expiry) to 6 of section 5.1: handler and payload_version, idempotency, retry slot, run. */
  async handle(entry, abort) {
    const { env, log } = entry;
    // Checked when the task would start (the worker's clock), not when it was read.
    if (isExpired(env)) {
      await this.skipExpired(entry);
      return;
    }
    const handler = this.handlers.get(env.task_type);
    if (!handler) {
      await this.deadLetter(entry, env, log, this.notRun(env, 'unknown_task_type',
        `no handler is registered for task_type ${env.task_type} on this ${LANGUAGE} worker`));
      return;
    }
    if (!handler.payloadVersions.has(env.payload_version)) {
      await this.deadLetter(entry, env, log, this.notRun(env, 'unsupported_payload_version',
        `payload_version ${env.payload_version} is not accepted by the handler of ${env.task_type} (accepts ${[...handler.payloadVersions].join(', ')})`));
      return;
    }
    if (await this.breaksSchema(entry, env, log)) return;
    if (env.idempotency_key === null) {
      await this.runSlotted(entry, env, handler, abort, log, null);
      return;
    }
    // The claim is re-entrant for this consumer: it defers another entry of the same key while
    // an attempt of it runs here (a retry of an abandoned attempt, or a second entry of the task
    // after a failover lost a promotion or a delivery). Checked and marked with no await between,
    // before idem_begin.lua; an abandoned attempt's mark is this.abandoned, until its claim is settled.
    const key = this.keys.idempotency(env.task_type, env.idempotency_key);
    if (this.abandoned.holds(key) || this.claiming.has(key)) {
      await this.defer(entry, env, log, 'an attempt of this idempotency key still runs on this consumer; deferred');
      return;
    }
    this.claiming.add(key);
    try {
      const claim = await this.claim(env, log);
      if (claim.state === 'done') {
        await this.results.success(env, null, log); // as a Celery worker does for a duplicate
        await this.ack(entry, log, { state: TASK_STATES.succeeded, reason: 'duplicate' });
        this.stats.duplicates += 1;
        this.statistics.count(this.queueOf(entry.stream).queue, env.task_type, 'duplicate');
        log.info('duplicate: the effect of this idempotency key already happened; acknowledged without running', {
          idempotency_key: env.idempotency_key, marker: claim.value,
        });
        return;
      }
      if (claim.state === 'busy') {
        await this.defer(entry, env, log, 'another live consumer runs this idempotency key; deferred', { holder: claim.value });
        return;
      }
      await this.runSlotted(entry, env, handler, abort, log, claim);
    } finally {
      this.claiming.delete(key);
    }
  }

  /**
   * A payload that breaks its schema (section 16) is dead-lettered as
   * invalid_payload, never run nor retried: answers true then. When the
   * schemas cannot be read, the task runs unchecked (logged).
   */
  async breaksSchema(entry, env, log) {
    let found;
    try {
      found = await this.schemas.violations(env);
    } catch (err) {
      log.warn('payload schemas could not be read; running the task unchecked', { err });
      return false;
    }
    if (!found.length) return false;
    this.statistics.count(this.queueOf(entry.stream).queue, env.task_type, 'failed'); // a refused payload is a failed attempt
    await this.deadLetter(entry, env, log, this.notRun(env, 'invalid_payload', schemaDeadLetterReason(found)));
    return true;
  }

  /** Step 5 of section 8 (a retry slot for a tiered retry), then the run. */
  async runSlotted(entry, env, handler, abort, log, claim) {
    const slotKey = this.keys.retrying(env.task_type);
    let slot = false;
    if (env.retry_count > 0 && asksForTiered(env)) { // the cap belongs to the tiered policy
      // A slot Redis fails to answer for: the attempt runs without one (the cap limits load,
      // not correctness; section 9) and still removes what the call may have set.
      const got = await this.scripts.run('retry_slot', [slotKey],
        [env.task_id, this.opts.retryConcurrency, env.timeout_ms ?? this.opts.retrySlotHoldMs])
        .catch((err) => { log.warn('retry slot check failed; running anyway', { err }); return null; });
      if (got !== null && Number(got) === 0) {
        if (claim) await this.finishClaim(claim, 'release', log);
        // The backoff tier computed with next = retry_count: the count does not change.
        const delayMs = backoffDelayMs(env.retry_count, fastRetriesTaken(env.headers), this.opts);
        await this.replace(entry, nextAttempt(env, { delayMs }), delayMs, log, { state: TASK_STATES.scheduled });
        this.stats.deferred += 1;
        log.info('all retry slots of this task type are taken; attempt rescheduled', { delay_ms: delayMs });
        return;
      }
      slot = true;
    }
    try {
      await this.runClaimed(entry, env, handler, abort, log, claim);
    } finally {
      if (slot) {
        await this.cmd.zrem(slotKey, env.task_id).catch((err) => log.warn('could not release the retry slot', { err }));
      }
    }
  }

  /** Hand the entry back without running it, due deferMs later, retry_count unchanged (a deferral, section 8). */
  async defer(entry, env, log, message, fields = {}) {
    const delayMs = this.opts.deferMs;
    await this.replace(entry, nextAttempt(env, { delayMs }), delayMs, log, { state: TASK_STATES.scheduled });
    this.stats.deferred += 1;
    log.info(message, { ...fields, delay_ms: delayMs });
  }

  /** Failure fields of a task dead-lettered before its handler ran. */
  notRun(env, failureClass, reason) {
    return {
      failure_class: failureClass, reason, attempts: env.retry_count + 1,
      first_failure_at: firstFailureOf(env),
    };
  }

  /** The attempt in its process span (section 18), which fails with the handler's error. */
  async runClaimed(entry, env, handler, abort, log, claim) {
    const trace = new AttemptTrace(this.queueOf(entry.stream).queue, env);
    try {
      await this.runAttempt(entry, env, handler, abort, log, claim, trace);
    } catch (err) {
      trace.fail(err);
      throw err;
    } finally {
      trace.end();
    }
  }

  /** Count how an attempt ended (section 17): its outcome and how long its handler ran. */
  countRun(entry, env, outcome, seconds) {
    const queue = this.queueOf(entry.stream).queue;
    this.statistics.count(queue, env.task_type, outcome.ok ? 'succeeded' : 'failed');
    this.statistics.observe(queue, env.task_type, 'run', seconds);
  }

  async runAttempt(entry, env, handler, abort, log, claim, trace) {
    const timeoutMs = env.timeout_ms ?? handler.timeoutMs ?? this.opts.defaultTimeoutMs;
    await this.recordStart(entry, env, log);
    const startedAt = Date.now();
    const started = performance.now();
    // The wait: from its schedule_time, else its created_at, to now.
    const since = Timestamp.parse(env.schedule_time ?? env.created_at);
    this.statistics.observe(this.queueOf(entry.stream).queue, env.task_type, 'wait',
      (startedAt - since.epochMs - since.subMsNanos / 1e6) / 1000);
    const outcome = await this.runHandler(env, handler, timeoutMs, abort, log, trace);
    const ranSeconds = (performance.now() - started) / 1000;
    if (!outcome.ok) trace.fail(outcome.error);
    // A shutdown abort puts the entry back: not an outcome of the task.
    if (!(outcome.error instanceof ShutdownAbort)) this.countRun(entry, env, outcome, ranSeconds);
    if (outcome.ok) {
      const epoch = this.renewals.epoch;
      const replicated = claim ? await this.finishClaim(claim, 'done', log) : true;
      await this.results.success(env, outcome.result, log);
      await this.ack(entry, log, { state: TASK_STATES.succeeded });
      // A done marker that no replica took, on a connection replaced since (a node that
      // answered NOREPLICAS or READONLY), may sit on a node that is no longer the primary:
      // written again on the current one, or the task runs again from the new primary.
      if (!replicated && this.renewals.epoch !== epoch) await this.finishClaim(claim, 'done', log);
      this.stats.succeeded += 1;
      log.info('task succeeded', { attempt: env.retry_count, duration_ms: outcome.durationMs });
      this.notify('completed', env, { result: outcome.result, durationMs: outcome.durationMs });
      return;
    }
    if (claim && outcome.late) this.abandoned.keep(claim, outcome.late, log); // its effect may still come
    else if (claim) await this.finishClaim(claim, 'release', log);
    if (outcome.error instanceof ShutdownAbort) {
      await this.requeueOwn(entry, 'stopped by shutdown before it finished');
      return;
    }
    await this.failed(entry, env, outcome, log);
  }

  /** The record of a start: state running, attempts + 1 and who runs it, one MULTI; a failed write is logged. */
  async recordStart(entry, env, log) {
    const record = this.records.active(this.queueOf(entry.stream), env.task_id, 0, {
      started_at: recordTime(), worker: this.consumer, language: LANGUAGE, host: this.host, pid: String(process.pid),
    });
    if (!record) return;
    try {
      for (const [err] of await record.hset(this.cmd.multi(), TASK_STATES.running, { start: true }).exec()) if (err) throw err;
    } catch (err) {
      log.warn('could not write the task record of the start; the task runs', { err });
    }
  }

  /**
   * Run the handler until it settles or `abort` fires (its timeout or the
   * shutdown). An aborted attempt is abandoned at once: a promise cannot be
   * stopped, so the outcome carries `late`, the handler's promise, which may
   * still settle (and have its effect) later.
   */
  async runHandler(env, handler, timeoutMs, abort, log, trace) {
    const started = Date.now();
    let timer = null;
    const ABORTED = Symbol('aborted');
    const stopped = new Promise((resolve) => {
      if (abort.signal.aborted) resolve(ABORTED);
      abort.signal.addEventListener('abort', () => resolve(ABORTED), { once: true });
    });
    if (timeoutMs !== null && timeoutMs !== undefined) {
      timer = setTimeout(() => abort.abort(new TaskTimeoutError(timeoutMs)), timeoutMs);
    }
    const ctx = {
      envelope: env, taskId: env.task_id, traceId: env.trace_id, attempt: env.retry_count,
      signal: abort.signal, log, redis: this.cmd, keys: this.keys,
    };
    const running = Promise.resolve().then(() => trace.run(() => handler.fn(env.payload, ctx)));
    const failure = (error, late = null) => ({
      ok: false, error, timeout: error instanceof TaskTimeoutError, late, durationMs: Date.now() - started,
    });
    try {
      const first = await Promise.race([running.then((value) => ({ value }), (error) => ({ error })), stopped]);
      if (first === ABORTED) {
        if (abort.signal.reason instanceof TaskTimeoutError) log.warn('attempt exceeded its timeout; abandoned (its handler may still run)', { timeout_ms: timeoutMs });
        return failure(abort.signal.reason, running);
      }
      if ('error' in first) return failure(first.error);
      checkResult(env, first.value); // a value the asked-for result cannot hold fails the attempt (EncodeError)
      return { ok: true, result: first.value, durationMs: Date.now() - started };
    } catch (error) {
      return failure(error);
    } finally {
      if (timer) clearTimeout(timer);
    }
  }

  isTransient(err) {
    if (isTransientError(err)) return true;
    return typeof this.opts.isTransient === 'function' && Boolean(this.opts.isTransient(err));
  }

  async failed(entry, env, outcome, log) {
    const { error } = outcome;
    const now = Timestamp.now();
    // The first failure's time travels with the retries in x-first-failure-at.
    const firstFailureAt = firstFailureOf(env) ?? now.toString();
    const failure = {
      exception_type: error?.name ?? typeof error,
      traceback: error?.stack ?? String(error),
      reason: error?.message ?? String(error),
      attempts: env.retry_count + 1,
      first_failure_at: firstFailureAt,
    };
    const permanent = permanentClassOf(error);
    if (permanent !== null) {
      // invalid_payload / rejected: dead-lettered at once, never retried.
      this.notify('failed', env, error, { retrying: false, delayMs: null });
      await this.deadLetter(entry, env, log, { ...failure, failure_class: permanent });
      return;
    }
    const timeout = outcome.timeout === true;
    const transient = !timeout && this.isTransient(error);
    const decision = decideFailure(env, { transient, timeout }, this.opts);
    if (decision.action === 'dead') {
      this.notify('failed', env, error, { retrying: false, delayMs: null });
      await this.deadLetter(entry, env, log, { ...failure, failure_class: decision.failureClass, attempts: decision.attempts });
      return;
    }
    const headers = { ...decision.headers, [FIRST_FAILURE_HEADER]: firstFailureAt };
    const next = nextAttempt(env, { retryCount: decision.retryCount, headers, delayMs: decision.delayMs }, now.epochMs);
    const stored = await this.replace(entry, next, decision.delayMs, log,
      { state: TASK_STATES.retrying, error: recordError(failure.exception_type, failure.reason) });
    if (stored) this.statistics.count(this.queueOf(entry.stream).queue, env.task_type, 'retried');
    this.stats.retried += 1;
    this.notify('failed', env, error, { retrying: true, delayMs: decision.delayMs });
    log.warn('attempt failed; retrying', {
      attempt: env.retry_count, tier: decision.tier, delay_ms: decision.delayMs, transient, timeout,
      error: failure.reason, error_type: failure.exception_type,
    });
  }

  // ---------------------------------------------------------------- idempotency

  /**
   * idem_begin.lua for `env` (section 9), taking over a dead holder's claim.
   * When Redis fails it (an error, or away past outageToleranceMs) the claim may
   * have landed all the same (a lost reply): it is released with this attempt's
   * holder, under the key's mark, before the error goes on and the entry is left pending.
   */
  async claim(env, log) {
    const key = this.keys.idempotency(env.task_type, env.idempotency_key);
    const holder = `${this.consumer} ${env.task_id}`;
    // A safety net only: timeout_ms + leaseMs, or an hour without timeout_ms.
    const claimMs = env.timeout_ms !== null ? env.timeout_ms + this.opts.leaseMs : this.opts.idemClaimMs;
    // idem_begin.lua is re-entrant for its holder: safe to repeat.
    const begin = (replacing) => this.retrying('idempotency claim', log, () => this.scripts.run('idem_begin', [key], [holder, claimMs, replacing]));
    try {
      let [state, value] = await begin('');
      if (state === 'busy' && (await this.holderIsDead(value, log))) {
        log.warn('the idempotency claim is held by a dead consumer; taking it over', { holder: value });
        [state, value] = await begin(value);
      }
      return { state, value, key, holder, claimMs };
    } catch (err) {
      log.warn('the idempotency claim failed (Redis answered with an error or not at all); releasing what may have landed', { err });
      await this.releaseUnanswered({ key, holder, claimMs }, log);
      throw err;
    }
  }

  /**
   * Release a claim whose idem_begin.lua Redis failed. Its answer 0 is expected
   * (the claim never landed), no takeover; a release that fails too is logged
   * and the claim left to expire.
   */
  async releaseUnanswered(claim, log) {
    try {
      await this.settleClaim(claim, 'release', log);
    } catch (err) {
      log.error('could not release the idempotency claim that Redis failed; it expires after its claim time', { err });
    }
  }

  /**
   * Whether the consumer of `holder` ("<consumer> <task_id>") is dead (section
   * 9, busy): its liveness key is gone at two looks one renewal interval apart,
   * neither look waited for Redis, and this consumer's own renewals are
   * answered at once. A live holder whose key expired during an outage renews
   * it within that interval once Redis answers again.
   */
  async holderIsDead(holder, log) {
    // The consumer is the holder's first word (protocol.md section 9: a Celery worker's
    // holder names the entry too).
    const key = this.keys.consumer(holder.split(' ', 1)[0]);
    const look = () => this.renewals.time(this.cmd, () => this.cmd.exists(key));
    const first = await look();
    if (first.value) return false;
    await sleep(this.renewals.intervalMs);
    const second = await look();
    if (second.value) return false;
    const trusted = !first.waited && !second.waited && this.renewals.trusted;
    if (!trusted) log.info('the holder of the idempotency claim looked dead right after Redis was away; treated as busy', { holder });
    return trusted;
  }

  /** Settle the claim of an attempt that ran: whether the replicas took it (a 0 answer is a takeover, logged). */
  async finishClaim(claim, how, log) {
    const { settled, replicated } = await this.settleClaim(claim, how, log);
    if (settled === 0) {
      log.warn('the idempotency claim had been taken over while this attempt ran: the task may have run twice', { how });
    }
    return replicated;
  }

  /**
   * idem_finish.lua `how` for `claim`, retried while Redis is away, then WAIT for
   * replicas: its answer (0: another holder had the claim) and whether they took it.
   */
  async settleClaim(claim, how, log) {
    const args = how === 'done'
      ? [claim.holder, 'done', this.opts.idemDoneTtlMs, Timestamp.now().toString()]
      : [claim.holder, 'release'];
    // Part of settling: a done marker lost with its primary would let the task run again.
    const what = `idempotency ${how}`;
    const settled = Number(await this.retrying(what, log, () => this.scripts.run('idem_finish', [claim.key], args)));
    return { settled, replicated: await this.waitForReplicas(what, claim.key, log) };
  }

  // ---------------------------------------------------------------- settling entries

  /**
   * Run a step that is safe to repeat, retried while Redis is away or failing
   * over (outageToleranceMs), then WAIT for replicas on the node of `key`.
   */
  async settle(what, key, log, fn) {
    const reply = await this.retrying(what, log, fn);
    await this.waitForReplicas(what, key, log);
    return reply;
  }

  /** WAIT after the settling step `what` on the node of `key`: true when the replicas asked (none when off) took it. */
  async waitForReplicas(what, key, log) {
    if (!this.replicas.replicas) return true;
    try {
      const acknowledged = await this.retrying('wait for replicas', log, () => this.replicas.after(this.cmd, key, what, log));
      return acknowledged >= this.replicas.replicas;
    } catch (err) {
      log.warn('could not wait for replicas', { err, step: what });
      return false;
    }
  }

  /** `fn()`, a step safe to repeat, retried while Redis is away or failing over (outageToleranceMs). */
  retrying(what, log, fn) {
    return retryWhileAway(fn, {
      toleranceMs: this.opts.outageToleranceMs,
      onRetry: (err, attempt) => log.warn(`${what}: Redis away or failing over; retrying`, { err, attempt }),
    });
  }

  /**
   * XACK + XDEL in one MULTI (the keys of one queue's slot), with the task
   * record of the final `state` (and `reason`) the acknowledgement writes
   * (state null: no record, the step that moved the task wrote it), and the
   * ZREM that frees the entry's concurrency slot when it came from a limited queue.
   * A keyed task settled for good (every acknowledgement but the move of an entry
   * not yet due to the delayed set, `keepsOrder`, where the task keeps its place)
   * advances its ordering key in the same MULTI (LREM of the head, RPUSH
   * order-advanced), then wakes the promoters, which release the key's next task
   * (section 20).
   * @param {{ state: string | null, reason?: string, keepsOrder?: boolean }} ending
   */
  async ack(entry, log, { state, reason, keepsOrder = false }) {
    const qk = this.queueOf(entry.stream);
    const record = state ? this.records.final(qk, entry.env.task_id, reason ? { reason } : {}) : null;
    const key = keepsOrder ? null : entry.env.ordering_key;
    const replies = await this.settle('ack', entry.stream, log, async () => {
      const multi = this.cmd.multi().xack(entry.stream, this.opts.group, entry.id).xdel(entry.stream, entry.id);
      if (entry.slotType) {
        multi.zrem(qk.running(entry.slotType), `${entry.stream} ${entry.id}`)
          .xadd(qk.slotFreed, 'NOMKSTREAM', 'MAXLEN', 1, '*', 't', entry.slotType);
      }
      if (key !== null) multi.lrem(qk.order(key), 1, entry.env.task_id).rpush(qk.orderAdvanced, key);
      const r = await (record ? record.hset(multi, state) : multi).exec();
      for (const [err] of r) if (err) throw err;
      return r;
    });
    if (Number(replies[0][1]) === 0) {
      log.warn('acknowledgement answered 0: the entry was taken over while this consumer looked dead (or a retried ack had landed)');
    }
    if (key !== null) {
      // Best effort: it only wakes the promoters sooner.
      await this.cmd.publish(this.keys.wakeup, '0').catch((err) => log.warn(
        'could not wake the promoters; the next task of the ordering key starts at their next look', { err, ordering_key: key }));
    }
  }

  /**
   * An entry that is not due yet goes to the delayed set, bytes unchanged:
   * SADD <prefix>:queues first (on every delayed store, so a registry lost with
   * its node is rebuilt), then schedule.lua (token entry:<id>, so retrying it
   * stores it once), then the ack.
   */
  async scheduleEntry(entry, fields, env, log) {
    const qk = this.queueOf(entry.stream);
    const due = dueMs(env);
    const [keys, args] = withRecord(this.records.active(qk, env.task_id, due, { ...publishedFields(env, qk.queue), due_at: recordTime(due) }),
      [qk.delayed, qk.delayedData, qk.published(env.task_id)],
      [env.task_id, due, bucketFor(env.priority), fields.get('enc'), fields.get('body'),
        this.keys.wakeup, `entry:${entry.id}`, PUBLISH_DEDUPE_MS], 8);
    await this.settle('move to the delayed set', qk.delayed, log, () => registerThen(this.cmd, this.keys.queues, qk.queue,
      () => this.scripts.run('schedule', keys, args)));
    await this.ack(entry, log, { state: null, keepsOrder: true });
    this.stats.scheduled += 1;
    log.info('entry not due yet; moved to the delayed set', { schedule_time: env.schedule_time });
  }

  /**
   * Replace the pending entry by `next` (retry.lua), now or after delayMs; its
   * task record gets `state` (retrying, or scheduled for a deferral; the
   * script writes queued when due now) and the `error` of a retry. Answers
   * whether it was stored (false: the entry had been taken over).
   * @param {{ state: string, error?: string }} record
   */
  async replace(entry, next, delayMs, log, { state, error }) {
    const qk = this.queueOf(entry.stream);
    const bucket = bucketFor(next.priority);
    const { enc, body } = encodeBody(next, { gzipMinBytes: this.opts.gzipMinBytes, limits: this.opts.limits });
    const due = delayMs > 0 && next.schedule_time !== null ? Timestamp.parse(next.schedule_time).epochMs : 0;
    const fields = { state, retry_count: String(next.retry_count), ...(due ? { due_at: recordTime(due) } : {}), ...(error ? { error } : {}) };
    const [keys, args] = withRecord(this.records.active(qk, next.task_id, due, fields),
      [entry.stream, qk.stream(bucket), qk.delayed, qk.delayedData],
      [this.opts.group, entry.id, next.task_id, due, bucket, enc, body, this.keys.wakeup], 8);
    // A delayed next attempt registers the queue for promotion first.
    const run = () => this.scripts.run('retry', keys, args);
    const stored = await this.settle('replace the entry', entry.stream, log,
      () => (due ? registerThen(this.cmd, this.keys.queues, qk.queue, run) : run()));
    if (!stored) log.warn('the entry was no longer pending (taken over); its next attempt was not stored by this consumer');
    return Boolean(stored);
  }

  failureFields(failure, env, queue) {
    const now = Timestamp.now().toString();
    const fields = {
      dlq: '1',
      failure_class: failure.failure_class,
      reason: failure.reason,
      queue,
      dead_at: now,
      language: LANGUAGE,
      host: this.host,
      pid: String(process.pid),
      consumer: this.consumer,
      first_failure_at: failure.first_failure_at ?? now,
      last_failure_at: failure.last_failure_at ?? now,
      exception_type: failure.exception_type,
      traceback: failure.traceback,
      attempts: failure.attempts === undefined ? undefined : String(failure.attempts),
      task_id: env?.task_id,
      task_type: env?.task_type,
    };
    return Object.entries(fields).filter(([, v]) => v !== undefined && v !== null);
  }

  /**
   * Move the entry to the dead-letter stream. A decoded task that asks for a
   * result gets its FAILURE first: the handler's error type, or the failure
   * class when no handler error caused it.
   */
  async deadLetter(entry, env, log, failure) {
    if (env?.ext) await this.failureResult(env, failure, log);
    const qk = this.queueOf(entry.stream);
    const failureArgs = [this.opts.group, entry.id];
    for (const [name, value] of this.failureFields(failure, env, qk.queue)) failureArgs.push(name, typeof value === 'string' ? value : String(value));
    // Only a decoded task (entry.env) has a record; its error names the exception, else the failure class.
    const error = recordError(failure.exception_type ?? failure.failure_class, failure.reason);
    const [keys, args] = withRecord(this.records.final(qk, entry.env?.task_id, { error }), [entry.stream, qk.dead], failureArgs, 2);
    const deadId = await this.settle('dead-letter', qk.dead, log, () => registerThen(
      this.cmd, this.keys.deadQueues, qk.queue, () => this.scripts.run('dead_letter', keys, args)));
    if (!deadId) {
      log.warn('the entry was no longer pending (taken over, or a retried dead letter had landed); not dead-lettered by this consumer', { failure_class: failure.failure_class });
      return;
    }
    this.stats.dead += 1;
    this.statistics.count(qk.queue, entry.env?.task_type ?? UNDECODED_TASK_TYPE, 'dead');
    log.error('entry dead-lettered', {
      failure_class: failure.failure_class, reason: failure.reason, dead_id: deadId, attempts: failure.attempts ?? null,
    });
    this.notify('dead', env ?? null, { ...failure, dead_id: String(deadId) });
  }

  failureResult(env, failure, log) {
    return this.results.failure(env, {
      type: failure.exception_type ?? failure.failure_class, message: failure.reason, traceback: failure.traceback ?? null,
    }, log);
  }

  /**
   * A task requeue.lua dead-lettered as redelivery_limit, read back from its
   * dead-letter entry: counted as dead (section 17), and its FAILURE result written.
   */
  async redeliveryLimitReached(qk, deadId) {
    const [item] = await this.cmd.xrangeBuffer(qk.dead, deadId, deadId);
    const { envelope: env, fields } = item ? readDeadLetter(qk.queue, text(item[0]), item[1], this.opts.limits) : {};
    this.statistics.count(qk.queue, env?.task_type ?? UNDECODED_TASK_TYPE, 'dead');
    if (!env) return; // not a decodable task (or gone): no result to write
    const log = this.queueLogs.get(qk).child({ task_id: env.task_id, trace_id: env.trace_id, task_type: env.task_type });
    await this.failureResult(env, { failure_class: 'redelivery_limit', reason: fields.reason }, log);
  }

  async malformed(entry, err) {
    const partial = err.partial ?? {};
    const str = (v) => (typeof v === 'string' && v.length <= 512 ? v : undefined);
    const known = { task_id: str(partial.task_id), task_type: str(partial.task_type) };
    const log = this.queueLogs.get(this.queueOf(entry.stream)).child({
      task_id: known.task_id ?? null, trace_id: str(partial.trace_id) ?? null, stream: entry.stream, entry_id: entry.id,
    });
    await this.deadLetter(entry, known, log, {
      failure_class: 'malformed_entry', reason: err.reason,
      exception_type: err.violations.length ? `MalformedEntry(${err.kind}: ${err.violations.map((v) => `${v.field}/${v.rule}`).join(', ')})` : `MalformedEntry(${err.kind})`,
    });
  }

  /** Put an entry this consumer holds back at the end of its stream (requeue.lua). */
  async requeueOwn(entry, why) {
    if (entry.taskId === undefined && entry.fields) {
      try {
        const env = decodeEntry(entryFields(entry.fields), { limits: this.opts.limits });
        entry.taskId = env.task_id;
        entry.traceId = env.trace_id;
      } catch {
        // malformed: its ids stay unknown; the next reader dead-letters it
      }
    }
    const qk = this.queueOf(entry.stream);
    const record = entry.fields ? this.records.requeue(qk, entry.taskId) : await this.entryRecord(qk, entry.stream, entry.id);
    const [keys, args] = withRecord(record, [entry.stream, entry.stream, qk.dead],
      [this.opts.group, entry.id, this.consumer, 0, 0, 0, recordTime()], 7);
    const reply = await this.scripts.run('requeue', keys, args);
    if (reply) {
      this.stats.requeued += 1;
      this.queueLogs.get(qk).info('entry put back in its stream', {
        why, stream: entry.stream, entry_id: entry.id, new_id: reply, task_id: entry.taskId ?? null, trace_id: entry.traceId ?? null,
      });
    }
  }

  /**
   * The record requeue.lua writes for entry `id` of `stream`: the entry is read
   * first (XRANGE, through `read`) to learn its task_id; null when it cannot be
   * decoded, is gone, or records are off.
   * @param {QueueKeys} qk
   */
  async entryRecord(qk, stream, id, read = (command) => command()) {
    if (!this.records.on) return null;
    const [item] = await read(() => this.cmd.xrangeBuffer(stream, id, id));
    if (!item) return null;
    try {
      return this.records.requeue(qk, decodeEntry(entryFields(item[1]), { limits: this.opts.limits }).task_id);
    } catch (err) {
      if (err instanceof MalformedEntry) return null;
      throw err;
    }
  }

  // ---------------------------------------------------------------- dead consumers

  takeoverTick() {
    if (this.takingOver || !this.running) return;
    this.takingOver = this.takeOver()
      .catch((err) => this.log.warn('takeover of dead consumers failed', { err }))
      .finally(() => { this.takingOver = null; });
  }

  /**
   * Requeue the entries held by consumers whose liveness key is gone (idle for
   * a lease), and forget dead consumers that hold nothing. Only after two
   * renewals in a row answered at once, and a command of the round that waited
   * for Redis stops it (renewals.js). Returns how many entries were moved
   * (requeued or dead-lettered).
   */
  async takeOver() {
    const before = this.stats.taken_over;
    try {
      for (const [stream, qk] of this.queueOfStream) {
        if (!this.renewals.trusted) break; // right after Redis was away: live consumers may not have renewed yet
        await this.takeOverStream(qk, stream);
        await this.forgetDeadConsumers(qk, stream);
      }
    } catch (err) {
      if (!(err instanceof WaitedForRedis)) throw err;
      this.log.warn('a takeover check waited for Redis; this round stops until two renewals are answered at once', { err });
    }
    return this.stats.taken_over - before;
  }

  /** The takeover of the entries of dead consumers in `stream`, a task stream of queue `qk`. */
  async takeOverStream(qk, stream) {
    const { group, leaseMs, takeoverBatch, maxRedeliveries } = this.opts;
    const log = this.queueLogs.get(qk);
    const checked = (what, command) => this.renewals.check(what, this.cmd, command);
    let summary;
    try {
      summary = await checked('XPENDING', () => this.cmd.xpending(stream, group));
    } catch (err) {
      if (err instanceof WaitedForRedis) throw err;
      return; // no stream or group yet
    }
    for (const [owner, count] of summary?.[3] ?? []) {
      if (owner === PARKED_CONSUMER) continue; // waiting for a limit (section 19), not abandoned
      if (owner === this.consumer) {
        this.checkOwnPending(stream, Number(count));
        continue;
      }
      if (await checked('the liveness check', () => this.cmd.exists(this.keys.consumer(owner)))) continue;
      const items = await checked('XPENDING', () => this.cmd.xpending(stream, group, 'IDLE', leaseMs, '-', '+', takeoverBatch, owner));
      // requeue.lua may dead-letter an entry (redelivery_limit): the queue is listed first.
      if (items.length) await this.cmd.sadd(this.keys.deadQueues, qk.queue);
      for (const [id] of items) {
        // ARGV[8..]: who and where, for a redelivery_limit dead-letter entry (section 7);
        // the consumer is the one that died holding the entry.
        const now = recordTime(); // also the record's finished_at when dead-lettered
        const who = ['queue', qk.queue, 'language', LANGUAGE, 'host', this.host, 'pid', String(process.pid),
          'consumer', owner, 'first_failure_at', now, 'last_failure_at', now];
        const record = await this.entryRecord(qk, stream, id, (command) => checked('XRANGE', command));
        const [keys, args] = withRecord(record, [stream, stream, qk.dead], [group, id, owner, leaseMs, 1, maxRedeliveries, now, ...who], 7);
        const reply = await checked('requeue.lua', () => this.scripts.run('requeue', keys, args));
        if (!reply) continue;
        this.stats.taken_over += 1;
        const dead = String(reply).startsWith('dead:');
        if (dead) await this.redeliveryLimitReached(qk, String(reply).slice('dead:'.length));
        log.warn(dead
          ? 'entry of a dead consumer dead-lettered: redelivery limit reached'
          : 'took over an entry of a dead consumer', { stream, entry_id: id, owner, reply });
      }
    }
  }

  /**
   * More entries pending to this consumer in `stream` than it holds: a read
   * whose reply was lost (ioredis sends a command in flight again after a
   * reconnect, a failover) took entries nobody here knows of. The loop reads
   * this consumer's own pending entries again and handles those it does not hold.
   */
  checkOwnPending(stream, pending) {
    let held = 0;
    for (const tag of this.held) if (tag.startsWith(`${stream} `)) held += 1;
    if (pending <= held || this.recoverAt !== null) return;
    this.log.warn('entries pending to this consumer that it does not hold; reading them again', { stream, pending, held });
    this.recoverAt = Date.now();
  }

  /**
   * Remove from the group the consumers of `stream` without a liveness key that
   * hold nothing and were idle for forgetAfterMs (at least a lease), with
   * forget_consumer.lua, which checks both again atomically. Never a bare
   * XGROUP DELCONSUMER: it would drop entries such a consumer read meanwhile.
   */
  async forgetDeadConsumers(qk, stream) {
    const idleMs = Math.max(this.opts.forgetAfterMs, this.opts.leaseMs);
    let consumers;
    try {
      consumers = (await this.cmd.xinfo('CONSUMERS', stream, this.opts.group)).map(pairsOf);
    } catch {
      return; // no stream or group yet
    }
    for (const c of consumers) {
      const name = text(c.name);
      if (name === this.consumer || Number(c.pending) > 0 || Number(c.idle) < idleMs) continue;
      if (await this.renewals.check('the liveness check', this.cmd, () => this.cmd.exists(this.keys.consumer(name)))) continue;
      const forgotten = await this.scripts.run('forget_consumer', [stream], [this.opts.group, name, idleMs]);
      if (Number(forgotten) === 1) this.queueLogs.get(qk).info('forgot a dead consumer that held nothing', { stream, owner: name, idle_ms: Number(c.idle) });
    }
  }

  // ---------------------------------------------------------------- stopping

  /**
   * Stop cleanly (BullMQ's name); the same as stop().
   * @param {{ graceMs?: number }} [options]
   * @returns {Promise<void>}
   */
  close(options) {
    return this.stop(options);
  }

  /**
   * Stop cleanly; safe to call more than once.
   * @param {{ graceMs?: number }} [options]
   * @returns {Promise<void>}
   */
  stop({ graceMs = this.opts.shutdownGraceMs } = {}) {
    if (!this.stopping) this.stopping = this.shutdown(graceMs);
    return this.stopping;
  }

  async shutdown(graceMs) {
    await this.starting?.catch(() => {});
    this.log.info('worker stopping', { running: this.inflight.size, prefetched: this.waiting.length });
    this.running = false;
    for (const reader of this.readers?.values() ?? []) disconnectClient(reader);
    await this.loopDone?.catch(() => {});
    for (const entry of this.waiting.splice(0)) {
      await this.requeueOwn(entry, 'prefetched but not started before shutdown').catch((err) => this.log.error('requeue failed', { err }));
      this.held.delete(`${entry.stream} ${entry.id}`);
    }
    const graceEnds = Date.now() + graceMs;
    if (this.inflight.size) {
      const all = Promise.allSettled([...this.inflight.values()].map((t) => t.promise));
      if (!(await settlesWithin(all, graceMs))) {
        this.log.warn('tasks still running after the grace period; aborting them', { running: this.inflight.size });
        for (const task of this.inflight.values()) task.abort.abort(new ShutdownAbort());
        await settlesWithin(all, 5000);
      }
    }
    // Abandoned attempts get what is left of the grace period to settle their claims.
    if (this.abandoned.size && !(await settlesWithin(this.abandoned.all(), Math.max(0, graceEnds - Date.now())))) {
      this.abandoned.giveUp(this.log);
    }
    await this.takingOver;
    try {
      // Entries of a read answered while the reading connection was closing.
      for (const stream of this.queueOfStream.keys()) {
        const pending = await this.cmd.xpending(stream, this.opts.group, '-', '+', 10_000, this.consumer);
        for (const [id] of pending) await this.requeueOwn({ stream, id }, 'read while shutting down');
        // Leave the group only if nothing is pending, checked atomically (never a bare DELCONSUMER).
        await this.scripts.run('forget_consumer', [stream], [this.opts.group, this.consumer, 0]);
      }
    } catch (err) {
      this.log.error('could not return every pending entry; they go back once the lease expires', { err });
    }
    clearInterval(this.leaseTimer);
    this.leaseTimer = null;
    clearTimeout(this.renewRetry);
    clearInterval(this.takeoverTimer);
    await this.promoter?.stop().catch(() => {});
    try {
      await this.leaseClient.del(this.keys.consumer(this.consumer));
    } catch (err) {
      this.log.warn('could not delete the liveness key; it expires after the lease', { err });
    }
    if (this.leaseClient) {
      await this.announceSelf(true).catch((err) => this.log.warn('could not write the stopped announcement', { err }));
      if (!(await settlesWithin(this.statistics.close(this.leaseClient), this.opts.leaseMs))) {
        this.log.warn('the last worker statistics write did not finish in time; its counts are lost');
      }
    }
    for (const client of [this.cmd, this.leaseClient, this.subscriber, this.resultClient]) {
      if (client) await closeClient(client);
    }
    this.log.info('worker stopped', { stats: this.stats });
    this.notify('closed', this.stats);
  }
}
