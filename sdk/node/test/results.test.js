// Results for Celery callers (docs/protocol.md section 12) and expired tasks (section 5.1,
// step 3): the worker writes SUCCESS, FAILURE and REVOKED to the Redis of the result backend
// (a second private redis-server here) with SET and PUBLISH, before the entry is settled.

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import Redis from 'ioredis';
import { registerBuiltinHandlers } from '../support/handlers.js';
import {
  InvalidResultRequest, KeySpace, Producer, RETRY_POLICY_HEADER, ResultEncodeError, TIERED, Timestamp, Worker,
  checkResult, encodeEntry, encodeResult, formatDateDone, newEnvelope, parseRedisUrl, resultMeta,
  resultRequestOf,
} from '../src/index.js';
import { retryWhileAway } from '../src/outage.js';
import { logSink, redisSuite, startRedisServer, waitFor } from '../support/helpers.js';

const { server, skip, prefixFor, connect } = await redisSuite('rs');
const QUEUE = 'jobs';
const DATE_DONE = /^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00$/;

const asking = (key, expiresS) => ({ celery: { result: expiresS === undefined ? { key } : { key, expires_s: expiresS } } });

describe('result meta (pure)', () => {
  test('compact JSON in the field order of Celery, date_done with microseconds and +00:00', () => {
    const nowMs = Date.UTC(2025, 8, 11, 4, 45, 0, 123);
    assert.equal(formatDateDone(nowMs), '2025-09-11T04:45:00.123000+00:00');
    assert.equal(resultMeta({ status: 'SUCCESS', result: { n: 1 }, taskId: 't-1', nowMs }),
      '{"status":"SUCCESS","result":{"n":1},"traceback":null,"children":[],"date_done":"2025-09-11T04:45:00.123000+00:00","task_id":"t-1"}');
  });

  test('the request is ext.celery.result {key, expires_s}; anything else names the field', () => {
    assert.equal(resultRequestOf({ ext: {} }), null);
    assert.deepEqual(resultRequestOf({ ext: asking('k', 60) }), { key: 'k', expiresS: 60 });
    assert.deepEqual(resultRequestOf({ ext: asking('k') }), { key: 'k', expiresS: null });
    assert.deepEqual(resultRequestOf({ ext: asking('k', null) }), { key: 'k', expiresS: null });
    assert.throws(() => resultRequestOf({ ext: { celery: { result: { expires_s: 5 } } } }),
      (err) => err instanceof InvalidResultRequest && err.field === 'ext.celery.result.key' && err.rule === 'type');
    assert.throws(() => resultRequestOf({ ext: { celery: { result: 'k' } } }), (err) => err.field === 'ext.celery.result');
  });

  test('expires_s: 0, null or absent is no expiry, a fraction is rounded up, a negative or non-number value is refused', () => {
    const expiresOf = (value) => resultRequestOf({ ext: asking('k', value) }).expiresS;
    assert.equal(expiresOf(0), null);
    assert.equal(expiresOf(null), null);
    assert.equal(expiresOf(undefined), null);
    assert.equal(expiresOf(1.5), 2);
    assert.equal(expiresOf(0.001), 1);
    assert.equal(expiresOf(86400), 86400);
    for (const [value, rule] of [[-1, 'range'], [-0.5, 'range'], [2n ** 60n, 'range'], ['60', 'type'], [true, 'type'], [{}, 'type']]) {
      assert.throws(() => resultRequestOf({ ext: asking('k', value) }),
        (err) => err instanceof InvalidResultRequest && err.field === 'ext.celery.result.expires_s' && err.rule === rule, String(value));
    }
  });

  test('a handler value is written as JSON.stringify writes it; what JSON cannot hold is an EncodeError', () => {
    assert.equal(encodeResult(undefined), 'null');
    assert.equal(encodeResult(new Date(0)), '"1970-01-01T00:00:00.000Z"', 'a Date is JSON via toJSON');
    assert.equal(encodeResult({ a: undefined, b: [undefined, 1], c: 'é' }), '{"b":[null,1],"c":"é"}');
    const circular = { name: 'loop' };
    circular.self = circular;
    const refused = [circular, 10n, () => 1, { f() {} }, [Symbol('s')], Number.NaN, { n: Infinity }];
    for (const value of refused) {
      assert.throws(() => encodeResult(value), (err) => err instanceof ResultEncodeError && err.name === 'EncodeError' &&
        /cannot be written as JSON/.test(err.message), String(typeof value));
    }
    const asks = { ext: asking('k') };
    assert.throws(() => checkResult(asks, 10n), ResultEncodeError);
    assert.throws(() => checkResult({ ext: asking('') }, 10n), ResultEncodeError, 'a request it cannot read still asks');
    checkResult({ ext: {} }, 10n); // no result asked for: nothing to write
    checkResult(asks, { at: new Date(0) });
    assert.throws(() => resultMeta({ status: 'SUCCESS', result: circular, taskId: 't' }), ResultEncodeError);
  });

  test('retryWhileAway repeats only while Redis is away, within its tolerance', async () => {
    let tries = 0;
    const away = Object.assign(new Error('connect ECONNREFUSED 127.0.0.1:1'), { code: 'ECONNREFUSED' });
    assert.equal(await retryWhileAway(async () => { tries += 1; if (tries < 3) throw away; return 'ok'; }, { toleranceMs: 5000 }), 'ok');
    assert.equal(tries, 3);
    tries = 0;
    await assert.rejects(retryWhileAway(async () => { tries += 1; throw new Error('ERR wrong number of arguments'); }), /wrong number/);
    assert.equal(tries, 1);
    const started = Date.now();
    await assert.rejects(retryWhileAway(async () => { throw away; }, { toleranceMs: 300 }), /ECONNREFUSED/);
    assert.ok(Date.now() - started < 2000);
  });

  test('expiresInMs sets expires from the publish time, in UTC; it cannot be given twice', () => {
    const producer = new Producer({ connection: { lazyConnect: true } });
    const nowMs = Date.UTC(2025, 8, 11, 4, 45, 0);
    assert.equal(producer.prepare({ task_type: 'a.b' }, { nowMs, expiresInMs: 90_000 }).expires, '2025-09-11T04:46:30Z');
    assert.equal(producer.prepare({ task_type: 'a.b', expires: '2025-09-11T12:50:00+08:00' }, { nowMs }).expires, '2025-09-11T12:50:00+08:00');
    assert.equal(producer.prepare({ task_type: 'a.b' }, { nowMs }).expires, null);
    assert.throws(() => producer.prepare({ task_type: 'a.b' }, { expiresInMs: -1 }), /expiresInMs must be an integer/);
    assert.throws(() => producer.prepare({ task_type: 'a.b', expires: Timestamp.now() }, { expiresInMs: 5 }), /not both/);
    assert.throws(() => producer.prepare({ task_type: 'a.b', expires: 1757565900 }), (err) => err.violations[0].field === 'expires' && err.violations[0].rule === 'type');
    producer.client.disconnect();
  });
});

