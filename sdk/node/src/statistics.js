// Worker statistics (docs/protocol.md section 17): what only a worker knows, counted
// per (queue, task_type, language) in the hash <prefix>:{<queue>}:stats, fields
// "<task_type> <language> <name>", written only with HINCRBY (and PEXPIRE 30 days).
//
// Counts are summed in memory per field and written with each liveness renewal
// and once more on shutdown: one MULTI per queue, in the queue's slot. A write
// that fails keeps its deltas for the next one; counting never fails or delays a
// task. The buffer holds at most 41 fields per (queue, task_type) and at most
// maxTaskTypes pairs between two writes: counts of further pairs (task types
// nobody serves arrive from the wire) are left out, and logged at the next write.

/** Histogram bucket bounds in seconds, written in the field names exactly so. */
export const HISTOGRAM_BOUNDS = Object.freeze(['0.005', '0.01', '0.025', '0.05', '0.1', '0.25', '0.5', '1', '2.5', '5',
  '10', '30', '60', '300', '900', '3600', 'inf']);

/** The outcomes counted per task type. */
export const OUTCOMES = Object.freeze(['succeeded', 'failed', 'retried', 'dead', 'duplicate']);

/** The histograms: how long a handler ran, how long an attempt waited to start. */
export const HISTOGRAMS = Object.freeze(['run', 'wait']);

/** The task type under which entries whose Envelope could not be decoded are counted. */
export const UNDECODED_TASK_TYPE = '-';

/** Expiry of a statistics hash, refreshed with every write (ms). */
export const STATS_KEEP_MS = 2_592_000_000;

/** Default bound on the (queue, task_type) pairs the buffer holds. */
export const STATS_MAX_TASK_TYPES = 1000;

const LIMITS = HISTOGRAM_BOUNDS.map((le) => (le === 'inf' ? Infinity : Number(le)));

/** The bucket field of an observation of `seconds` in histogram `name`: the first bound at least `seconds`. */
export function bucketField(name, seconds) {
  const i = LIMITS.findIndex((limit) => seconds <= limit);
  return `${name}_le_${HISTOGRAM_BOUNDS[i]}`;
}

/** Counts of one worker's attempts, buffered and written to the statistics hashes. */
export class TaskStatistics {
  /**
   * @param {{ keys: import('./keys.js').KeySpace, language: string, log: any, maxTaskTypes?: number }} options
   */
  constructor({ keys, language, log, maxTaskTypes = STATS_MAX_TASK_TYPES }) {
    this.keys = keys;
    this.language = language;
    this.log = log;
    this.maxTaskTypes = maxTaskTypes;
    /** @type {Map<string, Map<string, Map<string, number>>>} queue -> task_type -> name -> delta */
    this.pending = new Map();
    this.pairs = 0;
    this.refused = 0; // additions left out since the last write because the buffer was full
    this.writing = null;
  }

  /** Add `by` to outcome or bucket `name` of `taskType` on `queue`. */
  add(queue, taskType, name, by = 1) {
    let types = this.pending.get(queue);
    if (!types) this.pending.set(queue, (types = new Map()));
    let fields = types.get(taskType);
    if (!fields) {
      if (this.pairs >= this.maxTaskTypes) {
        this.refused += 1;
        return;
      }
      types.set(taskType, (fields = new Map()));
      this.pairs += 1;
    }
    fields.set(name, (fields.get(name) ?? 0) + by);
  }

  /**
   * Count one outcome of OUTCOMES.
   * @param {string} queue
   * @param {string} taskType
   * @param {'succeeded' | 'failed' | 'retried' | 'dead' | 'duplicate'} outcome
   */
  count(queue, taskType, outcome) {
    this.add(queue, taskType, outcome);
  }

  /**
   * One observation of `seconds` (negative counts as 0) in histogram `name`.
   * @param {string} queue
   * @param {string} taskType
   * @param {'run' | 'wait'} name
   * @param {number} seconds
   */
  observe(queue, taskType, name, seconds) {
    const s = Math.max(0, seconds);
    this.add(queue, taskType, bucketField(name, s));
    this.add(queue, taskType, `${name}_sum_us`, Math.round(s * 1e6));
  }

  /**
   * Write what was counted: one MULTI of HINCRBYs and the PEXPIRE per queue. A
   * write still in flight is waited for, not doubled. A queue whose write failed
   * keeps its deltas for the next write; never throws.
   * @param {any} client
   * @returns {Promise<void>}
   */
  flush(client) {
    if (!this.writing) this.writing = this.write(client).finally(() => { this.writing = null; });
    return this.writing;
  }

  /**
   * The last write, when the worker stops: after the write in flight, whatever was counted since.
   * @param {any} client
   */
  async close(client) {
    await this.writing;
    await this.flush(client);
  }

  async write(client) {
    const taken = this.pending;
    this.pending = new Map();
    this.pairs = 0;
    if (this.refused) {
      this.log.warn('worker statistics buffer full: counts of further task types were left out', { left_out: this.refused, max_task_types: this.maxTaskTypes });
      this.refused = 0;
    }
    await Promise.all([...taken].map(async ([queue, types]) => {
      const key = this.keys.queue(queue).stats;
      try {
        const multi = client.multi();
        for (const [taskType, fields] of types) {
          for (const [name, by] of fields) multi.hincrby(key, `${taskType} ${this.language} ${name}`, by);
        }
        for (const [err] of await multi.pexpire(key, STATS_KEEP_MS).exec()) if (err) throw err;
      } catch (err) {
        this.log.warn('could not write the worker statistics; they are added to the next write', { err, queue });
        for (const [taskType, fields] of types) for (const [name, by] of fields) this.add(queue, taskType, name, by);
      }
    }));
  }
}
