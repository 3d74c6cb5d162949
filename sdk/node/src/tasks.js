// Reading a task record (docs/protocol.md section 14), with the rules every
// reader uses: a scheduled or retrying task that is due and no longer delayed is
// queued (promoted); a running one whose worker has no liveness key is queued
// (taken over); a dead one whose dead-letter entry is gone is failed (purged);
// without a record it is scheduled when delayed, else unknown.

import { readAnnouncements } from './announce.js';
import { Timestamp } from './envelope.js';
import { TASK_STATES } from './records.js';

/**
 * What became of a task: `state` as a reader reports it, `queue` where its
 * record was found (or the one asked about), `record` as written (null when none).
 * @typedef {{ taskId: string, queue: string | null, state: string, record: Record<string, string> | null }} TaskInfo
 */

/**
 * The state of `taskId`, looked for in `queue`, or when none is given in every
 * queue of the registries and of the announced workers.
 * @param {any} client
 * @param {import('./keys.js').KeySpace} keys
 * @param {string} taskId
 * @param {{ queue?: string, log: any }} options
 * @returns {Promise<TaskInfo>}
 */
export async function getTask(client, keys, taskId, { queue, log }) {
  if (typeof taskId !== 'string' || !taskId) throw new TypeError('getTask: taskId must be a non-empty string');
  const queues = queue === undefined ? await knownQueues(client, keys, log) : [keys.queue(queue)];
  for (const qk of queues) {
    const record = await client.hgetall(qk.task(taskId));
    if (Object.keys(record).length) {
      return { taskId, queue: qk.queue, state: await readState(client, keys, qk, taskId, record), record };
    }
  }
  for (const qk of queues) {
    if (await isDelayed(client, qk, taskId)) return { taskId, queue: qk.queue, state: TASK_STATES.scheduled, record: null };
  }
  return { taskId, queue: queue ?? null, state: TASK_STATES.unknown, record: null };
}

/** The state a record reports, corrected for what happened since it was written. */
async function readState(client, keys, qk, taskId, record) {
  const { state } = record;
  if (state === TASK_STATES.scheduled || state === TASK_STATES.retrying) {
    let due;
    try {
      due = Timestamp.parse(record.due_at).epochMs;
    } catch {
      return state;
    }
    if (due > Date.now() || (await isDelayed(client, qk, taskId))) return state;
    return TASK_STATES.queued; // promoted
  }
  if (state === TASK_STATES.running) {
    return (await client.exists(keys.consumer(record.worker ?? ''))) ? state : TASK_STATES.queued; // taken over
  }
  if (state === TASK_STATES.dead && record.dead_id) {
    const found = await client.xrange(qk.dead, record.dead_id, record.dead_id);
    return found.length ? state : TASK_STATES.failed; // purged
  }
  return state;
}

const isDelayed = async (client, qk, taskId) => (await client.zscore(qk.delayed, taskId)) !== null;

/** The queues of the registries and of the announced workers, sorted; names no queue may have are skipped. */
async function knownQueues(client, keys, log) {
  const names = new Set();
  for (const registry of [keys.queues, keys.deadQueues, keys.periodicQueues]) {
    for (const name of await client.smembers(registry)) names.add(name);
  }
  for (const a of await readAnnouncements(client, keys, log)) for (const name of a.queues ?? []) names.add(name);
  return [...names].sort().flatMap((name) => {
    try {
      return [keys.queue(name)];
    } catch {
      return [];
    }
  });
}
