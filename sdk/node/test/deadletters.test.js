// The dead-letter tools as a library: list, show and replay (edited) the entries a worker
// dead-lettered, on the keys the Python tools use.

import assert from 'node:assert/strict';
import { once } from 'node:events';
import { describe, test } from 'node:test';
import {
  DeadLetters, InvalidEnvelope, InvalidPayloadError, KeySpace, Producer, Worker, jsonMergePatch,
} from '../src/index.js';
import { quietLogger, redisSuite, waitFor } from '../support/helpers.js';

const { server, skip, prefixFor, connect } = await redisSuite('dl');

test('merge patch follows RFC 7386', () => {
  assert.deepEqual(jsonMergePatch({ a: 1, b: { c: 2, d: 3 } }, { a: null, b: { c: 5 }, e: [1] }), { b: { c: 5, d: 3 }, e: [1] });
  assert.deepEqual(jsonMergePatch({ a: 1 }, [1]), [1]);
});

describe('dead letters', { skip, concurrency: false }, () => {
  const { redis } = connect();

  test('list, show, replay with an edited payload run by a worker, and a second replay publishes nothing', async () => {
    const prefix = prefixFor();
    const ran = [];
    const worker = new Worker('orders', {
      'order.close': (payload) => {
        if (!payload.order_id) throw new InvalidPayloadError('order_id is required');
        ran.push(payload.order_id);
      },
    }, { connection: server.url, prefix, logger: quietLogger(), leaseMs: 900, blockMs: 100, promoterMaxIdleMs: 200 });
    await worker.waitUntilReady();
    const producer = new Producer({ connection: redis, prefix });
    const dead = once(worker, 'dead');
    const { taskId } = await producer.publish('orders', {
      task_type: 'order.close', payload: { note: 'no id' }, trace_id: 'trace-dl-1', max_retries: 5,
    });
    await dead;

    const tools = new DeadLetters({ connection: redis, prefix });
    assert.deepEqual(await tools.queues(), ['orders']);
    const [entry, ...more] = await tools.list('orders');
    assert.equal(more.length, 0);
    assert.equal(entry.taskId, taskId);
    assert.equal(entry.taskType, 'order.close');
    assert.equal(entry.failureClass, 'invalid_payload');
    assert.equal(entry.fields.language, 'node');
    assert.match(entry.fields.traceback ?? entry.fields.stack ?? '', /InvalidPayloadError/);
    assert.equal(entry.envelope.trace_id, 'trace-dl-1');
    assert.ok(entry.deadAt instanceof Date);
    assert.deepEqual(await tools.list('orders', { failureClass: 'task_error' }), []);
    assert.equal((await tools.get('orders', entry.id)).taskId, taskId);
    assert.equal(await tools.get('orders', '0-1'), null);

    await assert.rejects(tools.replay('orders', entry.id, { payloadVersion: 0 }), InvalidEnvelope);
    const newId = await tools.replay('orders', entry.id, { mergePatch: { order_id: 'R1', note: null }, operator: 'ops@test' });
    assert.ok(newId);
    await waitFor(() => ran.length === 1);
    assert.deepEqual(ran, ['R1']);
    assert.equal(await tools.replay('orders', entry.id), null, 'replayed once');
    assert.deepEqual(await tools.list('orders'), []);
    const records = await redis.xrange(new KeySpace(prefix).queue('orders').replayed, '-', '+');
    assert.equal(records.length, 1);
    const record = Object.fromEntries(records[0][1].flatMap((v, i, all) => (i % 2 ? [] : [[v, all[i + 1]]])));
    assert.equal(record.dead_id, entry.id);
    assert.equal(record.new_id, newId);
    assert.equal(record.operator, 'ops@test');
    await worker.close();
    await producer.close();
    await tools.close();
  });

  test('stats count per queue, task type and failure class; purge deletes what matches', async () => {
    const prefix = prefixFor();
    const worker = new Worker('orders', {
      'a.bad': () => { throw new InvalidPayloadError('bad'); },
    }, { connection: server.url, prefix, logger: quietLogger(), leaseMs: 900, blockMs: 100, promoterMaxIdleMs: 200 });
    await worker.waitUntilReady();
    const producer = new Producer({ connection: redis, prefix });
    await producer.publishMany('orders', [{ task_type: 'a.bad' }, { task_type: 'a.bad' }, { task_type: 'a.unknown' }]);
    const tools = new DeadLetters(redis, { prefix });
    await waitFor(async () => (await tools.list('orders')).length === 3);
    await worker.close();
    const byKey = Object.fromEntries((await tools.stats()).map((s) => [`${s.queue} ${s.taskType} ${s.failureClass}`, s.count]));
    assert.deepEqual(byKey, { 'orders a.bad invalid_payload': 2, 'orders a.unknown unknown_task_type': 1 });
    assert.equal(await tools.purge('orders', { failureClass: 'invalid_payload' }), 2);
    assert.deepEqual((await tools.list('orders')).map((e) => e.taskType), ['a.unknown']);
    await producer.close();
  });
});
