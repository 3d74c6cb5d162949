// Ordering keys (docs/protocol.md section 20) with two workers of this SDK on one queue of
// a real Redis: tasks of one key run one at a time in the order they joined, other keys in
// parallel; retries keep the key's place; a dead-lettered head moves its key on or halts
// it; a delayed keyed task joins when due; keyed bodies are never gzipped.

import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
import { describe, test } from 'node:test';
import { ENC_JSON, ENC_JSON_GZIP } from '../src/codec.js';
import { DeadLetters } from '../src/deadletters.js';
import { KeySpace } from '../src/keys.js';
import { Producer, WAITING } from '../src/producer.js';
import { RETRY_POLICY_HEADER, TIERED } from '../src/retry.js';
import { Timestamp } from '../src/time.js';
import { Worker } from '../src/worker.js';
import { quietLogger, redisSuite, waitFor } from '../support/helpers.js';

const { server, skip, prefixFor, connect } = await redisSuite('ord');
const QUEUE = 'orders';
const STEP = 'ord.step';

describe('ordering keys', { skip, concurrency: false }, () => {
  const { redis, workers } = connect();

  /** A fresh key space: its prefix, queue keys, a producer and the events list of its runs. */
  function space() {
    const prefix = prefixFor();
    const qk = new KeySpace(prefix).queue(QUEUE);
    const events = `${prefix}:ord:events`;
    return { prefix, qk, producer: new Producer(redis, { prefix }), events: () => redis.lrange(events, 0, -1) };
  }

  /**
   * Two started workers of QUEUE whose ord.step handler records "start <name>", sleeps
   * payload.ms, then records "end <name>", or "fail <name>" and throws while payload.fail
   * is true or for the first payload.fail_times attempts. Answers a function that stops
   * them, whose `workers` are the two workers.
   */
  async function startWorkers(prefix) {
    const started = [];
    for (let i = 0; i < 2; i += 1) {
      const worker = new Worker({
        redis: server.url, prefix, queue: QUEUE, concurrency: 2, leaseMs: 900, blockMs: 100,
        backoffMs: 50, maxBackoffMs: 100, promoterMaxIdleMs: 200, logger: quietLogger(),
      });
      worker.register(STEP, async (payload, ctx) => {
        const events = `${ctx.keys.prefix}:ord:events`;
        await ctx.redis.rpush(events, `start ${payload.name}`);
        if (payload.ms) await sleep(payload.ms);
        const failed = payload.fail === true || ctx.attempt < (payload.fail_times ?? 0);
        await ctx.redis.rpush(events, `${failed ? 'fail' : 'end'} ${payload.name}`);
        if (failed) throw new Error(`${payload.name} fails`);
      });
      workers.push(worker);
      started.push(worker);
    }
    await Promise.all(started.map((worker) => worker.start()));
    return Object.assign(() => Promise.all(started.map((worker) => worker.stop({ graceMs: 0 }))), { workers: started });
  }

  const step = (name, key, { ms = 0, ...payload } = {}, fields = {}) => ({
    task_type: STEP, ordering_key: key, payload: { name, ms, ...payload }, ...fields,
  });
  /** The events of runs whose name starts with one of `prefixes`. */
  const only = (events, ...prefixes) => events.filter((e) => prefixes.some((p) => e.split(' ')[1].startsWith(p)));
  /** Positions of "start <name>" and "end <name>" in `events`. */
  const span = (events, name) => [events.indexOf(`start ${name}`), events.indexOf(`end ${name}`)];

  test('tasks of one key run one at a time in publish order, another key runs in parallel', async () => {
    const { prefix, qk, producer, events } = space();
    const stop = await startWorkers(prefix);
    const results = [];
    for (let n = 1; n <= 4; n += 1) {
      results.push(await producer.publish(QUEUE, step(`a${n}`, 'A', { ms: 120 })));
      results.push(await producer.publish(QUEUE, step(`b${n}`, 'B', { ms: 120 })));
    }
    // The heads go to the stream; the others wait for their turn, in no stream.
    assert.deepEqual(results.map((r) => r.waiting), [false, false, true, true, true, true, true, true]);
    assert.equal(results[2].entryId, WAITING);
    await waitFor(async () => (await events()).filter((e) => e.startsWith('end ')).length === 8, {
      timeoutMs: 8000, message: async () => JSON.stringify(await events()),
    });
    await stop();
    const seen = await events();
    for (const key of ['a', 'b']) {
      assert.deepEqual(only(seen, key), [1, 2, 3, 4].flatMap((n) => [`start ${key}${n}`, `end ${key}${n}`]), JSON.stringify(seen));
    }
    const overlaps = [1, 2, 3, 4].some((i) => [1, 2, 3, 4].some((j) => {
      const [sa, ea] = span(seen, `a${i}`);
      const [sb, eb] = span(seen, `b${j}`);
      return sa < eb && sb < ea;
    }));
    assert.ok(overlaps, `the keys ran in parallel: ${JSON.stringify(seen)}`);
    for (const key of ['A', 'B']) {
      assert.equal(await redis.exists(qk.order(key), qk.orderWaiting(key)), 0, 'an order left empty disappears');
    }
  });

  test('a due keyed publish registers its queue for the promoters; an unkeyed one does not', async () => {
    const { prefix, producer } = space();
    const ks = new KeySpace(prefix);
    await producer.publish(QUEUE, { task_type: STEP, payload: { name: 'u' } });
    assert.deepEqual(await redis.smembers(ks.queues), []);
    await producer.publish(QUEUE, step('k', 'K'));
    assert.deepEqual(await redis.smembers(ks.queues), [QUEUE]);
  });

  test('a keyed task retried after a failure keeps its place: the next one starts after the retry succeeded', async () => {
    const { prefix, producer, events } = space();
    const stop = await startWorkers(prefix);
    await producer.publish(QUEUE, step('r1', 'R', { fail_times: 1 }, { headers: { [RETRY_POLICY_HEADER]: TIERED } }));
    await producer.publish(QUEUE, step('r2', 'R'));
    await waitFor(async () => (await events()).includes('end r2'), { timeoutMs: 5000, message: async () => JSON.stringify(await events()) });
    await stop();
    assert.deepEqual(await events(), ['start r1', 'fail r1', 'start r1', 'end r1', 'start r2', 'end r2']);
  });

  test('a dead-lettered head without a policy moves its key on', async () => {
    const { prefix, qk, producer, events } = space();
    const stop = await startWorkers(prefix);
    await producer.publish(QUEUE, step('n1', 'N', { fail: true }));
    await producer.publish(QUEUE, step('n2', 'N'));
    await waitFor(async () => (await events()).includes('end n2'), { timeoutMs: 5000, message: async () => JSON.stringify(await events()) });
    await stop();
    assert.deepEqual(await events(), ['start n1', 'fail n1', 'start n2', 'end n2']);
    assert.equal(await redis.xlen(qk.dead), 1);
    assert.equal(await redis.exists(qk.orderHalted), 0);
  });

  test('a dead-lettered head under policy halt stops its key until its dead letter is replayed', async () => {
    const { prefix, qk, producer, events } = space();
    await redis.hset(qk.orderPolicy, STEP, 'halt');
    const stop = await startWorkers(prefix);
    const head = await producer.publish(QUEUE, step('h1', 'H', { fail: true }));
    const next = await producer.publish(QUEUE, step('h2', 'H'));
    await waitFor(async () => (await redis.xlen(qk.dead)) === 1);
    await sleep(600); // several promoter looks
    assert.deepEqual(await events(), ['start h1', 'fail h1'], 'the next task of a halted key does not run');
    assert.equal(await redis.hget(qk.orderHalted, 'H'), head.taskId);
    assert.deepEqual(await redis.lrange(qk.order('H'), 0, -1), [head.taskId, next.taskId]);
    assert.deepEqual(await redis.hkeys(qk.orderWaiting('H')), [next.taskId]);
    // Replayed (fixed), the head runs again as the head and the key moves on.
    const [letter] = await redis.xrange(qk.dead, '-', '+');
    const tools = new DeadLetters(redis, { prefix });
    const replayed = await tools.replay(QUEUE, letter[0], { payload: { name: 'h1' } });
    assert.notEqual(replayed, WAITING);
    await waitFor(async () => (await events()).includes('end h2'), { timeoutMs: 5000, message: async () => JSON.stringify(await events()) });
    await stop();
    assert.deepEqual(await events(), ['start h1', 'fail h1', 'start h1', 'end h1', 'start h2', 'end h2']);
    assert.equal(await redis.exists(qk.orderHalted), 0);
  });

  test('a delayed keyed task joins its key when due, after the tasks already there', async () => {
    const { prefix, producer, events } = space();
    const stop = await startWorkers(prefix);
    const delayed = await producer.publish(QUEUE, step('d', 'D', {}, { schedule_time: Timestamp.fromEpochMs(Date.now() + 300) }));
    assert.equal(delayed.delayed, true);
    await producer.publish(QUEUE, step('d1', 'D', { ms: 600 }));
    await producer.publish(QUEUE, step('d2', 'D'));
    await waitFor(async () => (await events()).includes('end d'), { timeoutMs: 5000, message: async () => JSON.stringify(await events()) });
    await stop();
    assert.deepEqual(await events(), ['start d1', 'end d1', 'start d2', 'end d2', 'start d', 'end d']);
  });

  test('an entry moved to the delayed set because it is not due yet keeps its key\'s place', async () => {
    const { prefix, producer, events } = space();
    // A publisher whose clock is ahead: the task is due for it, not for the workers.
    await producer.publish(QUEUE, step('x', 'X', {}, { schedule_time: Timestamp.fromEpochMs(Date.now() + 600) }),
      { nowMs: Date.now() + 2000 });
    await producer.publish(QUEUE, step('y', 'X'));
    const stop = await startWorkers(prefix);
    await waitFor(async () => (await events()).includes('end y'), { timeoutMs: 5000, message: async () => JSON.stringify(await events()) });
    await stop();
    assert.deepEqual(await events(), ['start x', 'end x', 'start y', 'end y']);
  });

  test('duplicate, expired and cancelled keyed tasks are acknowledged unrun when their turn comes, and the key moves on', async () => {
    const { prefix, qk, producer, events } = space();
    const stop = await startWorkers(prefix);
    await producer.publish(QUEUE, step('c1', 'C', { ms: 300 }, { idempotency_key: 'once' }));
    await producer.publish(QUEUE, step('dup', 'C', {}, { idempotency_key: 'once' }));
    await producer.publish(QUEUE, step('expired', 'C'), { expiresInMs: 100 });
    const cancelled = await producer.publish(QUEUE, step('cancelled', 'C'));
    await producer.cancel(cancelled.taskId);
    await producer.publish(QUEUE, step('c2', 'C'));
    await waitFor(async () => (await events()).includes('end c2'), { timeoutMs: 5000, message: async () => JSON.stringify(await events()) });
    await stop();
    assert.deepEqual(await events(), ['start c1', 'end c1', 'start c2', 'end c2']);
    const total = (name) => stop.workers.reduce((sum, worker) => sum + worker.stats[name], 0);
    assert.deepEqual(['duplicates', 'expired', 'cancelled'].map(total), [1, 1, 1]);
    assert.equal(await redis.exists(qk.order('C'), qk.orderWaiting('C')), 0);
  });

  test('a keyed Envelope over the gzip threshold is written enc json, in its stream and while it waits', async () => {
    const { qk, producer } = space();
    const blob = 'x'.repeat(10_000);
    const first = await producer.publish(QUEUE, step('big1', 'G', { blob }));
    const second = await producer.publish(QUEUE, step('big2', 'G', { blob }));
    const unkeyed = await producer.publish(QUEUE, { task_type: STEP, payload: { name: 'big3', blob } });
    const entries = Object.fromEntries((await redis.xrange(qk.stream('normal'), '-', '+')).map(([id, flat]) => [id, flat]));
    const encOf = (flat) => flat[flat.indexOf('enc') + 1];
    assert.equal(encOf(entries[first.entryId]), ENC_JSON);
    assert.equal(encOf(entries[unkeyed.entryId]), ENC_JSON_GZIP);
    assert.equal(second.waiting, true);
    const stored = await redis.hget(qk.orderWaiting('G'), second.taskId);
    assert.ok(stored.startsWith(`normal\n${ENC_JSON}\n{`), stored.slice(0, 40));
  });
});
