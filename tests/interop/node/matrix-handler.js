// matrix.task, the handler every language of the cross-language matrix runs alike
// (tests/interop/go/matrix.go, tests/apps/matrix_app.py, the Java peer):
//
//   * records the attempt: RPUSH <prefix>:mx:attempts:<task_id> "node:<retry_count>"; with
//     payload.log (a string), RPUSH <prefix>:mx:log:<log> "start <task_id>" right after it;
//     then the trace headers it came with: RPUSH <prefix>:mx:trace:<task_id> of the JSON
//     {"language", "traceparent", "tracestate", "trace_id"};
//   * with payload.hold_ms, records RPUSH <prefix>:mx:started:<task_id> "node" and waits;
//   * fails (MatrixFailure, not transient) while payload.fail is true, or for the first
//     payload.fail_times attempts;
//   * otherwise, with payload.log, RPUSH <prefix>:mx:log:<log> "end <task_id>", then records
//     its effect: RPUSH <prefix>:mx:effect:<task_id> "node:<unix ms>",
//     then publishes each task of payload.then ({queue, task_id, then}) as a matrix.task
//     whose payload's then is the nested one, with the peer's producer from inside the
//     handler (so it continues the running task's trace).

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

/** The tasks of payload.then: [{ queue, task_id, then }], each checked. */
function nextTasks(value, name = 'then') {
  if (value === undefined || value === null) return [];
  const rule = `payload.${name} must be a list of {"queue": non-empty string, "task_id": non-empty string, "then": list}`;
  if (!Array.isArray(value)) throw new InvalidPayloadError(rule);
  return value.map((next, i) => {
    if (next === null || typeof next !== 'object' || typeof next.queue !== 'string' || !next.queue
      || typeof next.task_id !== 'string' || !next.task_id) {
      throw new InvalidPayloadError(rule);
    }
    nextTasks(next.then, `${name}[${i}].then`);
    return next;
  });
}

/** Register matrix.task on `worker`; it publishes the tasks of payload.then with `producer`. */
export function registerMatrixHandler(worker, producer) {
  worker.register('matrix.task', async (payload, ctx) => {
    const holdMs = count(payload.hold_ms, 'hold_ms');
    const failTimes = count(payload.fail_times, 'fail_times');
    const then = nextTasks(payload.then);
    if (payload.log !== undefined && typeof payload.log !== 'string') throw new InvalidPayloadError('payload.log must be a string');
    const key = (what) => `${ctx.keys.prefix}:mx:${what}:${ctx.taskId}`;
    // The run's start and end in one list per payload.log (the order of an ordering key's runs).
    const log = async (event) => {
      if (payload.log !== undefined) await ctx.redis.rpush(`${ctx.keys.prefix}:mx:log:${payload.log}`, `${event} ${ctx.taskId}`);
    };
    const attempt = await ctx.redis.rpush(key('attempts'), `node:${ctx.attempt}`);
    await log('start');
    const headers = ctx.envelope.headers ?? {};
    await ctx.redis.rpush(key('trace'), JSON.stringify({
      language: 'node', traceparent: headers.traceparent ?? null, tracestate: headers.tracestate ?? null, trace_id: ctx.traceId,
    }));
    if (holdMs > 0) {
      await ctx.redis.rpush(key('started'), 'node');
      await sleep(holdMs, undefined, { signal: ctx.signal });
    }
    if (payload.fail === true || attempt <= failTimes) throw new MatrixFailure(`matrix.task failed attempt ${attempt}`);
    await log('end');
    await ctx.redis.rpush(key('effect'), `node:${Date.now()}`);
    for (const next of then) {
      await producer.publish(next.queue, { task_type: 'matrix.task', task_id: next.task_id, payload: { then: next.then ?? [] } });
    }
    return { language: 'node' };
  });
  return worker;
}
