// Task records (docs/protocol.md section 14): the hash <prefix>:{<queue>}:task:<task_id>,
// written by each step of a task in the script call or MULTI that makes the step.
//
// A script takes the record as its optional last KEY and the record spec
// {"ttl_ms", "fields"} right after its fixed ARGV; a MULTI (start, the
// acknowledgements) gets HSET (+ HINCRBY attempts) + PEXPIRE.
// A record in a final state expires the retention after its write; any other
// expires 7 days (or the retention, if longer) after the later of its write and
// its due time. A retention of 0 writes no record.

/** Task record states; a reader also reports `failed` and `unknown`. */
export const TASK_STATES = Object.freeze({
  scheduled: 'scheduled', queued: 'queued', running: 'running', retrying: 'retrying',
  succeeded: 'succeeded', dead: 'dead', cancelled: 'cancelled', failed: 'failed', unknown: 'unknown',
});

/** Default task_record_retention (ms): how long a record in a final state is kept. */
export const TASK_RECORD_RETENTION_MS = 3_600_000;

/** Least time a record in a non-final state is kept after the later of its write and its due time (ms). */
const ACTIVE_RECORD_KEEP_MS = 7 * 24 * 3600 * 1000;

/** Longest `error` field of a record, in characters. */
const MAX_RECORD_ERROR = 1000;

/** A record time: RFC 3339 in UTC with milliseconds. */
export const recordTime = (ms = Date.now()) => new Date(ms).toISOString();

/** The `error` field of a record: "<type>: <message>", cut to 1,000 characters. */
export function recordError(kind, message) {
  return [...`${kind}: ${message}`].slice(0, MAX_RECORD_ERROR).join('');
}

/** The record fields of a publish (or a replay) of `env` on `queue`. */
export function publishedFields(env, queue) {
  return {
    task_type: env.task_type, payload_version: String(env.payload_version), queue,
    retry_count: String(env.retry_count),
  };
}

/** The record one step writes: its key and spec. */
export class TaskRecord {
  constructor(key, spec) {
    this.key = key;
    this.spec = spec;
  }

  /**
   * `keys` and `args` of a script call with the record added: its key last,
   * its spec at `fixed` (right after the script's fixed ARGV).
   * @param {string[]} keys
   * @param {any[]} args
   * @param {number} fixed
   */
  script(keys, args, fixed) {
    return [[...keys, this.key], [...args.slice(0, fixed), JSON.stringify(this.spec), ...args.slice(fixed)]];
  }

  /** Queue the record's fields, `state` and expiry on `multi`; `attempts` + 1 when `start`. */
  hset(multi, state, { start = false } = {}) {
    multi.hset(this.key, { ...this.spec.fields, state });
    if (start) multi.hincrby(this.key, 'attempts', 1);
    if (this.spec.ttl_ms > 0) multi.pexpire(this.key, this.spec.ttl_ms);
    return multi;
  }
}

/** `keys`/`args` of a script call with `record` added, unchanged when `record` is null. */
export function withRecord(record, keys, args, fixed) {
  return record ? record.script(keys, args, fixed) : [keys, args];
}

/** The task records one writer (producer, worker, dead-letter tool) writes. */
export class TaskRecords {
  /** @param {number} [retentionMs] task_record_retention in ms; 0 turns records off */
  constructor(retentionMs = TASK_RECORD_RETENTION_MS) {
    if (!Number.isSafeInteger(retentionMs) || retentionMs < 0) {
      throw new RangeError(`taskRecordRetentionMs must be an integer number of milliseconds >= 0, not ${retentionMs}`);
    }
    this.retentionMs = retentionMs;
  }

  /** Whether this writer writes records. */
  get on() {
    return this.retentionMs > 0;
  }

  /**
   * The record of a step that ends the task (succeeded, dead, cancelled), or null.
   * @param {import('./keys.js').QueueKeys} qk
   */
  final(qk, taskId, fields = {}) {
    return this.step(qk, taskId, { finished_at: recordTime(), ...fields }, this.retentionMs);
  }

  /** The record of a step after which the task still runs, due at `dueAtMs` (0: now), or null. */
  active(qk, taskId, dueAtMs, fields = {}) {
    const keep = Math.max(ACTIVE_RECORD_KEEP_MS, this.retentionMs) + Math.max(dueAtMs - Date.now(), 0);
    return this.step(qk, taskId, fields, keep);
  }

  /** The record of requeue.lua, which ends queued (kept as active) or dead (kept the retention). */
  requeue(qk, taskId) {
    const record = this.step(qk, taskId, {}, Math.max(ACTIVE_RECORD_KEEP_MS, this.retentionMs));
    if (record) record.spec.dead_ttl_ms = this.retentionMs;
    return record;
  }

  step(qk, taskId, fields, ttlMs) {
    if (!this.on || typeof taskId !== 'string' || !taskId) return null;
    return new TaskRecord(qk.task(taskId), { ttl_ms: ttlMs, fields: { updated_at: recordTime(), ...fields } });
  }
}
