// Worker statistics (docs/protocol.md section 17) and heartbeat_ms (section 15)
// against a real Redis: the hash after a known workload, the renewal writes, and a
// failed write kept for the next one.

import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import { describe, test } from 'node:test';
import {
  HISTOGRAM_BOUNDS, KeySpace, Producer, RETRY_POLICY_HEADER, STATS_KEEP_MS, TIERED, TaskStatistics, TransientError,
  Timestamp, Worker, bucketField, createLogger,
} from '../src/index.js';
import { redisSuite, waitFor } from '../support/helpers.js';

const { server, skip, prefixFor, connect } = await redisSuite('st');
const QUEUE = 'stats';
const quiet = () => createLogger({ stream: new Writable({ write: (_c, _e, done) => done() }) });

test('an observation goes to the first bucket whose bound is at least its value', () => {
  assert.equal(HISTOGRAM_BOUNDS.length, 17);
  assert.equal(bucketField('run', 0), 'run_le_0.005');
  assert.equal(bucketField('run', 0.005), 'run_le_0.005');
  assert.equal(bucketField('run', 0.0051), 'run_le_0.01');
  assert.equal(bucketField('wait', 2.5), 'wait_le_2.5');
  assert.equal(bucketField('wait', 3600.001), 'wait_le_inf');
});

