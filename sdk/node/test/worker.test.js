// The worker shell against a real Redis ($ENVELOPE_TEST_REDIS_URL, or a private
// redis-server when one is on PATH; skipped otherwise).

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { setTimeout as sleep } from 'node:timers/promises';
import { describe, test } from 'node:test';
import { registerBuiltinHandlers } from '../support/handlers.js';
import { decodeEntry, encodeEntry } from '../src/codec.js';
import { newEnvelope } from '../src/envelope.js';
import { KeySpace } from '../src/keys.js';
import { Producer } from '../src/producer.js';
import { RETRY_POLICY_HEADER, RejectedError, TIERED, TransientError } from '../src/retry.js';

// Envelope headers asking for automatic retries (docs/protocol.md section 8).
const TIERED_HEADERS = { [RETRY_POLICY_HEADER]: TIERED };
import { Timestamp } from '../src/time.js';
import { Worker } from '../src/worker.js';
import { logSink, redisSuite, waitFor } from '../support/helpers.js';

const { server, skip, prefixFor, connect } = await redisSuite('n');
const QUEUE = 'jobs';

describe('worker', { skip, concurrency: false }, () => {
  const { redis, workers } = connect();

  async function startWorker(prefix, options = {}, register = () => {}) {
    const sink = logSink();
    const worker = new Worker({
      redis: server.url, prefix, queue: QUEUE, leaseMs: 900, blockMs: 100, backoffMs: 50, maxBackoffMs: 200,
      deferMs: 150, promoterMaxIdleMs: 200, logger: sink.logger, ...options,
    });
    registerBuiltinHandlers(worker);
    register(worker);
    workers.push(worker);
    await worker.start();
    return { worker, lines: sink.lines };
  }

  const dead = async (prefix) => {
    const entries = await redis.xrange(new KeySpace(prefix).queue(QUEUE).dead, '-', '+');
    return entries.map(([id, flat]) => ({ id, ...Object.fromEntries(flat.reduce((acc, v, i) => (i % 2 ? acc : [...acc, [v, flat[i + 1]]]), [])) }));
  };
  const pendingOf = async (prefix) => {
    let total = 0;
    for (const stream of new KeySpace(prefix).queue(QUEUE).taskStreams) {
      const [count] = await redis.xpending(stream, 'workers');
      total += Number(count);
    }
    return total;
  };
  const effects = (prefix, order) => redis.get(`${prefix}:effects:order.close_timeout:${order}`);

  test('every log line carries trace_id and task_id', async () => {
    const prefix = prefixFor();
    const { worker, lines } = await startWorker(prefix);
    const producer = new Producer(redis, { prefix });
    await producer.publish(QUEUE, { task_type: 'order.close_timeout', payload: { order_id: 'L1' }, trace_id: 'trace-L1' });
    await waitFor(() => lines.some((l) => l.msg === 'task succeeded'));
    await worker.stop();
    assert.ok(lines.length >= 4);
    for (const line of lines) {
      assert.ok('trace_id' in line && 'task_id' in line, JSON.stringify(line));
    }
    assert.equal(lines.find((l) => l.msg === 'task succeeded').trace_id, 'trace-L1');
    assert.equal(await redis.exists(new KeySpace(prefix).consumer(worker.consumer)), 0);
  });

  test('at start one log line says what the worker serves: its queues, each task type and its payload versions', async () => {
    const prefix = prefixFor();
    const { lines } = await startWorker(prefix, {}, (worker) => {
      worker.register('order.refund', async () => {}, { payloadVersions: [1, 2] });
    });
    const ready = lines.filter((l) => l.msg === 'worker ready');
    assert.equal(ready.length, 1);
    assert.deepEqual(ready[0].queues, [QUEUE]);
    assert.deepEqual(ready[0].handlers, {
      'order.close_timeout': [1], 'test.fail': [1], 'test.transient': [1], 'test.sleep': [1], 'order.refund': [1, 2],
    });
    assert.equal(ready[0].result_backend, false);
  });

  test('a task XADDed before it is due goes to the delayed set, then runs once due', async () => {
    const prefix = prefixFor();
    const qk = new KeySpace(prefix).queue(QUEUE);
    const env = newEnvelope({ task_type: 'order.close_timeout', payload: { order_id: 'D1' }, schedule_time: Timestamp.fromEpochMs(Date.now() + 700, 480) });
    const fields = encodeEntry(env);
    await startWorker(prefix);
    await redis.xadd(qk.stream('normal'), '*', 'v', fields.v, 'enc', fields.enc, 'body', fields.body);
    await waitFor(async () => (await redis.zscore(qk.delayed, env.task_id)) !== null);
    assert.equal(await effects(prefix, 'D1'), null);
    assert.deepEqual(await redis.smembers(new KeySpace(prefix).queues), [QUEUE]);
    await waitFor(async () => (await effects(prefix, 'D1')) === '1', { timeoutMs: 5000 });
    assert.equal(await pendingOf(prefix), 0);
  });

  test('unknown task types and unaccepted payload versions are dead-lettered', async () => {
    const prefix = prefixFor();
    await startWorker(prefix);
    const producer = new Producer(redis, { prefix });
    const a = await producer.publish(QUEUE, { task_type: 'nobody.handles_this' });
    const b = await producer.publish(QUEUE, { task_type: 'order.close_timeout', payload_version: 2, payload: { order_id: 'V2' } });
    const entries = await waitFor(async () => ((await dead(prefix)).length === 2 ? dead(prefix) : null));
    const byTask = Object.fromEntries(entries.map((e) => [e.task_id, e]));
    assert.equal(byTask[a.taskId].failure_class, 'unknown_task_type');
    assert.equal(byTask[b.taskId].failure_class, 'unsupported_payload_version');
    assert.equal(byTask[b.taskId].language, 'node');
    assert.deepEqual(await redis.smembers(`${prefix}:dead-queues`), [QUEUE]);
    assert.equal(await effects(prefix, 'V2'), null);
  });

  test('transient errors: fast retries, then backoff, then transient_exhausted', async () => {
    const prefix = prefixFor();
    const { lines } = await startWorker(prefix, { fastRetries: 2 });
    const producer = new Producer(redis, { prefix });
    const { taskId } = await producer.publish(QUEUE, { task_type: 'test.transient', max_retries: 3, headers: TIERED_HEADERS });
    const [entry] = await waitFor(() => dead(prefix).then((d) => (d.length ? d : null)), { timeoutMs: 8000 });
    assert.equal(entry.failure_class, 'transient_exhausted');
    assert.equal(entry.attempts, '4');
    assert.equal(entry.exception_type, 'TransientError');
    const last = decodeEntry({ v: entry['raw.v'], enc: entry['raw.enc'], body: entry['raw.body'] });
    assert.equal(last.task_id, taskId);
    assert.equal(last.retry_count, 3);
    assert.equal(last.headers['x-fast-retries'], '2');
    assert.ok(Timestamp.parse(entry.first_failure_at).compare(entry.last_failure_at) <= 0);
    const tiers = lines.filter((l) => l.msg === 'attempt failed; retrying').map((l) => l.tier);
    assert.deepEqual(tiers, ['fast', 'fast', 'backoff']);
  });

  test('an attempt past timeout_ms is stopped and dead-lettered as timeout', async () => {
    const prefix = prefixFor();
    await startWorker(prefix);
    const producer = new Producer(redis, { prefix });
    const started = Date.now();
    await producer.publish(QUEUE, { task_type: 'test.sleep', payload: { ms: 5000 }, timeout_ms: 200, max_retries: 0 });
    const [entry] = await waitFor(() => dead(prefix).then((d) => (d.length ? d : null)), { timeoutMs: 4000 });
    assert.ok(Date.now() - started < 3000);
    assert.equal(entry.failure_class, 'timeout');
    assert.equal(entry.exception_type, 'TaskTimeoutError');
  });

  test('an abandoned attempt keeps its idempotency claim until its handler settles: one effect, key done, nothing dead', async () => {
    const prefix = prefixFor();
    let effects = 0;
    const { worker } = await startWorker(prefix, {}, (w) => {
      w.register('jobs.overrun', async () => {
        await sleep(1500); // ignores its signal: abandoned at 100 ms
        effects += 1;
      });
    });
    // The timeout is retried once, on the backoff tier (backoffMs 50).
    const { taskId } = await new Producer(redis, { prefix }).publish(QUEUE, {
      task_type: 'jobs.overrun', timeout_ms: 100, max_retries: 1, headers: TIERED_HEADERS, idempotency_key: 'overrun-1',
    });
    const ks = new KeySpace(prefix);
    const idemKey = ks.idempotency('jobs.overrun', 'overrun-1');
    await waitFor(async () => (await redis.get(idemKey))?.startsWith(`done ${taskId} `), {
      timeoutMs: 6000, message: 'the abandoned attempt marks the key done',
    });
    await waitFor(async () => (await pendingOf(prefix)) === 0 && (await redis.zcard(ks.queue(QUEUE).delayed)) === 0,
      { message: 'the queue drains' });
    await sleep(300);
    assert.equal(effects, 1, 'the retry ran while the abandoned attempt still held the key');
    assert.deepEqual(await dead(prefix), []);
    assert.ok(worker.stats.deferred >= 1, 'this consumer deferred its own retry');
    assert.equal(worker.stats.duplicates, 1, 'the retry found the key done');
  });

  test('a handler can refuse a payload: invalid_payload, no retry', async () => {
    const prefix = prefixFor();
    await startWorker(prefix);
    await new Producer(redis, { prefix }).publish(QUEUE, { task_type: 'order.close_timeout', payload: {} });
    const [entry] = await waitFor(() => dead(prefix).then((d) => (d.length ? d : null)));
    assert.equal(entry.failure_class, 'invalid_payload');
    assert.equal(entry.attempts, '1');
  });

  test('idempotency: a live holder defers the entry; a dead holder is taken over', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const idemKey = ks.idempotency('order.close_timeout', 'K-1');
    // A live consumer holds the claim: the entry is deferred, not run.
    await redis.set(ks.consumer('other-consumer'), 'h 1 python', 'PX', 60_000);
    await redis.set(idemKey, 'running other-consumer some-task', 'PX', 60_000);
    const { lines } = await startWorker(prefix);
    const { taskId } = await new Producer(redis, { prefix }).publish(QUEUE, {
      task_type: 'order.close_timeout', payload: { order_id: 'I1' }, idempotency_key: 'K-1',
    });
    await waitFor(() => lines.some((l) => l.msg.includes('deferred')));
    assert.equal(await effects(prefix, 'I1'), null);
    const deferredBody = await redis.hget(ks.queue(QUEUE).delayedData, taskId);
    assert.ok(deferredBody === null || deferredBody.includes('"retry_count":0'), 'a deferral keeps retry_count');
    // The holder dies: its liveness key disappears, the claim is taken over and the task runs once.
    await redis.del(ks.consumer('other-consumer'));
    await waitFor(async () => (await effects(prefix, 'I1')) === '1', { timeoutMs: 5000 });
    // The effect lands inside the handler; the done marker is written when the attempt settles.
    await waitFor(async () => /^done /.test(await redis.get(idemKey) ?? ''), { timeoutMs: 5000 });
    assert.match(await redis.get(idemKey), new RegExp(`^done ${taskId} `));
    assert.ok(lines.some((l) => l.msg.includes('taking it over')));
  });

  test('idempotency: a done marker acknowledges duplicates without running them', async () => {
    const prefix = prefixFor();
    const { lines } = await startWorker(prefix);
    const producer = new Producer(redis, { prefix });
    for (let i = 0; i < 3; i += 1) {
      await producer.publish(QUEUE, { task_type: 'order.close_timeout', payload: { order_id: 'I2' }, idempotency_key: 'same' });
    }
    await waitFor(() => lines.filter((l) => l.msg.startsWith('duplicate')).length === 2);
    assert.equal(await effects(prefix, 'I2'), '1');
    assert.equal(await pendingOf(prefix), 0);
  });

  test('idempotency: a claim whose reply is lost is released before its entry is left pending; it then runs once', async () => {
    const prefix = prefixFor();
    const idemKey = new KeySpace(prefix).idempotency('order.close_timeout', 'lost-1');
    const { worker, lines } = await startWorker(prefix, { outageToleranceMs: 300 });
    // idem_begin.lua runs on Redis, but the worker's client sees its connection close instead of the reply.
    const begin = worker.cmd.envelope_idem_begin;
    const landed = [];
    let losing = true;
    worker.cmd.envelope_idem_begin = async function (...args) {
      const reply = await begin.apply(this, args);
      if (!losing) return reply;
      landed.push(reply[0]);
      throw new Error('Connection is closed.');
    };
    const { taskId } = await new Producer(redis, { prefix }).publish(QUEUE, {
      task_type: 'order.close_timeout', payload: { order_id: 'LOST1' }, idempotency_key: 'lost-1',
    });
    await waitFor(() => lines.some((l) => l.msg.startsWith('could not settle the entry') && l.task_id === taskId),
      { timeoutMs: 5000, message: 'the failed claim was not handed back' });
    assert.ok(landed.length >= 1 && landed.every((state) => state === 'acquired'), 'the claim landed, its replies lost');
    assert.equal(await redis.exists(idemKey), 0, 'the claim was released before the hand-back');
    assert.equal(await effects(prefix, 'LOST1'), null, 'not run');
    assert.equal(await pendingOf(prefix), 1, 'left pending');
    losing = false;
    await waitFor(async () => (await effects(prefix, 'LOST1')) === '1', { timeoutMs: 5000, message: 'it runs once Redis answers' });
    await waitFor(async () => (await pendingOf(prefix)) === 0);
    assert.match(await redis.get(idemKey), new RegExp(`^done ${taskId} `));
    assert.equal(worker.stats.succeeded, 1);
    assert.deepEqual(await dead(prefix), []);
    assert.ok(!lines.some((l) => /taken over/.test(l.msg)), 'an expected 0 from the release is no takeover');
  });

  test('idempotency: two entries of one task read at once by one consumer run one at a time; one effect', async () => {
    const prefix = prefixFor();
    const qk = new KeySpace(prefix).queue(QUEUE);
    await new Producer(redis, { prefix }).publish(QUEUE, { task_type: 'jobs.twice', idempotency_key: 'twice-1' });
    // A failover that lost an ack or a promotion: the same Envelope twice in the stream.
    const [[, fields]] = await redis.xrangeBuffer(qk.stream('normal'), '-', '+');
    await redis.xadd(qk.stream('normal'), '*', ...fields);
    let running = 0;
    let most = 0;
    let ran = 0;
    let deferredWhileRunning = 0;
    const { worker, lines } = await startWorker(prefix, { concurrency: 2 }, (w) => {
      w.register('jobs.twice', async () => {
        running += 1;
        most = Math.max(most, running);
        await sleep(300);
        deferredWhileRunning = w.stats.deferred;
        ran += 1;
        running -= 1;
      });
    });
    await waitFor(() => worker.stats.duplicates === 1, { timeoutMs: 5000, message: 'the deferred entry found the key done' });
    assert.equal(ran, 1, 'the effect happened once');
    assert.equal(most, 1, 'never two attempts of the key at once');
    assert.ok(deferredWhileRunning >= 1, 'the second entry was deferred while the first ran');
    assert.ok(lines.some((l) => l.msg === 'an attempt of this idempotency key still runs on this consumer; deferred'));
    await waitFor(async () => (await pendingOf(prefix)) === 0 && (await redis.zcard(qk.delayed)) === 0, { message: 'the queue drains' });
    assert.deepEqual(await dead(prefix), []);
  });

  test('entries of a dead consumer are taken over after the lease and run', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const qk = ks.queue(QUEUE);
    for (const stream of qk.taskStreams) await redis.xgroup('CREATE', stream, 'workers', '0', 'MKSTREAM');
    const { taskId } = await new Producer(redis, { prefix }).publish(QUEUE, { task_type: 'order.close_timeout', payload: { order_id: 'T1' } });
    // A consumer reads it and dies (it never had, or no longer has, a liveness key).
    const read = await redis.xreadgroup('GROUP', 'workers', 'ghost-1', 'COUNT', 1, 'STREAMS', qk.stream('normal'), '>');
    assert.equal(read[0][1].length, 1);
    // forgetAfterMs below the lease: forgotten once idle for a lease.
    const { lines } = await startWorker(prefix, { forgetAfterMs: 1 });
    await waitFor(async () => (await effects(prefix, 'T1')) === '1', { timeoutMs: 6000 });
    assert.ok(lines.some((l) => l.msg === 'took over an entry of a dead consumer'));
    assert.deepEqual(await redis.lrange(`${prefix}:effects:log`, 0, -1), [`node:${taskId}`]);
    await waitFor(async () => {
      const consumers = await redis.xinfo('CONSUMERS', qk.stream('normal'), 'workers');
      return !consumers.some((c) => c.includes('ghost-1'));
    }, { message: 'the dead consumer is forgotten' });
    assert.ok(lines.some((l) => l.msg === 'forgot a dead consumer that held nothing' && l.owner === 'ghost-1'));
  });

  test('dead consumers holding nothing are kept until idle for forgetAfterMs (an hour)', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const qk = ks.queue(QUEUE);
    for (const stream of qk.taskStreams) await redis.xgroup('CREATE', stream, 'workers', '0', 'MKSTREAM');
    await redis.xgroup('CREATECONSUMER', qk.stream('normal'), 'workers', 'ghost-idle');
    const { worker } = await startWorker(prefix);
    await sleep(1000); // past the lease
    await worker.takeOver();
    const names = (await redis.xinfo('CONSUMERS', qk.stream('normal'), 'workers')).map((c) => c[1]);
    assert.ok(names.includes('ghost-idle'), JSON.stringify(names));
  });

  test('a task whose consumers keep dying is dead-lettered with who and where', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const qk = ks.queue(QUEUE);
    for (const stream of qk.taskStreams) await redis.xgroup('CREATE', stream, 'workers', '0', 'MKSTREAM');
    const env = newEnvelope({ task_type: 'order.close_timeout', payload: { order_id: 'R1' } });
    const f = encodeEntry(env);
    await redis.xadd(qk.stream('normal'), '*', 'v', f.v, 'enc', f.enc, 'body', f.body, 'n', '2');
    await redis.xreadgroup('GROUP', 'workers', 'ghost-r', 'COUNT', 1, 'STREAMS', qk.stream('normal'), '>');
    const { worker } = await startWorker(prefix, { maxRedeliveries: 3 });
    const [entry] = await waitFor(() => dead(prefix).then((d) => (d.length ? d : null)), { timeoutMs: 6000 });
    assert.equal(entry.failure_class, 'redelivery_limit');
    assert.equal(entry.redeliveries, '3');
    assert.equal(entry.attempts, undefined);
    assert.equal(entry.queue, QUEUE);
    assert.equal(entry.language, 'node');
    assert.equal(entry.consumer, 'ghost-r'); // the consumer that died holding it
    assert.equal(entry.pid, String(process.pid));
    assert.equal(entry.host, worker.host);
    assert.equal(entry.source_stream, qk.stream('normal'));
    for (const name of ['first_failure_at', 'last_failure_at', 'dead_at']) Timestamp.parse(entry[name]);
    assert.equal(entry['raw.body'], f.body.toString());
    assert.deepEqual(await redis.smembers(ks.deadQueues), [QUEUE]);
    assert.equal(await effects(prefix, 'R1'), null);
  });

  test('publishing a delayed task now removes the delayed copy; every delayed store registers the queue', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const qk = ks.queue(QUEUE);
    const producer = new Producer(redis, { prefix });
    const fields = { task_type: 'order.close_timeout', payload: { order_id: 'E1' }, task_id: 'e1-task' };
    for (let i = 0; i < 2; i += 1) {
      await redis.del(ks.queues);
      await producer.publish(QUEUE, { ...fields, schedule_time: Timestamp.fromEpochMs(Date.now() + 3_600_000) });
      assert.deepEqual(await redis.smembers(ks.queues), [QUEUE]);
    }
    const { entryId } = await producer.publish(QUEUE, fields);
    assert.ok(entryId);
    assert.equal(await redis.zcard(qk.delayed), 0);
    assert.equal(await redis.hlen(qk.delayedData), 0);
    assert.equal(await redis.xlen(qk.stream('normal')), 1);
  });

  test('a read takes exactly the credit, however many streams have entries', async () => {
    const prefix = prefixFor();
    const qk = new KeySpace(prefix).queue(QUEUE);
    const producer = new Producer(redis, { prefix });
    for (const [order, priority] of [['X1', 250], ['X2', 100], ['X3', 0]]) {
      await producer.publish(QUEUE, { task_type: 'test.sleep', payload: { ms: 600, order }, priority });
    }
    const { worker } = await startWorker(prefix, { prefetch: 1 });
    await waitFor(() => worker.inflight.size === 1);
    await sleep(200);
    let total = 0;
    for (const stream of qk.taskStreams) total += Number((await redis.xpending(stream, 'workers'))[0]);
    assert.equal(total, 1);
    await waitFor(async () => (await pendingOf(prefix)) === 0 && (await redis.xlen(qk.stream('low'))) === 0, { timeoutMs: 5000 });
  });

  test('a cancelled task is acknowledged before its type is checked', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const qk = ks.queue(QUEUE);
    const producer = new Producer(redis, { prefix });
    const cancelled = await producer.publish(QUEUE, { task_type: 'nobody.handles_this' });
    await redis.zadd(ks.cancelled, Date.now(), cancelled.taskId);
    const retried = await producer.publish(QUEUE, { task_type: 'nobody.handles_this', retry_count: 1 });
    await startWorker(prefix);
    const entries = await waitFor(async () => ((await dead(prefix)).length === 1 && (await pendingOf(prefix)) === 0 ? dead(prefix) : null));
    assert.equal(entries[0].task_id, retried.taskId);
    assert.equal(entries[0].failure_class, 'unknown_task_type');
    assert.equal(entries[0].attempts, '2');
    assert.notEqual(await redis.zscore(ks.cancelled, cancelled.taskId), null, 'the mark stays');
    assert.equal(await redis.xlen(qk.stream('normal')), 0);
  });

  test('idempotency is checked before the retry slot; a retry without a slot gives its claim back', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const qk = ks.queue(QUEUE);
    const slots = ks.retrying('order.close_timeout');
    await redis.zadd(slots, Date.now() + 60_000, 'someone-else');
    await redis.set(ks.idempotency('order.close_timeout', 'done-key'), 'done earlier 2025-09-11T04:40:00Z', 'PX', 60_000);
    const producer = new Producer(redis, { prefix });
    const dup = await producer.publish(QUEUE, { task_type: 'order.close_timeout', payload: { order_id: 'Q1' }, retry_count: 1, idempotency_key: 'done-key', headers: TIERED_HEADERS });
    const waiting = await producer.publish(QUEUE, { task_type: 'order.close_timeout', payload: { order_id: 'Q2' }, retry_count: 1, idempotency_key: 'free-key', headers: TIERED_HEADERS });
    const { lines } = await startWorker(prefix, { retryConcurrency: 1 });
    await waitFor(() => lines.some((l) => l.msg.startsWith('duplicate') && l.task_id === dup.taskId));
    await waitFor(() => lines.some((l) => l.msg.startsWith('all retry slots') && l.task_id === waiting.taskId));
    assert.equal(await redis.exists(ks.idempotency('order.close_timeout', 'free-key')), 0);
    assert.equal(await redis.zscore(qk.delayed, dup.taskId), null);
    assert.equal(await effects(prefix, 'Q2'), null);
  });

  test('retries: delay 0 leaves schedule_time out, x-first-failure-at is kept, timeouts skip the fast tier', async () => {
    const prefix = prefixFor();
    const seen = [];
    const { lines } = await startWorker(prefix, { fastRetries: 2 }, (worker) => {
      worker.register('test.record', async (payload, ctx) => {
        seen.push(ctx.envelope);
        if (seen.length < 4) throw new TransientError('flaky');
      });
      worker.register('test.refuse', async () => { throw new RejectedError('not for this tenant'); });
    });
    const producer = new Producer(redis, { prefix });
    await producer.publish(QUEUE, { task_type: 'test.record', max_retries: 5, headers: TIERED_HEADERS });
    await waitFor(() => seen.length === 4, { timeoutMs: 5000 });
    assert.deepEqual(seen.map((e) => e.schedule_time === null), [true, true, true, false]);
    assert.deepEqual(seen.map((e) => e.headers['x-fast-retries'] ?? ''), ['', '1', '2', '2']);
    const firsts = seen.map((e) => e.headers['x-first-failure-at']);
    assert.equal(firsts[0], undefined);
    Timestamp.parse(firsts[1]);
    assert.deepEqual(firsts.slice(2), [firsts[1], firsts[1]]);

    const slow = await producer.publish(QUEUE, { task_type: 'test.sleep', payload: { ms: 5000 }, timeout_ms: 100, max_retries: 1, headers: TIERED_HEADERS });
    const refused = await producer.publish(QUEUE, { task_type: 'test.refuse' });
    const entries = await waitFor(async () => ((await dead(prefix)).length === 2 ? dead(prefix) : null), { timeoutMs: 5000 });
    const byTask = Object.fromEntries(entries.map((e) => [e.task_id, e]));
    assert.equal(byTask[refused.taskId].failure_class, 'rejected');
    assert.equal(byTask[refused.taskId].attempts, '1');
    assert.equal(byTask[slow.taskId].failure_class, 'timeout');
    assert.equal(byTask[slow.taskId].attempts, '2');
    const last = decodeEntry({ v: byTask[slow.taskId]['raw.v'], enc: byTask[slow.taskId]['raw.enc'], body: byTask[slow.taskId]['raw.body'] });
    assert.equal(last.headers['x-fast-retries'], undefined);
    assert.notEqual(last.schedule_time, null);
    assert.deepEqual(lines.filter((l) => l.task_id === slow.taskId && l.msg === 'attempt failed; retrying').map((l) => l.tier), ['backoff']);
  });

  test('without x-retry-policy a failure is final and a retry takes no retry slot', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const slots = ks.retrying('order.close_timeout');
    await redis.zadd(slots, Date.now() + 60_000, 'someone-else');
    await startWorker(prefix, { retryConcurrency: 1 });
    const producer = new Producer(redis, { prefix });
    const failing = await producer.publish(QUEUE, { task_type: 'test.transient', max_retries: 3 });
    // A retry another language decided on (a Celery self.retry()): the cap is the tiered policy's.
    await producer.publish(QUEUE, { task_type: 'order.close_timeout', payload: { order_id: 'N1' }, retry_count: 1 });
    const [entry] = await waitFor(() => dead(prefix).then((d) => (d.length ? d : null)), { timeoutMs: 5000 });
    assert.equal(entry.task_id, failing.taskId);
    assert.equal(entry.failure_class, 'task_error');
    assert.equal(entry.attempts, '1');
    await waitFor(async () => (await effects(prefix, 'N1')) === '1', { timeoutMs: 5000 });
    assert.equal(await redis.zcard(slots), 1);
  });

  test('a retry waits for a free retry slot (retry_count unchanged)', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const slots = ks.retrying('order.close_timeout');
    await redis.zadd(slots, Date.now() + 60_000, 'someone-else');
    const { lines } = await startWorker(prefix, { retryConcurrency: 1 });
    const { taskId } = await new Producer(redis, { prefix }).publish(QUEUE, {
      task_type: 'order.close_timeout', payload: { order_id: 'S1' }, retry_count: 1, headers: TIERED_HEADERS,
    });
    await waitFor(() => lines.some((l) => l.msg.startsWith('all retry slots')));
    assert.equal(await effects(prefix, 'S1'), null);
    await redis.zrem(slots, 'someone-else');
    await waitFor(async () => (await effects(prefix, 'S1')) === '1', { timeoutMs: 5000 });
    await waitFor(async () => (await redis.zscore(slots, taskId)) === null, { message: 'the slot is released when the attempt ends' });
  });

  test('a task cancelled after promotion is acknowledged without running', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const qk = ks.queue(QUEUE);
    const env = newEnvelope({ task_type: 'order.close_timeout', payload: { order_id: 'C1' } });
    assert.deepEqual(await new Producer(redis, { prefix }).cancel(env.task_id), { outcome: 'marked', queue: null });
    const fields = encodeEntry(env);
    // On its way when it was cancelled: it arrives after the mark, twice (published again).
    for (let i = 0; i < 2; i += 1) await redis.xadd(qk.stream('normal'), '*', 'v', fields.v, 'enc', fields.enc, 'body', fields.body);
    const { lines } = await startWorker(prefix);
    await waitFor(() => lines.filter((l) => l.msg.startsWith('task was cancelled')).length === 2);
    assert.equal(await effects(prefix, 'C1'), null);
    assert.notEqual(await redis.zscore(ks.cancelled, env.task_id), null, 'consumers leave the mark in place');
    assert.equal(await pendingOf(prefix), 0);
    assert.equal(await redis.xlen(qk.stream('normal')), 0);
  });

  test('close() waits within its grace for an abandoned attempt, settles its claim, and leaves no timer behind', async () => {
    // A program of its own, so that a timer left running shows as a process that does not exit.
    const program = `
      import { setTimeout as sleep } from 'node:timers/promises';
      import { Writable } from 'node:stream';
      import { Producer, Worker, createLogger } from ${JSON.stringify(new URL('../src/index.js', import.meta.url).href)};
      const { REDIS_URL: url, PREFIX: prefix, GRACE_MS: graceMs } = process.env;
      const logger = createLogger({ stream: new Writable({ write: (_c, _e, done) => done() }) });
      const worker = new Worker({ redis: url, prefix, queue: 'jobs', concurrency: 2, leaseMs: 900, blockMs: 100, promoterMaxIdleMs: 200, logger });
      worker.register('jobs.overrun', async () => { await sleep(1000); }); // ignores its signal
      worker.register('jobs.short', async () => { await sleep(600); });
      await worker.start();
      const producer = new Producer({ connection: url, prefix });
      await producer.publish('jobs', { task_type: 'jobs.short' });
      await producer.publish('jobs', { task_type: 'jobs.overrun', timeout_ms: 100, max_retries: 0, idempotency_key: 'close-1' });
      await new Promise((resolve) => worker.once('dead', resolve)); // abandoned at 100 ms, dead-lettered as timeout
      await producer.close();
      await worker.close(graceMs ? { graceMs: Number(graceMs) } : undefined);
      console.log(JSON.stringify(worker.stats));
    `;
    const run = (graceMs) => {
      const prefix = prefixFor();
      const started = Date.now();
      const out = execFileSync(process.execPath, ['--input-type=module', '-e', program], {
        env: { ...process.env, REDIS_URL: server.url, PREFIX: prefix, GRACE_MS: graceMs ?? '' }, encoding: 'utf8', timeout: 15_000,
      });
      return { prefix, stats: JSON.parse(out), exitedAfterMs: Date.now() - started };
    };
    const idemValue = (prefix) => redis.get(new KeySpace(prefix).idempotency('jobs.overrun', 'close-1'));

    // The default grace (30 s): close() waits for the short task and the abandoned handler, which marks the key done.
    const waited = run();
    assert.ok(waited.exitedAfterMs < 8000, `the process exited ${waited.exitedAfterMs} ms after it started`);
    assert.equal(waited.stats.succeeded, 1);
    assert.match(await idemValue(waited.prefix), /^done /);
    // A grace shorter than the handler: its claim is no longer renewed, and the process still exits.
    const gaveUp = run('200');
    assert.ok(gaveUp.exitedAfterMs < 8000, `the process exited ${gaveUp.exitedAfterMs} ms after it started`);
    const left = await idemValue(gaveUp.prefix);
    assert.ok(left === null || left.startsWith('running '), `left to expire, never settled on a closed connection: ${left}`);
  });

  test('stop: prefetched entries go back, the running one finishes, the liveness key goes', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const qk = ks.queue(QUEUE);
    const { worker, lines } = await startWorker(prefix, { blockMs: 3000, prefetch: 3 });
    await sleep(200); // parked in its blocking read
    // One entry per bucket arrives together: one runs, two are read ahead.
    const entries = [
      ['high', newEnvelope({ task_type: 'test.sleep', payload: { ms: 400 }, priority: 200 })],
      ['normal', newEnvelope({ task_type: 'order.close_timeout', payload: { order_id: 'P1' } })],
      ['low', newEnvelope({ task_type: 'order.close_timeout', payload: { order_id: 'P2' }, priority: 1 })],
    ];
    const multi = redis.multi();
    for (const [bucket, env] of entries) {
      const f = encodeEntry(env);
      multi.xadd(qk.stream(bucket), '*', 'v', f.v, 'enc', f.enc, 'body', f.body);
    }
    await multi.exec();
    await waitFor(() => worker.inflight.size === 1 && worker.waiting.length === 2);
    await worker.stop();
    assert.ok(lines.some((l) => l.msg === 'task succeeded' && l.task_id === entries[0][1].task_id));
    const requeued = lines.filter((l) => l.why === 'prefetched but not started before shutdown');
    assert.deepEqual(requeued.map((l) => l.task_id).sort(), [entries[1][1].task_id, entries[2][1].task_id].sort());
    assert.deepEqual(requeued.map((l) => l.trace_id).sort(), [entries[1][1].trace_id, entries[2][1].trace_id].sort());
    assert.equal(await effects(prefix, 'P1'), null);
    assert.equal(await redis.xlen(qk.stream('normal')), 1);
    assert.equal(await redis.xlen(qk.stream('low')), 1);
    assert.equal(await pendingOf(prefix), 0);
    assert.equal(await redis.exists(ks.consumer(worker.consumer)), 0);
    // Another worker runs them.
    await startWorker(prefix);
    await waitFor(async () => (await effects(prefix, 'P1')) === '1' && (await effects(prefix, 'P2')) === '1');
  });

  test('the most urgent bucket is served first', async () => {
    const prefix = prefixFor();
    const producer = new Producer(redis, { prefix });
    const order = [];
    for (const [id, priority] of [['low', 10], ['normal', 100], ['high', 250], ['low2', 0], ['high2', 170]]) {
      const { taskId } = await producer.publish(QUEUE, { task_type: 'order.close_timeout', payload: { order_id: id }, priority });
      order.push([priority, taskId]);
    }
    await startWorker(prefix);
    const log = await waitFor(async () => {
      const ran = await redis.lrange(`${prefix}:effects:log`, 0, -1);
      return ran.length === 5 ? ran : null;
    });
    const byUrgency = [...order].sort((a, b) => (b[0] >= 170) - (a[0] >= 170) || (b[0] >= 85) - (a[0] >= 85));
    assert.deepEqual(log, byUrgency.map(([, taskId]) => `node:${taskId}`));
  });

  test('a deleted stream and group are created again; reading goes on', async () => {
    const prefix = prefixFor();
    const qk = new KeySpace(prefix).queue(QUEUE);
    const { lines } = await startWorker(prefix);
    await redis.del(...qk.taskStreams);
    await waitFor(() => lines.some((l) => l.msg === 'reading failed; retrying in 1 s'), { timeoutMs: 3000 });
    await new Producer(redis, { prefix }).publish(QUEUE, { task_type: 'order.close_timeout', payload: { order_id: 'G1' } });
    await waitFor(async () => (await effects(prefix, 'G1')) === '1', { timeoutMs: 6000 });
  });

  test('concurrency: several tasks run at once', async () => {
    const prefix = prefixFor();
    const { lines } = await startWorker(prefix, { concurrency: 4 });
    const producer = new Producer(redis, { prefix });
    const started = Date.now();
    for (let i = 0; i < 4; i += 1) await producer.publish(QUEUE, { task_type: 'test.sleep', payload: { ms: 300 } });
    await waitFor(() => lines.filter((l) => l.msg === 'task succeeded').length === 4);
    assert.ok(Date.now() - started < 1000, 'the four sleeps overlapped');
  });
});
