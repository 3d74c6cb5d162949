// matrix.task, the handler every language of the cross-language matrix runs alike
// (tests/interop/go/matrix.go, tests/apps/matrix_app.py, the Java peer):
//
//   * records the attempt: RPUSH <prefix>:mx:attempts:<task_id> "node:<retry_count>";
//   * with payload.hold_ms, records RPUSH <prefix>:mx:started:<task_id> "node" and waits;
//   * fails (MatrixFailure, not transient) while payload.fail is true, or for the first
//     payload.fail_times attempts;
//   * otherwise records its effect: RPUSH <prefix>:mx:effect:<task_id> "node:<unix ms>".

import { setTimeout as sleep } from 'node:timers/promises';
import { InvalidPayloadError } from 'kombu-envelope';

export class MatrixFailure extends Error {
  constructor(message) {
    super(message);
    this.name = 'MatrixFailure';
  }
}

const count = (value, name) => {
  if (value === undefined) return 0;
  if (!Number.isSafeInteger(Number(value)) || Number(value) < 0) {
    throw new InvalidPayloadError(`payload.${name} must be an integer >= 0`);
  }
  return Number(value);
};

/** Register matrix.task on `worker`. */
export function registerMatrixHandler(worker) {
  worker.register('matrix.task', async (payload, ctx) => {
    const holdMs = count(payload.hold_ms, 'hold_ms');
    const failTimes = count(payload.fail_times, 'fail_times');
    const key = (what) => `${ctx.keys.prefix}:mx:${what}:${ctx.taskId}`;
    const attempt = await ctx.redis.rpush(key('attempts'), `node:${ctx.attempt}`);
    if (holdMs > 0) {
      await ctx.redis.rpush(key('started'), 'node');
      await sleep(holdMs, undefined, { signal: ctx.signal });
    }
    if (payload.fail === true || attempt <= failTimes) throw new MatrixFailure(`matrix.task failed attempt ${attempt}`);
    await ctx.redis.rpush(key('effect'), `node:${Date.now()}`);
    return { language: 'node' };
  });
  return worker;
}
