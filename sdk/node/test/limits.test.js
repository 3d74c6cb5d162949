// Limits per task type (docs/protocol.md section 19) on a private redis-server:
// concurrency slots shared by workers, a GCRA rate, slots that come back after the
// lease of a consumer that stopped renewing them, limits changed while workers run,
// a circuit breaker that opens, probes and closes, and the limits API.

import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, describe, test } from 'node:test';
import Redis from 'ioredis';
import { KeySpace } from '../src/keys.js';
import { InvalidLimits, PARKED_CONSUMER, TaskLimits } from '../src/limits.js';
import { Producer } from '../src/producer.js';
import { Scripts } from '../src/scripts.js';
import { Worker } from '../src/worker.js';
import { quietLogger, startRedisServer, waitFor } from '../support/helpers.js';

const QUEUE = 'limited';
const SLOW = 'limits.slow';
const FAST = 'limits.fast';
const FLAKY = 'limits.flaky';

/** The most spans [start, end] that overlap at one instant (an end before a start at the same time). */
function maxOverlap(spans) {
  const events = spans.flatMap(({ start, end }) => [[start, 1], [end, -1]]).sort((a, b) => a[0] - b[0] || a[1] - b[1]);
  let now = 0;
  let most = 0;
  for (const [, step] of events) {
    now += step;
    most = Math.max(most, now);
  }
  return most;
}

