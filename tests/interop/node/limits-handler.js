// limits.task, the handler every language of the cross-language matrix runs alike for the
// limits per task type (docs/protocol.md section 19): payload {"sleep_ms": <int>}; it sleeps
// that long, then records its span, RPUSH <prefix>:mx:spans of the JSON
// {"language": "node", "task_id", "start_ms", "end_ms"} (unix ms with fractions, taken when
// the handler starts and when its sleep ends).

import { performance } from 'node:perf_hooks';
import { setTimeout as sleep } from 'node:timers/promises';
import { InvalidPayloadError } from 'kombu-envelope';

/** Unix time in ms, with fractions. */
const nowMs = () => performance.timeOrigin + performance.now();

/** Register limits.task on `worker`. */
export function registerLimitsHandler(worker) {
  worker.register('limits.task', async (payload, ctx) => {
    const startMs = nowMs();
    const sleepMs = payload?.sleep_ms;
    if (!Number.isSafeInteger(sleepMs) || sleepMs < 0) throw new InvalidPayloadError('payload.sleep_ms must be an integer >= 0');
    await sleep(sleepMs, undefined, { signal: ctx.signal });
    const endMs = nowMs();
    await ctx.redis.rpush(`${ctx.keys.prefix}:mx:spans`, JSON.stringify({
      language: 'node', task_id: ctx.taskId, start_ms: startMs, end_ms: endMs,
    }));
  });
  return worker;
}
