// Protocol revision 5 against a real Redis: task records (section 14), worker
// announcements (section 15) and payload schemas (section 16).

import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { describe, test } from 'node:test';
import {
  DeadLetters, InvalidEnvelope, KeySpace, NotServed, Producer, RETRY_POLICY_HEADER, RejectedError, TIERED, Timestamp,
  TransientError, Worker,
} from '../src/index.js';
import { logSink, redisSuite, waitFor } from '../support/helpers.js';

const { server, skip, prefixFor, connect } = await redisSuite('r5');
const QUEUE = 'rec';
const DAY_MS = 86_400_000;
const ORDER_SCHEMA = JSON.stringify({
  type: 'object', required: ['order_id'], additionalProperties: false,
  properties: { order_id: { type: 'integer', minimum: 1 } },
});

describe('revision 5', { skip, concurrency: false }, () => {
  const { redis, workers } = connect();

  /** A producer and a started worker on `prefix`; `handlers` are registered on the worker. */
  async function setup(prefix, handlers = {}, options = {}) {
    const sink = logSink();
    const producer = new Producer(redis, { prefix, logger: sink.logger, ...options.producer });
    let worker = null;
    if (handlers !== null) {
      worker = new Worker({
        redis: server.url, prefix, queue: QUEUE, leaseMs: 900, blockMs: 100, backoffMs: 50, maxBackoffMs: 100,
        deferMs: 100, promoterMaxIdleMs: 100, logger: sink.logger, ...options.worker,
      });
      for (const [type, fn] of Object.entries(handlers)) worker.register(type, fn, { payloadVersions: [1, 2] });
      workers.push(worker);
      await worker.start();
    }
    return { producer, worker, lines: sink.lines, qk: new KeySpace(prefix).queue(QUEUE) };
  }
  const stateOf = async (producer, taskId) => (await producer.getTask(taskId, { queue: QUEUE })).state;
  const until = (producer, taskId, state) => waitFor(async () => (await stateOf(producer, taskId)) === state,
    { timeoutMs: 5000, message: `task ${taskId} never became ${state}` });

  test('publish now and later, batch included; the reader corrects a promoted task', async () => {
    const { producer, qk } = await setup(prefixFor(), null);
    const now = await producer.publish(QUEUE, { task_type: 'a.b', payload: { x: 1 } });
    const record = await redis.hgetall(qk.task(now.taskId));
    assert.equal(record.state, 'queued');
    assert.deepEqual([record.task_type, record.payload_version, record.queue, record.retry_count], ['a.b', '1', QUEUE, '0']);
    assert.match(record.published_at, /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/);
    assert.ok(Number(await redis.pttl(qk.task(now.taskId))) > 7 * DAY_MS - 60_000, 'a record not final is kept 7 days');
    const dueAt = Date.now() + 60_000;
    const [later, other] = await producer.publishMany(QUEUE, [
      { task_type: 'a.b', schedule_time: Timestamp.fromEpochMs(dueAt) }, { task_type: 'a.c' }]);
    const delayed = await redis.hgetall(qk.task(later.taskId));
    assert.equal(delayed.state, 'scheduled');
    assert.equal(Timestamp.parse(delayed.due_at).epochMs, dueAt);
    assert.ok(Number(await redis.pttl(qk.task(later.taskId))) > 7 * DAY_MS + 50_000, 'kept 7 days after its due time');
    assert.equal((await redis.hgetall(qk.task(other.taskId))).state, 'queued');
    // Due and out of the delayed set (as promote.lua leaves it): queued.
    await redis.hset(qk.task(later.taskId), 'due_at', Timestamp.fromEpochMs(Date.now() - 1).toString());
    assert.equal(await stateOf(producer, later.taskId), 'scheduled', 'still delayed');
    await redis.zrem(qk.delayed, later.taskId);
    assert.equal(await stateOf(producer, later.taskId), 'queued');
    assert.deepEqual(await producer.getTask('nobody'), { taskId: 'nobody', queue: null, state: 'unknown', record: null });
    const found = await producer.getTask(later.taskId);
    assert.equal(found.queue, QUEUE, 'found through <prefix>:queues without naming the queue');
    await redis.del(qk.task(other.taskId));
    await redis.zadd(qk.delayed, Date.now() + 60_000, other.taskId);
    assert.equal(await stateOf(producer, other.taskId), 'scheduled', 'no record, delayed: scheduled');
  });

  test('start, success, retry, dead letter, purge and replay', async () => {
    const prefix = prefixFor();
    let release;
    const gate = new Promise((resolve) => { release = resolve; });
    let flaky = 0;
    const { producer, worker, qk } = await setup(prefix, {
      'a.wait': () => gate,
      'a.flaky': () => {
        flaky += 1;
        if (flaky === 1) throw new TransientError('try again');
      },
      'a.reject': () => { throw new RejectedError('never'); },
    });
    const waiting = await producer.publish(QUEUE, { task_type: 'a.wait' });
    await until(producer, waiting.taskId, 'running');
    const running = await redis.hgetall(qk.task(waiting.taskId));
    assert.deepEqual([running.attempts, running.worker, running.language, running.pid], ['1', worker.consumer, 'node', String(process.pid)]);
    assert.ok(running.started_at && running.host);
    release();
    await until(producer, waiting.taskId, 'succeeded');
    const done = await redis.hgetall(qk.task(waiting.taskId));
    assert.ok(done.finished_at && !done.reason);
    const ttl = Number(await redis.pttl(qk.task(waiting.taskId)));
    assert.ok(ttl > 3_500_000 && ttl <= 3_600_000, `a final record is kept the retention, ${ttl}`);

    const flakyTask = await producer.publish(QUEUE, { task_type: 'a.flaky', max_retries: 2, headers: { [RETRY_POLICY_HEADER]: TIERED } });
    await until(producer, flakyTask.taskId, 'succeeded');
    const retried = await redis.hgetall(qk.task(flakyTask.taskId));
    assert.deepEqual([retried.attempts, retried.retry_count, retried.error], ['2', '1', 'TransientError: try again']);

    const purged = await producer.publish(QUEUE, { task_type: 'a.reject' });
    const rejected = await producer.publish(QUEUE, { task_type: 'a.reject' });
    await until(producer, purged.taskId, 'dead');
    await until(producer, rejected.taskId, 'dead');
    const dead = await redis.hgetall(qk.task(rejected.taskId));
    assert.equal(dead.error, 'RejectedError: never');
    assert.equal((await redis.xrange(qk.dead, dead.dead_id, dead.dead_id)).length, 1);
    await redis.xdel(qk.dead, await redis.hget(qk.task(purged.taskId), 'dead_id'));
    assert.equal(await stateOf(producer, purged.taskId), 'failed', 'dead, its entry purged');
    await worker.stop({ graceMs: 0 });
    const tools = new DeadLetters(redis, { prefix });
    await tools.replay(QUEUE, dead.dead_id, { payload: { again: true }, retryCount: 1 });
    const replayed = await redis.hgetall(qk.task(rejected.taskId));
    assert.deepEqual([replayed.state, replayed.task_type, replayed.queue, replayed.retry_count], ['queued', 'a.reject', QUEUE, '1']);
  });

  test('skips: cancelled, expired, duplicate; cancel of a delayed task; deferral', async () => {
    const { producer, qk } = await setup(prefixFor(), null);
    const marked = await producer.prepare({ task_type: 'a.ok' });
    await producer.cancel(marked.task_id);
    await producer.publish(QUEUE, { task_id: marked.task_id, task_type: 'a.ok' });
    const expiring = await producer.publish(QUEUE, { task_type: 'a.ok' }, { expiresInMs: 1 });
    const first = await producer.publish(QUEUE, { task_type: 'a.ok', idempotency_key: 'k1' });
    const delayed = await producer.publish(QUEUE, { task_type: 'a.ok', schedule_time: Timestamp.fromEpochMs(Date.now() + 60_000) });
    assert.deepEqual(await producer.cancel(delayed.taskId), { outcome: 'removed', queue: QUEUE });
    const cancelled = await redis.hgetall(qk.task(delayed.taskId));
    assert.deepEqual([cancelled.state, cancelled.reason], ['cancelled', 'cancelled']);
    assert.ok(cancelled.finished_at);
    await sleep(5);
    let hold;
    const held = new Promise((resolve) => { hold = resolve; });
    const { worker } = await setup(qk.prefix, { 'a.ok': () => {}, 'a.hold': () => held });
    await until(producer, first.taskId, 'succeeded');
    const dup = await producer.publish(QUEUE, { task_type: 'a.ok', idempotency_key: 'k1' });
    await until(producer, dup.taskId, 'succeeded');
    assert.equal(await redis.hget(qk.task(dup.taskId), 'reason'), 'duplicate');
    assert.deepEqual(await redis.hmget(qk.task(marked.task_id), 'state', 'reason'), ['cancelled', 'cancelled']);
    assert.deepEqual(await redis.hmget(qk.task(expiring.taskId), 'state', 'reason'), ['cancelled', 'expired']);
    // A busy idempotency key (held by a live consumer) defers the task: scheduled.
    await redis.set(new KeySpace(qk.prefix).idempotency('a.hold', 'busy'), `running ${worker.consumer}-other x`);
    await redis.set(new KeySpace(qk.prefix).consumer(`${worker.consumer}-other`), 'alive', 'PX', 60_000);
    const deferred = await producer.publish(QUEUE, { task_type: 'a.hold', idempotency_key: 'busy' });
    await waitFor(async () => (await redis.hget(qk.task(deferred.taskId), 'state')) === 'scheduled', { timeoutMs: 5000 });
    assert.ok(await redis.hget(qk.task(deferred.taskId), 'due_at'));
    hold();
  });

  test('takeover and the reader of a running task whose worker died', async () => {
    const prefix = prefixFor();
    let release;
    const gate = new Promise((resolve) => { release = resolve; });
    const { producer, qk } = await setup(prefix, null);
    const orphan = await producer.publish(QUEUE, { task_type: 'a.wait' });
    await redis.xgroup('CREATE', qk.stream('normal'), 'workers', '0', 'MKSTREAM');
    await redis.xreadgroup('GROUP', 'workers', 'ghost', 'COUNT', 1, 'STREAMS', qk.stream('normal'), '>');
    await redis.hset(qk.task(orphan.taskId), 'state', 'running', 'worker', 'ghost');
    assert.equal(await stateOf(producer, orphan.taskId), 'queued', 'running on a consumer without liveness: queued');
    const busy = await producer.publish(QUEUE, { task_type: 'a.wait' }); // keeps the only slot busy
    const started = await setup(prefix, { 'a.wait': () => gate }, { worker: { concurrency: 1 } });
    await until(producer, busy.taskId, 'running');
    // requeue.lua rewrites the record: the state set by hand above becomes queued.
    await waitFor(async () => (await redis.hget(qk.task(orphan.taskId), 'state')) === 'queued', { timeoutMs: 6000 });
    assert.deepEqual(await redis.xpending(qk.stream('normal'), 'workers', '-', '+', 10, 'ghost'), []);
    await redis.del(new KeySpace(prefix).consumer(started.worker.consumer));
    assert.equal(await stateOf(producer, busy.taskId), 'queued');
    release();
  });

  test('records expire after the retention; 0 writes none', async () => {
    const prefix = prefixFor();
    const { producer, qk } = await setup(prefix, { 'a.ok': () => {} },
      { worker: { taskRecordRetentionMs: 300 }, producer: { taskRecordRetentionMs: 300 } });
    const task = await producer.publish(QUEUE, { task_type: 'a.ok' });
    await until(producer, task.taskId, 'succeeded');
    await waitFor(async () => (await redis.exists(qk.task(task.taskId))) === 0, { timeoutMs: 3000 });
    assert.equal(await stateOf(producer, task.taskId), 'unknown');
    const off = new Producer(redis, { prefix, taskRecordRetentionMs: 0 });
    const silent = await off.publish('other', { task_type: 'a.ok' });
    assert.equal(await redis.exists(new KeySpace(prefix).queue('other').task(silent.taskId)), 0);
  });

  test('announcements, stopped_at and the served check', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const strict = new Producer(redis, { prefix, requireServed: true });
    await assert.rejects(strict.publish(QUEUE, { task_type: 'a.ok' }),
      (err) => err instanceof NotServed && /no worker of this queue was seen/.test(err.message));
    const { worker } = await setup(prefix, { 'a.ok': () => {} }, { worker: { concurrency: 3 } });
    const announced = JSON.parse(await redis.get(ks.worker(worker.consumer)));
    assert.deepEqual({ ...announced, host: null, started_at: null, seen_at: null }, {
      consumer: worker.consumer, language: 'node', host: null, pid: process.pid, queues: [QUEUE],
      serves: { 'a.ok': [1, 2] }, concurrency: 3, started_at: null, seen_at: null, heartbeat_ms: 300,
    });
    assert.ok(Number(await redis.zscore(ks.workers, worker.consumer)) > Date.now() - 5000);
    assert.ok(Number(await redis.pttl(ks.worker(worker.consumer))) > 3_500_000);
    await strict.publish(QUEUE, { task_type: 'a.ok', payload_version: 2 });
    await assert.rejects(strict.publish(QUEUE, { task_type: 'a.ok', payload_version: 3 }),
      (err) => err instanceof NotServed && err.message.includes('{"a.ok":[1,2]}'));
    await assert.rejects(strict.publishMany('elsewhere', [{ task_type: 'a.ok' }]), NotServed);
    assert.equal(await redis.exists(ks.queue('elsewhere').stream('normal')), 0, 'nothing written');
    const seenBefore = announced.seen_at;
    await waitFor(async () => JSON.parse(await redis.get(ks.worker(worker.consumer))).seen_at !== seenBefore, { timeoutMs: 2000 });
    await worker.stop({ graceMs: 0 });
    const stopped = JSON.parse(await redis.get(ks.worker(worker.consumer)));
    assert.ok(stopped.stopped_at, 'a clean shutdown writes stopped_at');
    await strict.publish(QUEUE, { task_type: 'a.ok' }); // recently seen still counts
  });

  test('schemas: refused at publish, dead-lettered at the worker, broken schema ignored, read failure runs unchecked', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const ran = [];
    const early = new Producer(redis, { prefix });
    const unchecked = await early.publish(QUEUE, { task_type: 'a.order', payload: { order_id: 0, colour: 'red' } });
    await redis.hset(ks.schemas, 'a.order@1', ORDER_SCHEMA, 'a.broken@1', '{"type": 12}');
    const sink = logSink();
    const producer = new Producer(redis, { prefix, logger: sink.logger });
    await assert.rejects(producer.publish(QUEUE, { task_type: 'a.order', payload: { colour: 'red' } }), (err) => {
      assert.ok(err instanceof InvalidEnvelope);
      assert.deepEqual(err.violations.map((v) => [v.field, v.rule]), [['payload.colour', 'schema'], ['payload.order_id', 'schema']]);
      return true;
    });
    await assert.rejects(producer.publishMany(QUEUE, [{ task_type: 'a.order', payload: { order_id: 3 } },
      { task_type: 'a.order', payload: { order_id: 'x' } }]), InvalidEnvelope);
    assert.equal(await redis.xlen(ks.queue(QUEUE).stream('normal')), 1, 'only the early, unchecked task');
    await producer.publish(QUEUE, { task_type: 'a.broken', payload: { any: 1 } });
    assert.ok(sink.lines.some((l) => l.msg.includes('payload schema is ignored') && l.schema === 'a.broken@1'));
    const { lines } = await setup(prefix, { 'a.order': (p) => ran.push(p), 'a.broken': (p) => ran.push(p) });
    await until(producer, unchecked.taskId, 'dead');
    const [entry] = await redis.xrange(ks.queue(QUEUE).dead, '-', '+');
    const fields = Object.fromEntries(entry[1].flatMap((v, i, a) => (i % 2 ? [] : [[v, a[i + 1]]])));
    assert.equal(fields.failure_class, 'invalid_payload');
    assert.match(fields.reason, /^schema: payload\.colour: .+; payload\.order_id: .+$/);
    await waitFor(() => ran.length === 1, { timeoutMs: 3000 });
    assert.deepEqual(ran, [{ any: 1 }], 'the invalid payload never ran');
    assert.ok(!lines.some((l) => l.msg.includes('retrying')));
    // The schemas cannot be read (a key of the wrong type): the worker runs the task unchecked.
    const other = prefixFor();
    const bad = await new Producer(redis, { prefix: other }).publish(QUEUE, { task_type: 'a.order', payload: { order_id: 0 } });
    await redis.set(new KeySpace(other).schemas, 'not a hash');
    const second = await setup(other, { 'a.order': () => {} });
    await until(second.producer, bad.taskId, 'succeeded');
    assert.ok(second.lines.some((l) => l.msg.includes('running the task unchecked')));
  });
});