describe('limits per task type', { concurrency: false }, () => {
  let server;
  let redis;

  before(async () => {
    server = await startRedisServer();
    redis = new Redis(server.port, '127.0.0.1');
  });

  after(async () => {
    redis.disconnect();
    await server.stop();
  });

  /** A fresh key space: its prefix, queue keys, producer and limits API. */
  function space() {
    const prefix = `lim-${crypto.randomBytes(4).toString('hex')}`;
    const producer = new Producer(redis, { prefix });
    return { prefix, qk: new KeySpace(prefix).queue(QUEUE), producer, limits: producer.taskLimits };
  }

  /**
   * Started workers of QUEUE whose handlers record a span { id, type, start, end, failed }
   * per run in `spans`; SLOW sleeps payload.ms, FLAKY throws while `flaky.failing` is set.
   * `stop()` stops them all.
   */
  async function startWorkers(prefix, count, options = {}) {
    const spans = [];
    const flaky = { failing: false };
    const run = (type) => async (payload, ctx) => {
      const span = { id: ctx.taskId, type, start: Date.now(), end: null, failed: false };
      spans.push(span);
      if (payload.ms) await sleep(payload.ms);
      span.failed = type === FLAKY && flaky.failing;
      span.end = Date.now();
      if (span.failed) throw new Error('flaky is failing');
    };
    const workers = [];
    for (let i = 0; i < count; i += 1) {
      workers.push(new Worker(QUEUE, { [SLOW]: run(SLOW), [FAST]: run(FAST), [FLAKY]: run(FLAKY) }, {
        connection: server.url, prefix, leaseMs: 1500, blockMs: 500, concurrency: 4, promoter: false,
        logger: quietLogger(), ...options,
      }));
    }
    for (const worker of workers) await worker.waitUntilReady();
    const stop = () => Promise.all(workers.map((w) => w.stop({ graceMs: 0 })));
    return { workers, spans, flaky, stop };
  }

  const tasks = (type, count, payload = {}) => Array.from({ length: count }, () => ({ task_type: type, payload }));

  /** Nothing pending, parked or holding a slot once every task ran. */
  async function assertSettled(qk, type) {
    for (const stream of qk.taskStreams) assert.equal(Number((await redis.xpending(stream, 'workers'))[0]), 0, stream);
    assert.equal(await redis.zcard(qk.running(type)), 0, 'every slot was freed');
    assert.equal(await redis.llen(`${qk.base}:parked:${type}`), 0, 'nothing is parked');
  }

  test('a concurrency cap holds across two workers; other types flow past the parked backlog', { timeout: 20_000 }, async () => {
    const { prefix, qk, producer, limits } = space();
    await limits.set(QUEUE, SLOW, { concurrency: 2 });
    await producer.publishMany(QUEUE, [...tasks(SLOW, 12, { ms: 150 }), ...tasks(FAST, 12)]);
    const { spans, stop } = await startWorkers(prefix, 2);
    try {
      await waitFor(() => spans.length === 24 && spans.every((s) => s.end !== null), { timeoutMs: 10_000, message: 'all 24 ran' });
      await sleep(100); // a second run of any of them would show now
      assert.equal(new Set(spans.map((s) => s.id)).size, 24, 'each task ran exactly once');
      const slow = spans.filter((s) => s.type === SLOW);
      const fast = spans.filter((s) => s.type === FAST);
      assert.equal(slow.length, 12);
      assert.equal(maxOverlap(slow), 2, 'two slow tasks at once, never more');
      assert.ok(Math.max(...fast.map((s) => s.end)) < Math.max(...slow.map((s) => s.end)), 'the unlimited tasks did not wait for the slow backlog');
      await assertSettled(qk, SLOW);
    } finally {
      await stop();
    }
  });

  test('a rate of 20 per second with burst 1 spaces the starts ~50 ms apart', { timeout: 20_000 }, async () => {
    const { prefix, qk, producer, limits } = space();
    await limits.set(QUEUE, FAST, { rate: 20, burst: 1 });
    await producer.publishMany(QUEUE, tasks(FAST, 40));
    const { spans, stop } = await startWorkers(prefix, 1);
    try {
      await waitFor(() => spans.length === 40 && spans.every((s) => s.end !== null), { timeoutMs: 8000, message: 'all 40 ran' });
      const starts = spans.map((s) => s.start).sort((a, b) => a - b);
      const span = starts.at(-1) - starts[0];
      assert.ok(span >= 1600 && span <= 2600, `39 intervals of 50 ms took ${span} ms`);
      const gaps = starts.slice(1).map((at, i) => at - starts[i]);
      assert.ok(Math.max(...gaps) < 200, `each start came soon after its token: gaps ${gaps.join(', ')}`);
      await assertSettled(qk, FAST);
    } finally {
      await stop();
    }
  });

  test('a task that runs longer than the lease keeps its slot: the liveness renewal renews it', { timeout: 20_000 }, async () => {
    const { prefix, qk, producer, limits } = space();
    await limits.set(QUEUE, SLOW, { concurrency: 1 });
    await producer.publishMany(QUEUE, tasks(SLOW, 2, { ms: 900 }));
    const { spans, stop } = await startWorkers(prefix, 1, { leaseMs: 600 });
    try {
      await waitFor(() => spans.length === 2 && spans.every((s) => s.end !== null), { timeoutMs: 6000, message: 'both ran' });
      assert.equal(maxOverlap(spans), 1, 'the second started once the first had ended');
      await assertSettled(qk, SLOW);
    } finally {
      await stop();
    }
  });

  test('a slot its consumer stopped renewing comes back after the lease, never before; parked entries are not taken over', { timeout: 20_000 }, async () => {
    const { prefix, qk, producer, limits } = space();
    await limits.set(QUEUE, SLOW, { concurrency: 1 });
    for (const stream of qk.taskStreams) await redis.xgroup('CREATE', stream, 'workers', '0', 'MKSTREAM');
    const held = await producer.publish(QUEUE, { task_type: SLOW, payload: {} });
    // A consumer that reads with read.lua (lease 1500 ms), then never renews nor settles;
    // its liveness key stays, so only the slot's deadline can free the slot.
    await redis.set(`${prefix}:consumer:gone`, 'host 1 node', 'PX', 20_000);
    const [reply] = await new Scripts(redis).runBuffer('read', qk.taskStreams, ['workers', 'gone', 1, 1500, 1]);
    assert.equal(reply[0][1][0][0].toString(), held.entryId);
    const deadline = Number(await redis.zscore(qk.running(SLOW), `${qk.stream('normal')} ${held.entryId}`));
    const waiting = await producer.publish(QUEUE, { task_type: SLOW, payload: {} });
    // Its lease is shorter than the parked wait: it would take the parked entry over if it could.
    const { workers: [worker], spans, stop } = await startWorkers(prefix, 1, { leaseMs: 600 });
    try {
      await waitFor(() => spans.length === 1, { timeoutMs: 5000, message: 'the parked task started' });
      const [{ id, start }] = spans;
      assert.equal(id, waiting.taskId);
      assert.ok(start >= deadline, `started ${deadline - start} ms before the slot's deadline`);
      assert.ok(start < deadline + 500, `started ${start - deadline} ms after the slot's deadline`);
      assert.equal(worker.stats.taken_over, 0, 'the parked entry was handed out, not taken over');
      await sleep(300);
      assert.equal(spans.length, 1, 'the entry of the consumer that stopped renewing stays its own');
    } finally {
      await stop();
      await redis.del(`${prefix}:consumer:gone`);
    }
  });

  test('raising a concurrency limit from 1 to 3 takes effect without a restart', { timeout: 20_000 }, async () => {
    const { prefix, qk, producer, limits } = space();
    await limits.set(QUEUE, SLOW, { concurrency: 1 });
    await producer.publishMany(QUEUE, tasks(SLOW, 9, { ms: 250 }));
    const { spans, stop } = await startWorkers(prefix, 1);
    try {
      await waitFor(() => spans.length === 2, { timeoutMs: 5000, message: 'two ran one after the other' });
      const raisedAt = Date.now();
      await limits.set(QUEUE, SLOW, { concurrency: 3 });
      await waitFor(() => spans.length === 9 && spans.every((s) => s.end !== null), { timeoutMs: 8000, message: 'all 9 ran' });
      assert.equal(maxOverlap(spans.filter((s) => s.start < raisedAt)), 1, 'one at a time before the change');
      assert.equal(maxOverlap(spans), 3, 'three at a time after it');
      await assertSettled(qk, SLOW);
    } finally {
      await stop();
    }
  });

  test('a circuit breaker opens on failures, holds its type back for the cool-down, lets one probe through and closes on its success', { timeout: 20_000 }, async (t) => {
    const { prefix, qk, producer, limits } = space();
    const cooldownMs = 1500;
    await limits.set(QUEUE, FLAKY, { breaker: { failure_ratio: 0.5, min_attempts: 4, window_s: 30, cooldown_s: cooldownMs / 1000, probes: 1 } });
    const breaker = `${qk.base}:breaker:${FLAKY}`;
    const task = { task_type: FLAKY, payload: {}, max_retries: 0 }; // a failure dead-letters it at once
    const { spans, flaky, stop } = await startWorkers(prefix, 2);
    flaky.failing = true;
    try {
      const failing = [];
      while ((await redis.hget(breaker, 'state')) !== 'open') {
        assert.ok(failing.length < 60, 'the breaker opened within 6 s of failures');
        failing.push((await producer.publish(QUEUE, task)).taskId);
        await sleep(100);
      }
      const openedAt = Number(await redis.hget(breaker, 'since'));
      const failedEnds = spans.filter((s) => s.failed).map((s) => s.end).sort((a, b) => a - b);
      assert.ok(failedEnds.length >= 4, `${failedEnds.length} failures opened it`);
      t.diagnostic(`opened ${Math.round(openedAt - failedEnds[3])} ms after the 4th failure, ${failedEnds.length} failures by then`);
      const held = (await producer.publishMany(QUEUE, Array.from({ length: 5 }, () => task))).map((r) => r.taskId);
      // What was handed out before the breaker opened ends (and fails) before the flag is cleared.
      await waitFor(() => spans.every((s) => s.end !== null), { timeoutMs: 2000, message: 'the runs begun before the opening ended' });
      flaky.failing = false;
      await waitFor(async () => (await redis.hget(breaker, 'state')) === 'closed', { timeoutMs: 8000, message: 'the breaker closed' });
      const closedAt = Number(await redis.hget(breaker, 'since'));
      const all = [...failing, ...held];
      await waitFor(() => all.every((id) => spans.some((s) => s.id === id && s.end !== null)), { timeoutMs: 5000, message: 'every task ran' });
      assert.equal(spans.length, all.length, 'each task ran exactly once');
      const started = (ids) => spans.filter((s) => ids.includes(s.id));
      for (const span of started(held)) {
        assert.ok(span.start >= openedAt + cooldownMs, `a task published while open started ${span.start - openedAt} ms into the ${cooldownMs} ms cool-down`);
      }
      const probes = spans.filter((s) => s.start >= openedAt + cooldownMs && s.start < closedAt);
      assert.equal(probes.length, 1, `one probe while half-open, not ${probes.length}`);
      assert.equal(probes[0].failed, false, 'the probe succeeded');
      const afterCooldown = spans.filter((s) => s.start >= openedAt + cooldownMs);
      assert.ok(afterCooldown.length >= held.length, 'the held tasks ran once it closed');
      assert.ok(afterCooldown.every((s) => !s.failed), 'and succeeded');
      await assertSettled(qk, FLAKY);
    } finally {
      await stop();
    }
  });

  test('the limits API validates, then sets, gets, lists and removes', async () => {
    const { qk } = space();
    const api = new TaskLimits(redis, { prefix: qk.prefix });
    assert.equal(await api.set(QUEUE, 'b.type', { rate: 10, burst: 5 }), '{"burst":5,"rate":10}');
    await api.set(QUEUE, 'a.type', { smooth: false, concurrency: 2 });
    assert.equal(await redis.hget(qk.limits, 'a.type'), '{"concurrency":2,"smooth":false}', 'canonical: the members given, in name order');
    assert.deepEqual(await api.get(QUEUE, 'b.type'), { burst: 5, rate: 10 });
    assert.equal(await api.get(QUEUE, 'c.type'), null);
    assert.deepEqual(await api.list(QUEUE), { 'a.type': { concurrency: 2, smooth: false }, 'b.type': { burst: 5, rate: 10 } });
    await assert.rejects(api.set(QUEUE, 'a.type', { concurrency: 0 }),
      (err) => err instanceof InvalidLimits && err.field === 'concurrency' && err.rule === 'minimum' && /limits\.concurrency: minimum/.test(err.message));
    await assert.rejects(api.set(QUEUE, 'a.type', { concurency: 3 }), (err) => err.field === 'concurency' && err.rule === 'unknown_field');
    assert.deepEqual(await api.get(QUEUE, 'a.type'), { concurrency: 2, smooth: false }, 'a refused limit writes nothing');
    assert.equal(await api.remove(QUEUE, 'a.type'), true);
    assert.equal(await api.remove(QUEUE, 'a.type'), false);
    assert.deepEqual(await api.list(QUEUE), { 'b.type': { burst: 5, rate: 10 } });
    await redis.hset(qk.limits, 'bad.type', '{not json');
    await assert.rejects(api.get(QUEUE, 'bad.type'), /limits of bad\.type on queue limited are not JSON/);
    await assert.rejects(api.set(QUEUE, '', { concurrency: 1 }), /task type must be a non-empty string/);
    assert.equal(await api.set(QUEUE, 'd.type', { breaker: { probes: 2, failure_ratio: 0.25 } }), '{"breaker":{"failure_ratio":0.25,"probes":2}}',
      'a breaker alone, its members given in name order');
    await assert.rejects(api.set(QUEUE, 'd.type', { breaker: { failure_ratio: 0.5, cooldown: 5 } }),
      (err) => err.field === 'breaker.cooldown' && err.rule === 'unknown_field' && /limits\.breaker\.cooldown: unknown_field/.test(err.message));
  });

  test('no worker may take the reserved consumer name', () => {
    assert.throws(() => new Worker({ redis: server.url, queue: QUEUE, consumer: PARKED_CONSUMER }), /reserved for parked entries/);
  });
});