describe('worker statistics', { skip, concurrency: false }, () => {
  const { redis } = connect();

  test('the hash after a known workload has exactly the expected fields and values', async () => {
    const prefix = prefixFor();
    const qk = new KeySpace(prefix).queue(QUEUE);
    let flakyRuns = 0;
    const worker = new Worker(QUEUE, {
      'job.ok': () => sleep(260),
      'job.flaky': () => {
        flakyRuns += 1;
        if (flakyRuns === 1) throw new TransientError('first attempt fails');
      },
      'job.bad': () => { throw new Error('always fails'); },
      'job.once': () => 'done',
    }, { connection: server.url, prefix, leaseMs: 1500, blockMs: 100, promoterMaxIdleMs: 200, logger: quiet() });
    const producer = new Producer({ connection: server.url, prefix, logger: quiet() });
    try {
      await worker.waitUntilReady();
      const announced = JSON.parse(await redis.get(`${prefix}:worker:${worker.consumer}`));
      assert.equal(announced.heartbeat_ms, 500, 'the renewal period, lease_ms / 3');

      // Created two minutes ago: each wait lands in the bucket of 300 s.
      const created_at = Timestamp.fromEpochMs(Date.now() - 120_000).toString();
      await producer.publishMany(QUEUE, [{ task_type: 'job.ok', created_at }, { task_type: 'job.ok', created_at }]);
      await producer.publish(QUEUE, { task_type: 'job.flaky', headers: { [RETRY_POLICY_HEADER]: TIERED } });
      await producer.publish(QUEUE, { task_type: 'job.bad' });
      await producer.publish(QUEUE, { task_type: 'job.once', idempotency_key: 'k1' });
      await redis.xadd(qk.stream('normal'), '*', 'v', '1', 'enc', 'json', 'body', '{not json');
      const field = (name) => redis.hget(qk.stats, name);
      // Written by a liveness renewal, while the worker runs.
      await waitFor(async () => (await field('job.once node succeeded')) === '1', { message: 'job.once counted' });
      await producer.publish(QUEUE, { task_type: 'job.once', idempotency_key: 'k1' });
      await waitFor(async () => (await field('job.once node duplicate')) === '1', { message: 'the duplicate counted' });
      await waitFor(async () => (await field('job.ok node succeeded')) === '2' && (await field('- node dead')) === '1',
        { message: 'job.ok and the malformed entry counted' });
      assert.ok(await redis.pttl(qk.stats) > STATS_KEEP_MS - 60_000);
    } finally {
      await producer.close();
      await worker.close();
    }

    const hash = await redis.hgetall(qk.stats);
    const outcomes = {};
    const histograms = {};
    for (const [name, value] of Object.entries(hash)) {
      assert.match(value, /^\d+$/, name);
      const [taskType, language, what] = name.split(' ');
      assert.equal(language, 'node', name);
      if (/^(run|wait)_/.test(what)) (histograms[taskType] ??= {})[what] = Number(value);
      else outcomes[`${taskType} ${what}`] = Number(value);
    }
    assert.deepEqual(outcomes, {
      'job.ok succeeded': 2,
      'job.flaky failed': 1, 'job.flaky retried': 1, 'job.flaky succeeded': 1,
      'job.bad failed': 1, 'job.bad dead': 1,
      'job.once succeeded': 1, 'job.once duplicate': 1,
      '- dead': 1,
    });
    // Attempts that ran: two of job.ok, two of job.flaky, one of job.bad, one of job.once (not the duplicate).
    const ran = { 'job.ok': 2, 'job.flaky': 2, 'job.bad': 1, 'job.once': 1 };
    assert.deepEqual(Object.keys(histograms).sort(), Object.keys(ran).sort());
    for (const [taskType, buckets] of Object.entries(histograms)) {
      for (const name of ['run', 'wait']) {
        const count = HISTOGRAM_BOUNDS.reduce((sum, le) => sum + (buckets[`${name}_le_${le}`] ?? 0), 0);
        assert.equal(count, ran[taskType], `${taskType} ${name} observations`);
        assert.ok(Number.isSafeInteger(buckets[`${name}_sum_us`]), `${taskType} ${name}_sum_us`);
      }
      const names = Object.keys(buckets).filter((n) => !n.endsWith('_sum_us'));
      for (const n of names) assert.match(n, /^(run|wait)_le_(0\.005|0\.01|0\.025|0\.05|0\.1|0\.25|0\.5|1|2\.5|5|10|30|60|300|900|3600|inf)$/);
    }
    assert.equal(histograms['job.ok']['run_le_0.5'], 2, 'two runs of 260 ms');
    assert.ok(histograms['job.ok'].run_sum_us >= 520_000 && histograms['job.ok'].run_sum_us < 1_000_000, String(histograms['job.ok'].run_sum_us));
    assert.equal(histograms['job.ok'].wait_le_300, 2, 'two waits of about 120 s');
    assert.ok(histograms['job.ok'].wait_sum_us >= 240_000_000, String(histograms['job.ok'].wait_sum_us));
  });

  test('a write that fails keeps its counts for the next one', async () => {
    const prefix = prefixFor();
    const keys = new KeySpace(prefix);
    const stats = new TaskStatistics({ keys, language: 'node', log: quiet() });
    await redis.set(keys.queue(QUEUE).stats, 'not a hash'); // HINCRBY answers WRONGTYPE
    stats.count(QUEUE, 'job.ok', 'succeeded');
    stats.observe(QUEUE, 'job.ok', 'run', 0.02);
    await stats.flush(redis);
    stats.count(QUEUE, 'job.ok', 'succeeded');
    await redis.del(keys.queue(QUEUE).stats);
    await stats.close(redis);
    assert.deepEqual(await redis.hgetall(keys.queue(QUEUE).stats), {
      'job.ok node succeeded': '2', 'job.ok node run_le_0.025': '1', 'job.ok node run_sum_us': '20000',
    });
    await stats.flush(redis); // nothing left to add
    assert.equal(await redis.hget(keys.queue(QUEUE).stats, 'job.ok node succeeded'), '2');
  });

  test('the buffer holds a bounded number of task types between two writes', async () => {
    const prefix = prefixFor();
    const keys = new KeySpace(prefix);
    const stats = new TaskStatistics({ keys, language: 'node', log: quiet(), maxTaskTypes: 2 });
    for (const taskType of ['a', 'b', 'c', 'a']) stats.count(QUEUE, taskType, 'dead');
    await stats.flush(redis);
    assert.deepEqual(await redis.hgetall(keys.queue(QUEUE).stats), { 'a node dead': '2', 'b node dead': '1' });
    stats.count(QUEUE, 'c', 'dead'); // room again after the write
    await stats.flush(redis);
    assert.equal(await redis.hget(keys.queue(QUEUE).stats, 'c node dead'), '1');
  });
});
