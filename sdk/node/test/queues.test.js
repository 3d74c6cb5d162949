// A worker reading several queues (docs/protocol.md section 5, "Reading"), on a
// private redis-server: queue by queue in the configured order with the credit
// left, one blocking wait per queue, and every step on the entry's own queue.

import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, describe, test } from 'node:test';
import Redis from 'ioredis';
import { KeySpace } from '../src/keys.js';
import { Producer } from '../src/producer.js';
import { Worker } from '../src/worker.js';
import { logSink, startRedisServer, waitFor } from '../support/helpers.js';

const Q1 = 'first';
const Q2 = 'second';

describe('a worker of several queues', { concurrency: false }, () => {
  let server;
  let redis;
  const workers = [];

  before(async () => {
    server = await startRedisServer();
    redis = new Redis(server.port, '127.0.0.1');
  });

  after(async () => {
    for (const w of workers) await w.stop({ graceMs: 0 }).catch(() => {});
    redis.disconnect();
    await server.stop();
  });

  const prefixFor = () => `mq-${crypto.randomBytes(4).toString('hex')}`;

  /** A started worker of [Q1, Q2] whose handler 'mq.run' records payload.id. */
  async function startWorker(prefix, options = {}) {
    const ran = [];
    const sink = logSink('info');
    const worker = new Worker([Q1, Q2], { 'mq.run': (payload) => { ran.push(payload.id); } }, {
      connection: server.url, prefix, leaseMs: 1500, blockMs: 200, promoterMaxIdleMs: 200, logger: sink.logger, ...options,
    });
    workers.push(worker);
    await worker.waitUntilReady();
    return { worker, ran, lines: sink.lines };
  }

  test('the queues are given as an array or as the queues option, never with queue', () => {
    const handlers = { 'mq.run': () => {} };
    const options = { connection: server.url, autorun: false };
    assert.deepEqual(new Worker([Q1, Q2], handlers, options).queues.map((qk) => qk.queue), [Q1, Q2]);
    assert.deepEqual(new Worker({ ...options, queues: [Q2, Q1] }).queues.map((qk) => qk.queue), [Q2, Q1]);
    assert.deepEqual(new Worker(Q1, handlers, options).queues.map((qk) => qk.queue), [Q1]);
    assert.throws(() => new Worker({ ...options, queue: Q1, queues: [Q2] }), /give queue or queues, not both/);
    assert.throws(() => new Worker([], handlers, options), /queues must be a non-empty array/);
    assert.throws(() => new Worker([Q1, Q1], handlers, options), /must not repeat a name/);
    assert.throws(() => new Worker([Q1, 'a{b'], handlers, options), /must be non-empty and contain no '\{'/);
  });

  test('tasks of both queues run; dead letters and logs use each entry\'s own queue', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const producer = new Producer(redis, { prefix });
    await producer.publish(Q1, { task_type: 'mq.run', payload: { id: 'a' } });
    await producer.publish(Q2, { task_type: 'mq.run', payload: { id: 'b' } });
    await producer.publish(Q2, { task_type: 'mq.unknown', payload: {} });
    const q2 = ks.queue(Q2);
    const { ran, lines } = await startWorker(prefix, { concurrency: 2 });
    await waitFor(() => ran.length === 2, { message: 'both queues served' });
    await waitFor(async () => (await redis.xlen(q2.dead)) === 1, { message: 'the unknown task type is dead-lettered' });
    assert.deepEqual([...ran].sort(), ['a', 'b']);
    const [dead] = await redis.xrange(q2.dead, '-', '+');
    assert.equal(dead[1][dead[1].indexOf('queue') + 1], Q2);
    assert.equal(await redis.xlen(ks.queue(Q1).dead), 0);
    assert.deepEqual(await redis.smembers(ks.deadQueues), [Q2]);
    assert.deepEqual(new Set(lines.filter((l) => l.msg === 'task succeeded').map((l) => l.queue)), new Set([Q1, Q2]));
    assert.deepEqual(lines.find((l) => l.msg === 'worker ready').queues, [Q1, Q2]);
  });

  test('entries of a dead consumer are taken over in their own queue', async () => {
    const prefix = prefixFor();
    const q2 = new KeySpace(prefix).queue(Q2);
    for (const stream of q2.taskStreams) await redis.xgroup('CREATE', stream, 'workers', '0', 'MKSTREAM');
    await new Producer(redis, { prefix }).publish(Q2, { task_type: 'mq.run', payload: { id: 'ghost' } });
    await redis.xreadgroup('GROUP', 'workers', 'ghost-1', 'COUNT', 1, 'STREAMS', q2.stream('normal'), '>');
    const { ran, lines } = await startWorker(prefix);
    await waitFor(() => ran.includes('ghost'), { timeoutMs: 6000, message: 'the dead consumer\'s entry ran' });
    const took = lines.find((l) => l.msg === 'took over an entry of a dead consumer');
    assert.equal(took.queue, Q2);
    assert.equal(took.stream, q2.stream('normal'));
  });

  test('with credit 1 the first queue is served before the second', async () => {
    const prefix = prefixFor();
    const producer = new Producer(redis, { prefix });
    for (const [queue, id] of [[Q2, 'q2-1'], [Q2, 'q2-2'], [Q1, 'q1-1'], [Q1, 'q1-2']]) {
      await producer.publish(queue, { task_type: 'mq.run', payload: { id } });
    }
    const { ran } = await startWorker(prefix, { concurrency: 1 });
    await waitFor(() => ran.length === 4);
    assert.deepEqual(ran, ['q1-1', 'q1-2', 'q2-1', 'q2-2']);
  });

  test('a task published to either queue wakes the blocked worker at once', async () => {
    const prefix = prefixFor();
    const { ran } = await startWorker(prefix, { blockMs: 5000 });
    await sleep(300); // both waits are blocked, for seconds more
    const producer = new Producer(redis, { prefix });
    for (const queue of [Q2, Q1]) {
      const sent = Date.now();
      await producer.publish(queue, { task_type: 'mq.run', payload: { id: queue } });
      await waitFor(() => ran.includes(queue), { timeoutMs: 1000, message: `a task of ${queue} woke the worker` });
      assert.ok(Date.now() - sent < 1000);
    }
  });
});
