// The BullMQ-like forms: new Producer({ connection }), new Worker(queue, handlers, options)
// started at once, its events, close(), publishMany, and an ioredis client as the connection.

import assert from 'node:assert/strict';
import { once } from 'node:events';
import { describe, test } from 'node:test';
import Redis from 'ioredis';
import {
  InvalidEnvelope, InvalidPayloadError, KeySpace, Producer, Worker, parseRedisUrl,
} from '../src/index.js';
import { quietLogger, redisSuite, waitFor } from '../support/helpers.js';

const { server, skip, prefixFor, connect } = await redisSuite('api');

const FAST = { leaseMs: 900, blockMs: 100, promoterMaxIdleMs: 200 };

describe('BullMQ-like API', { skip, concurrency: false }, () => {
  const { redis } = connect();

  test('a worker built from a queue and handlers starts by itself and reports each outcome', async () => {
    const prefix = prefixFor();
    const seen = [];
    const worker = new Worker('orders', {
      'order.close': async (payload) => ({ closed: payload.order_id }),
      'order.check': {
        handler: (payload) => {
          if (!payload.order_id) throw new InvalidPayloadError('order_id is required');
        },
        payloadVersions: [1, 2],
      },
    }, { connection: server.url, prefix, concurrency: 3, logger: quietLogger(), ...FAST });
    worker.on('completed', (env, info) => seen.push(['completed', env.task_type, info.result]));
    worker.on('failed', (env, err, info) => seen.push(['failed', env.task_type, err.name, info.retrying]));
    worker.on('dead', (env, failure) => seen.push(['dead', env.task_type, failure.failure_class]));
    await worker.waitUntilReady();
    assert.equal(worker.opts.concurrency, 3);
    assert.deepEqual([...worker.handlers.get('order.check').payloadVersions], [1, 2]);

    const producer = new Producer({ connection: server.url, prefix });
    await producer.publish('orders', { task_type: 'order.close', payload: { order_id: 'A1' } });
    await producer.publish('orders', { task_type: 'order.check', payload_version: 2, payload: {} });
    await waitFor(() => seen.length === 3, { message: () => JSON.stringify(seen) });
    await producer.close();
    const closed = once(worker, 'closed');
    await worker.close();
    await closed;
    assert.deepEqual(seen.find((s) => s[0] === 'completed'), ['completed', 'order.close', { closed: 'A1' }]);
    assert.deepEqual(seen.find((s) => s[0] === 'failed'), ['failed', 'order.check', 'InvalidPayloadError', false]);
    assert.deepEqual(seen.find((s) => s[0] === 'dead'), ['dead', 'order.check', 'invalid_payload']);
    assert.equal(await redis.exists(new KeySpace(prefix).consumer(worker.consumer)), 0);
  });

  test('an ioredis client given as the connection is duplicated by the worker and left open', async () => {
    const prefix = prefixFor();
    const client = new Redis(parseRedisUrl(server.url));
    const worker = new Worker('orders', { 'order.close': () => 'ok' },
      { connection: client, prefix, logger: quietLogger(), ...FAST });
    await worker.waitUntilReady();
    assert.notEqual(worker.cmd, client);
    const producer = new Producer({ connection: client, prefix });
    const done = once(worker, 'completed');
    await producer.publish('orders', { task_type: 'order.close', payload: {} });
    await done;
    await producer.close();
    await worker.close();
    assert.equal(await client.ping(), 'PONG');
    client.disconnect();
  });

  test('publishMany checks every Envelope before writing any, then writes them all', async () => {
    const prefix = prefixFor();
    const producer = new Producer({ connection: redis, prefix });
    const qk = new KeySpace(prefix).queue('orders');
    await assert.rejects(producer.publishMany('orders', [
      { task_type: 'order.close', payload: {} },
      { task_type: 'not a type', payload: {} },
    ]), InvalidEnvelope);
    assert.equal(await redis.exists(qk.stream('normal')), 0);
    const results = await producer.publishMany('orders', [
      { task_type: 'order.close', payload: { n: 1 } },
      { task_type: 'order.close', payload: { n: 2 }, priority: 200 },
      { task_type: 'order.close', payload: { n: 3 }, schedule_time: new Date(Date.now() + 60_000).toISOString() },
    ]);
    assert.deepEqual(results.map((r) => r.delayed), [false, false, true]);
    assert.equal(await redis.xlen(qk.stream('normal')), 1);
    assert.equal(await redis.xlen(qk.stream('high')), 1);
    assert.equal(await redis.zcard(qk.delayed), 1);
    await producer.close();
    assert.equal(await redis.ping(), 'PONG', 'a given client stays open');
  });

  test('autorun: false waits for start()', async () => {
    const worker = new Worker('orders', {}, { connection: server.url, prefix: prefixFor(), autorun: false, logger: quietLogger() });
    assert.equal(worker.running, false);
    await worker.start();
    assert.equal(worker.running, true);
    await worker.close();
  });
});
