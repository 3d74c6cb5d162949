// Cancelling by task_id for every queue (docs/protocol.md section 10), against a real Redis:
// Producer#cancel marks <prefix>:cancelled and removes the task from the delayed sets.

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import {
  CANCEL_MARK_TTL_MS, InvalidQueueName, KeySpace, Producer, Timestamp, Worker,
} from '../src/index.js';
import { quietLogger, redisSuite, waitFor } from '../support/helpers.js';

const { server, skip, prefixFor, connect } = await redisSuite('cx');
const later = () => Timestamp.fromEpochMs(Date.now() + 3_600_000);

describe('cancel', { skip, concurrency: false }, () => {
  const { redis } = connect();

  test('a delayed task is removed from whichever queue holds it; the mark is written first and always', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const producer = new Producer(redis, { prefix });
    await producer.publish('alpha', { task_type: 'a.b', schedule_time: later() });
    const { taskId } = await producer.publish('beta', { task_type: 'a.b', schedule_time: later() });
    assert.deepEqual((await redis.smembers(ks.queues)).sort(), ['alpha', 'beta']);
    const before = Date.now();
    assert.deepEqual(await producer.cancel(taskId), { outcome: 'removed', queue: 'beta' });
    const score = Number(await redis.zscore(ks.cancelled, taskId));
    assert.ok(score >= before && score <= Date.now(), String(score));
    assert.equal(await redis.zscore(ks.queue('beta').delayed, taskId), null);
    assert.equal(await redis.hexists(ks.queue('beta').delayedData, taskId), 0);
    assert.equal(await redis.zcard(ks.queue('alpha').delayed), 1, 'the other queue keeps its task');
    assert.deepEqual(await producer.cancel(taskId), { outcome: 'already', queue: null });
    assert.equal(Number(await redis.zscore(ks.cancelled, taskId)), score, 'NX: the first mark keeps its time');
    assert.deepEqual(await producer.cancel('never-published'), { outcome: 'marked', queue: null });
    assert.equal(await redis.exists(`${prefix}:{beta}:cancelled`), 0, 'no per-queue marks any more');
  });

  test('the variant that names one queue looks only there', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const producer = new Producer(redis, { prefix });
    const { taskId } = await producer.publish('beta', { task_type: 'a.b', schedule_time: later() });
    assert.deepEqual(await producer.cancel(taskId, { queue: 'alpha' }), { outcome: 'marked', queue: null });
    assert.notEqual(await redis.zscore(ks.queue('beta').delayed, taskId), null);
    assert.deepEqual(await producer.cancel(taskId, { queue: 'beta' }), { outcome: 'removed', queue: 'beta' });
    await assert.rejects(producer.cancel(taskId, { queue: 'a{b}' }), InvalidQueueName);
    await assert.rejects(producer.cancel(''), /taskId must be a non-empty string/);
  });

  test('marks older than 7 days are trimmed in the same MULTI', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const now = Date.now();
    await redis.zadd(ks.cancelled, now - CANCEL_MARK_TTL_MS - 1, 'too-old', now - CANCEL_MARK_TTL_MS + 60_000, 'six-days-old');
    await new Producer(redis, { prefix }).cancel('fresh', { nowMs: now });
    assert.deepEqual(await redis.zrange(ks.cancelled, 0, -1), ['six-days-old', 'fresh']);
  });

  test('the worker looks a batch up with one ZMSCORE of <prefix>:cancelled and runs only the unmarked', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const producer = new Producer(redis, { prefix });
    const ran = [];
    const tasks = [];
    for (let i = 0; i < 3; i += 1) tasks.push(await producer.publish('orders', { task_type: 'a.b', payload: { i } }));
    await producer.cancel(tasks[1].taskId);
    const monitor = await redis.monitor();
    const zmscores = [];
    monitor.on('monitor', (_time, args) => {
      if (String(args[0]).toLowerCase() === 'zmscore' && args[1] === ks.cancelled) zmscores.push(args.slice(2));
    });
    const worker = new Worker('orders', { 'a.b': (payload) => { ran.push(payload.i); } }, {
      connection: server.url, prefix, concurrency: 3, leaseMs: 900, blockMs: 100, promoterMaxIdleMs: 200,
      logger: quietLogger(),
    });
    try {
      await waitFor(() => worker.stats.succeeded === 2 && worker.stats.cancelled === 1);
      assert.deepEqual(ran.sort(), [0, 2]);
      assert.deepEqual(zmscores, [tasks.map((t) => t.taskId)]);
      assert.notEqual(await redis.zscore(ks.cancelled, tasks[1].taskId), null);
    } finally {
      monitor.disconnect();
      await worker.close();
    }
  });
});
