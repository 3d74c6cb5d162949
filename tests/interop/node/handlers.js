// Handlers built into the peer's worker, used by the cross-language tests.

import { setTimeout as sleep } from 'node:timers/promises';
import { InvalidPayloadError, TransientError } from 'kombu-envelope';

export class TestFailure extends Error {
  constructor(message) {
    super(message);
    this.name = 'TestFailure';
  }
}

export function registerBuiltinHandlers(worker) {
  // The business effect: count closings per order and log who ran it.
  worker.register('order.close_timeout', async (payload, ctx) => {
    const orderId = payload.order_id;
    if (!['string', 'number', 'bigint'].includes(typeof orderId) || orderId === '') {
      throw new InvalidPayloadError('payload.order_id (a string or an integer) is required');
    }
    const prefix = ctx.keys.prefix;
    const replies = await ctx.redis.multi()
      .incr(`${prefix}:effects:order.close_timeout:${orderId}`)
      .rpush(`${prefix}:effects:log`, `node:${ctx.taskId}`)
      .exec();
    for (const [err] of replies) if (err) throw err;
    ctx.log.info('order closed', { order_id: String(orderId) });
  });
  worker.register('test.fail', async () => {
    throw new TestFailure('test.fail always fails');
  });
  worker.register('test.transient', async () => {
    throw new TransientError('test.transient: simulated lock conflict');
  });
  worker.register('test.sleep', async (payload, ctx) => {
    const ms = Number(payload.ms ?? 0);
    if (!Number.isFinite(ms) || ms < 0) throw new InvalidPayloadError('payload.ms must be a number of milliseconds >= 0');
    await sleep(ms, undefined, { signal: ctx.signal });
  });
  return worker;
}
