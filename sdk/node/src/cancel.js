// Cancelling by task_id (docs/protocol.md section 10), whatever the queue:
//
//   1. mark it: ZREMRANGEBYSCORE <prefix>:cancelled -inf <now - 7 days> and
//      ZADD <prefix>:cancelled NX <now> <task_id>, in one MULTI;
//   2. run cancel.lua on the delayed set of every queue in <prefix>:queues (or
//      of the one queue named), which answers removed or absent, and writes the
//      task record (state cancelled, reason cancelled) where it removed the task.
//
// The mark comes first and always, so a task promoted, published again or on its
// way to a consumer is caught wherever it arrives; consumers never remove it.

import { withRecord } from './records.js';

/** How long cancel marks are kept (ms). */
export const CANCEL_MARK_TTL_MS = 7 * 24 * 3600 * 1000;

/**
 * What cancel() did: `removed` from the delayed set of `queue`, or only
 * `marked` (first mark), or `already` marked before (`queue` null for both).
 * @typedef {{ outcome: 'removed' | 'marked' | 'already', queue: string | null }} CancelResult
 */

/**
 * Cancel `taskId` on `client` (an ioredis client whose scripts are `scripts`),
 * in the key space `keys`. Options: queue (only this queue's delayed set),
 * nowMs (the mark's time), records (the TaskRecords written; none when absent).
 * @param {any} client
 * @param {import('./scripts.js').Scripts} scripts
 * @param {import('./keys.js').KeySpace} keys
 * @param {string} taskId
 * @param {{ queue?: string, nowMs?: number, records?: import('./records.js').TaskRecords }} [options]
 * @returns {Promise<CancelResult>}
 */
export async function cancelTask(client, scripts, keys, taskId, { queue, nowMs = Date.now(), records } = {}) {
  if (typeof taskId !== 'string' || !taskId) throw new TypeError('cancel: taskId must be a non-empty string');
  const named = queue === undefined ? null : keys.queue(queue); // InvalidQueueName for a bad name
  const replies = await client.multi()
    .zremrangebyscore(keys.cancelled, '-inf', nowMs - CANCEL_MARK_TTL_MS)
    .zadd(keys.cancelled, 'NX', nowMs, taskId)
    .exec();
  for (const [err] of replies) if (err) throw err;
  const marked = Number(replies[1][1]) === 1;
  const queues = named ? [named] : (await client.smembers(keys.queues)).flatMap((name) => {
    try {
      return [keys.queue(name)];
    } catch {
      return []; // not a queue name this protocol allows: it has no delayed set
    }
  });
  let removedFrom = null;
  for (const qk of queues) {
    const [k, args] = withRecord(records?.final(qk, taskId, { reason: 'cancelled' }) ?? null, [qk.delayed, qk.delayedData], [taskId], 1);
    const answer = await scripts.run('cancel', k, args);
    if (answer === 'removed' && removedFrom === null) removedFrom = qk.queue;
  }
  if (removedFrom !== null) return { outcome: 'removed', queue: removedFrom };
  return { outcome: marked ? 'marked' : 'already', queue: null };
}