describe('results and expiry (worker)', { skip, concurrency: false }, () => {
  const { redis, workers } = connect();
  let backendServer;
  let backend;

  before(async () => {
    backendServer = await startRedisServer();
    backend = new Redis(parseRedisUrl(backendServer.url));
  });

  after(async () => {
    backend?.disconnect();
    await backendServer?.close();
  });

  async function startWorker(prefix, options = {}) {
    const sink = logSink();
    const worker = new Worker({
      redis: server.url, prefix, queue: QUEUE, leaseMs: 900, blockMs: 100, promoterMaxIdleMs: 200,
      resultBackend: backendServer.url, logger: sink.logger, ...options,
    });
    registerBuiltinHandlers(worker);
    worker.register('test.value', async (payload) => ({ echo: payload.echo, at: new Date(Date.UTC(2025, 8, 11)) }));
    worker.register('test.unwritable', async () => {
      const value = { n: 1 };
      value.self = value;
      return value;
    });
    workers.push(worker);
    await worker.start();
    return { worker, lines: sink.lines };
  }

  const deadOf = async (prefix) => {
    const entries = await redis.xrange(new KeySpace(prefix).queue(QUEUE).dead, '-', '+');
    return entries.map(([, flat]) => Object.fromEntries(flat.flatMap((v, i) => (i % 2 ? [] : [[v, flat[i + 1]]]))));
  };
  const stored = (key) => waitFor(() => backend.get(key), { message: `result ${key}` });
  const metaOf = (text) => {
    const meta = JSON.parse(text);
    assert.match(meta.date_done, DATE_DONE);
    return { ...meta, date_done: 'checked' };
  };

  test('SUCCESS: the handler value, SET with EX and PUBLISH of the same compact JSON', async () => {
    const prefix = prefixFor();
    await startWorker(prefix);
    const key = `celery-task-meta-${prefix}`;
    const subscriber = new Redis(parseRedisUrl(backendServer.url));
    const messages = [];
    subscriber.on('message', (channel, message) => messages.push([channel, message]));
    await subscriber.subscribe(key);
    try {
      const { taskId } = await new Producer(redis, { prefix }).publish(QUEUE, { task_type: 'test.value', payload: { echo: 'é' }, ext: asking(key, 600) });
      const text = await stored(key);
      assert.equal(text, `{"status":"SUCCESS","result":{"echo":"é","at":"2025-09-11T00:00:00.000Z"},"traceback":null,"children":[],"date_done":"${JSON.parse(text).date_done}","task_id":"${taskId}"}`);
      assert.match(JSON.parse(text).date_done, DATE_DONE);
      const ttl = await backend.ttl(key);
      assert.ok(ttl > 590 && ttl <= 600, String(ttl));
      await waitFor(() => messages.length === 1);
      assert.deepEqual(messages, [[key, text]]);
      assert.equal(await redis.exists(key), 0, 'written to the result backend, not the broker');
    } finally {
      subscriber.disconnect();
    }
  });

  test('expires_s 0 writes a plain SET, a fraction is rounded up, a negative one writes nothing and the task runs', async () => {
    const prefix = prefixFor();
    const { worker, lines } = await startWorker(prefix);
    const producer = new Producer(redis, { prefix });
    await producer.publish(QUEUE, { task_type: 'test.value', payload: { echo: 0 }, ext: asking(`${prefix}-zero`, 0) });
    await producer.publish(QUEUE, { task_type: 'test.value', payload: { echo: 1 }, ext: asking(`${prefix}-fraction`, 59.2) });
    const negative = await producer.publish(QUEUE, { task_type: 'test.value', payload: { echo: 2 }, ext: asking(`${prefix}-negative`, -5) });
    await waitFor(() => worker.stats.succeeded === 3);
    assert.equal(JSON.parse(await stored(`${prefix}-zero`)).status, 'SUCCESS');
    assert.equal(await backend.ttl(`${prefix}-zero`), -1, 'expires_s 0: no expiry');
    const ttl = await backend.ttl(`${prefix}-fraction`);
    assert.ok(ttl > 55 && ttl <= 60, `59.2 s is rounded up to 60: ${ttl}`);
    assert.equal(await backend.exists(`${prefix}-negative`), 0);
    const line = lines.find((l) => l.msg.startsWith('the Envelope asks for a result in a form') && l.task_id === negative.taskId);
    assert.deepEqual([line.field, line.rule], ['ext.celery.result.expires_s', 'range']);
    assert.deepEqual(await deadOf(prefix), []);
  });

  test('FAILURE: the dead-letter exception type, message and stack; the failure class when no handler error caused it', async () => {
    const prefix = prefixFor();
    await startWorker(prefix);
    const producer = new Producer(redis, { prefix });
    const failing = await producer.publish(QUEUE, { task_type: 'test.fail', ext: asking(`${prefix}-fail`) });
    const unknown = await producer.publish(QUEUE, { task_type: 'nobody.handles_this', ext: asking(`${prefix}-unknown`, 60) });
    const versioned = await producer.publish(QUEUE, { task_type: 'test.fail', payload_version: 7, ext: asking(`${prefix}-version`, 60) });
    const failure = JSON.parse(await stored(`${prefix}-fail`));
    const dead = await waitFor(async () => ((await deadOf(prefix)).length === 3 ? deadOf(prefix) : null));
    const byTask = Object.fromEntries(dead.map((d) => [d.task_id, d]));
    assert.deepEqual({ ...failure, traceback: 'checked', date_done: 'checked' }, {
      status: 'FAILURE', result: { exc_type: 'TestFailure', exc_message: ['test.fail always fails'], exc_module: null },
      traceback: 'checked', children: [], date_done: 'checked', task_id: failing.taskId,
    });
    assert.equal(failure.result.exc_type, byTask[failing.taskId].exception_type);
    assert.equal(failure.traceback, byTask[failing.taskId].traceback);
    assert.match(failure.traceback, /TestFailure: test\.fail always fails/);
    assert.equal(await backend.ttl(`${prefix}-fail`), -1, 'no expires_s: a plain SET');
    for (const [key, task, failureClass] of [[`${prefix}-unknown`, unknown, 'unknown_task_type'], [`${prefix}-version`, versioned, 'unsupported_payload_version']]) {
      assert.deepEqual(metaOf(await stored(key)), {
        status: 'FAILURE', result: { exc_type: failureClass, exc_message: [byTask[task.taskId].reason], exc_module: null },
        traceback: null, children: [], date_done: 'checked', task_id: task.taskId,
      });
      assert.equal(byTask[task.taskId].failure_class, failureClass);
    }
  });

  test('a value that cannot be written as JSON fails the attempt: retried, then dead-lettered and FAILURE as EncodeError', async () => {
    const prefix = prefixFor();
    const { worker } = await startWorker(prefix, { backoffMs: 20, maxBackoffMs: 50 });
    const failures = [];
    worker.on('failed', (_env, err, info) => failures.push([err.name, info.retrying]));
    const { taskId } = await new Producer(redis, { prefix }).publish(QUEUE, {
      task_type: 'test.unwritable', max_retries: 1, headers: { [RETRY_POLICY_HEADER]: TIERED },
      idempotency_key: `${prefix}-u`, ext: asking(`${prefix}-u`, 60),
    });
    const meta = JSON.parse(await stored(`${prefix}-u`));
    // The result is written before the dead letter: wait for both.
    const [dead] = await waitFor(async () => ((await deadOf(prefix)).length === 1 ? deadOf(prefix) : null));
    assert.deepEqual([dead.failure_class, dead.exception_type, dead.attempts], ['task_error', 'EncodeError', '2']);
    assert.deepEqual(failures, [['EncodeError', true], ['EncodeError', false]]);
    assert.deepEqual(meta.result, { exc_type: 'EncodeError', exc_message: [dead.reason], exc_module: null });
    assert.match(dead.reason, /cannot be written as JSON: .*circular/i);
    assert.equal(meta.status, 'FAILURE');
    assert.equal(meta.task_id, taskId);
    assert.equal(await redis.exists(new KeySpace(prefix).idempotency('test.unwritable', `${prefix}-u`)), 0, 'the claim is given back');
  });

  test('FAILURE of a task whose consumers keep dying: redelivery_limit', async () => {
    const prefix = prefixFor();
    const qk = new KeySpace(prefix).queue(QUEUE);
    for (const stream of qk.taskStreams) await redis.xgroup('CREATE', stream, 'workers', '0', 'MKSTREAM');
    const env = newEnvelope({ task_type: 'order.close_timeout', payload: { order_id: 'R1' }, ext: asking(`${prefix}-r`, 60) });
    const f = encodeEntry(env);
    await redis.xadd(qk.stream('normal'), '*', 'v', f.v, 'enc', f.enc, 'body', f.body, 'n', '2');
    await redis.xreadgroup('GROUP', 'workers', 'ghost-r', 'COUNT', 1, 'STREAMS', qk.stream('normal'), '>');
    await startWorker(prefix, { maxRedeliveries: 3 });
    const meta = metaOf(await stored(`${prefix}-r`));
    const [dead] = await deadOf(prefix);
    assert.equal(dead.failure_class, 'redelivery_limit');
    assert.deepEqual(meta, {
      status: 'FAILURE', result: { exc_type: 'redelivery_limit', exc_message: [dead.reason], exc_module: null },
      traceback: null, children: [], date_done: 'checked', task_id: env.task_id,
    });
  });

  test('REVOKED: cancelled (revoked) and expired (expired) tasks are acknowledged without running, not dead-lettered', async () => {
    const prefix = prefixFor();
    const producer = new Producer(redis, { prefix });
    const cancelled = newEnvelope({ task_type: 'order.close_timeout', payload: { order_id: 'X1' }, ext: asking(`${prefix}-c`, 60) });
    await producer.cancel(cancelled.task_id);
    await producer.publish(QUEUE, cancelled);
    const expired = await producer.publish(QUEUE, {
      task_type: 'order.close_timeout', payload: { order_id: 'X2' }, expires: Timestamp.fromEpochMs(Date.now() - 1000, 480), ext: asking(`${prefix}-e`, 60),
    });
    const now = await producer.publish(QUEUE, { task_type: 'order.close_timeout', payload: { order_id: 'X3' }, ext: asking(`${prefix}-n`, 60) }, { expiresInMs: 0 });
    const fresh = await producer.publish(QUEUE, { task_type: 'order.close_timeout', payload: { order_id: 'X4' } }, { expiresInMs: 60_000 });
    const { worker, lines } = await startWorker(prefix);
    const revoked = (taskId, why) => ({
      status: 'REVOKED', result: { exc_type: 'TaskRevokedError', exc_message: [why], exc_module: 'celery.exceptions' },
      traceback: null, children: [], date_done: 'checked', task_id: taskId,
    });
    assert.deepEqual(metaOf(await stored(`${prefix}-c`)), revoked(cancelled.task_id, 'revoked'));
    assert.deepEqual(metaOf(await stored(`${prefix}-e`)), revoked(expired.taskId, 'expired'));
    assert.deepEqual(metaOf(await stored(`${prefix}-n`)), revoked(now.taskId, 'expired'));
    await waitFor(() => worker.stats.succeeded === 1);
    assert.equal(await redis.get(`${prefix}:effects:order.close_timeout:X4`), '1');
    for (const order of ['X1', 'X2', 'X3']) assert.equal(await redis.get(`${prefix}:effects:order.close_timeout:${order}`), null, order);
    assert.deepEqual(await deadOf(prefix), []);
    assert.equal(worker.stats.expired, 2);
    assert.equal(worker.stats.cancelled, 1);
    assert.equal(worker.stats.retried, 0);
    const line = lines.find((l) => l.msg.startsWith('task expired') && l.task_id === expired.taskId);
    assert.equal(line.expires, expired.envelope.expires);
    assert.match(expired.envelope.expires, /\+08:00$/, 'kept as written');
    assert.equal(lines.filter((l) => l.msg.startsWith('task was cancelled')).length, 1);
  });

  test('a duplicate (idempotency key done) writes SUCCESS with result null', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    await redis.set(ks.idempotency('order.close_timeout', 'done-key'), 'done earlier 2025-09-11T04:40:00Z', 'PX', 60_000);
    const { taskId } = await new Producer(redis, { prefix }).publish(QUEUE, {
      task_type: 'order.close_timeout', payload: { order_id: 'D1' }, idempotency_key: 'done-key', ext: asking(`${prefix}-d`, 60),
    });
    await startWorker(prefix);
    assert.deepEqual(metaOf(await stored(`${prefix}-d`)), {
      status: 'SUCCESS', result: null, traceback: null, children: [], date_done: 'checked', task_id: taskId,
    });
    assert.equal(await redis.get(`${prefix}:effects:order.close_timeout:D1`), null);
  });

  test('without a result backend the worker logs once per task type that a result was not written', async () => {
    const prefix = prefixFor();
    const { worker, lines } = await startWorker(prefix, { resultBackend: null });
    const producer = new Producer(redis, { prefix });
    for (const order of ['W1', 'W2']) await producer.publish(QUEUE, { task_type: 'order.close_timeout', payload: { order_id: order }, ext: asking(`${prefix}-${order}`) });
    await producer.publish(QUEUE, { task_type: 'test.value', payload: { echo: 1 }, ext: asking(`${prefix}-v`) });
    await waitFor(() => worker.stats.succeeded === 3);
    const warned = lines.filter((l) => l.msg.startsWith('a result was asked for and not written'));
    assert.deepEqual(warned.map((l) => l.task_type).sort(), ['order.close_timeout', 'test.value']);
    assert.equal(await backend.exists(`${prefix}-W1`, `${prefix}-W2`, `${prefix}-v`), 0);
    assert.equal(lines.find((l) => l.msg === 'worker ready').result_backend, false);
  });

  test('a result request the worker cannot read is logged with its field; the task still succeeds', async () => {
    const prefix = prefixFor();
    const { worker, lines } = await startWorker(prefix);
    await new Producer(redis, { prefix }).publish(QUEUE, {
      task_type: 'order.close_timeout', payload: { order_id: 'B1' }, ext: { celery: { result: { key: '', expires_s: 60 } } },
    });
    await waitFor(() => worker.stats.succeeded === 1);
    const line = lines.find((l) => l.msg.startsWith('the Envelope asks for a result in a form'));
    assert.equal(line.field, 'ext.celery.result.key');
    assert.deepEqual(await deadOf(prefix), []);
  });

  test('a result write is retried while the result backend is away, and the task is acknowledged after it', async () => {
    const prefix = prefixFor();
    // A client that fails at once while disconnected, so the worker's own retry is what waits.
    const client = new Redis({ ...parseRedisUrl(backendServer.url), enableOfflineQueue: false, retryStrategy: () => 100 });
    client.on('error', () => {});
    await waitFor(() => client.status === 'ready');
    const { worker, lines } = await startWorker(prefix, { resultBackend: client, outageToleranceMs: 20_000 });
    const { port } = backendServer;
    await backendServer.close();
    await waitFor(() => client.status !== 'ready');
    const { taskId } = await new Producer(redis, { prefix }).publish(QUEUE, { task_type: 'test.value', payload: { echo: 'o' }, ext: asking(`${prefix}-o`, 60) });
    await waitFor(() => lines.some((l) => l.msg.startsWith('the result backend is away') && l.task_id === taskId));
    const qk = new KeySpace(prefix).queue(QUEUE);
    assert.equal(Number((await redis.xpending(qk.stream('normal'), 'workers'))[0]), 1, 'not acknowledged before the result is written');
    backendServer = await startRedisServer(port);
    backend.disconnect();
    backend = new Redis(parseRedisUrl(backendServer.url));
    assert.equal(JSON.parse(await stored(`${prefix}-o`)).status, 'SUCCESS');
    await waitFor(() => worker.stats.succeeded === 1);
    assert.equal(Number((await redis.xpending(qk.stream('normal'), 'workers'))[0]), 0);
    assert.deepEqual(await deadOf(prefix), []);
    client.disconnect();
  });
});
