// Takeovers after an outage (docs/protocol.md sections 5 and 9), against real
// redis-servers started here: a renewal or a liveness check that waited for
// Redis never leads to taking over a live consumer's entry or claim.

import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, describe, test } from 'node:test';
import Redis from 'ioredis';
import { KeySpace } from '../src/keys.js';
import { Producer } from '../src/producer.js';
import { Worker } from '../src/worker.js';
import { logSink, startRedisServer, waitFor } from '../support/helpers.js';

const LEASE_MS = 1500;
const INTERVAL_MS = LEASE_MS / 3;
const QUEUE = 'drill';

describe('takeovers after an outage', { concurrency: false }, () => {
  test('a restart of Redis that outlasts the lease takes over nothing from a live worker', { timeout: 30_000 }, async () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'envelope-restart-'));
    // Every write on disk before it is answered: the pending entry survives SIGKILL.
    const args = ['--appendonly', 'yes', '--appendfsync', 'always', '--dir', dir];
    let server = await startRedisServer(null, args);
    const prefix = `t-${crypto.randomBytes(4).toString('hex')}`;
    const starts = [];
    let release;
    const released = new Promise((resolve) => { release = resolve; });
    const workers = [];
    const sinks = [];
    // Both clients keep their commands while Redis is away (BullMQ's setting); the
    // holder's reconnects less eagerly: after the restart its renewal lands a few
    // hundred ms (less than a renewal interval) after the other worker is back.
    for (const retryMs of [300, 50]) {
      const sink = logSink('info');
      const worker = new Worker(QUEUE, {
        'drill.block': async () => {
          starts.push(worker.consumer);
          await released;
        },
      }, {
        connection: { host: '127.0.0.1', port: server.port, retryStrategy: () => retryMs, maxRetriesPerRequest: null },
        prefix, leaseMs: LEASE_MS, blockMs: 200, promoter: false, logger: sink.logger, autorun: false,
      });
      workers.push(worker);
      sinks.push(sink);
    }
    const redis = new Redis(server.port, '127.0.0.1', { retryStrategy: () => 50 });
    redis.on('error', () => {});
    try {
      // The holder reads first; the other worker starts once the entry is running.
      await workers[0].start();
      await new Producer(redis, { prefix }).publish(QUEUE, { task_type: 'drill.block', payload: {} });
      await waitFor(() => starts.length === 1, { message: 'the holder started the task' });
      await workers[1].start();
      await sleep(2 * INTERVAL_MS); // the other worker's renewals count: it would take over a dead consumer now
      await server.stop('SIGKILL');
      await sleep(LEASE_MS + 1000); // every liveness key expires meanwhile (wall-clock)
      server = await startRedisServer(server.port, args);
      await sleep(LEASE_MS + INTERVAL_MS); // the other worker renews and looks at the holder's entry again
      release();
      await waitFor(() => workers[0].stats.succeeded === 1, { timeoutMs: 5000, message: 'the holder settled its task' });
      const qk = new KeySpace(prefix).queue(QUEUE);
      for (const stream of qk.taskStreams) assert.equal(Number((await redis.xpending(stream, 'workers'))[0]), 0);
      assert.deepEqual(starts, [workers[0].consumer], 'the handler ran once, on the holder');
      assert.equal(workers[1].stats.taken_over, 0);
      assert.ok(!sinks[1].lines.some((l) => l.msg === 'took over an entry of a dead consumer'));
    } finally {
      release();
      for (const worker of workers) await worker.stop({ graceMs: 0 }).catch(() => {});
      redis.disconnect();
      await server.stop('SIGKILL');
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  describe('an idempotency claim whose holder\'s liveness key is gone', () => {
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

    /**
     * A worker, two renewal intervals after its start (its renewals count), and
     * a task of key K whose claim is held by the consumer `ghost`, which has no
     * liveness key. `onLook(times)` runs at each EXISTS of ghost's key (MONITOR).
     */
    async function claimedByGhost(onLook) {
      const prefix = `t-${crypto.randomBytes(4).toString('hex')}`;
      const ks = new KeySpace(prefix);
      const ghostKey = ks.consumer('ghost');
      const idemKey = ks.idempotency('idem.effect', 'K');
      await redis.set(idemKey, 'running ghost task-0', 'PX', 60_000);
      const looks = [];
      const monitor = await redis.monitor();
      monitor.on('monitor', (time, args) => {
        if (String(args[0]).toLowerCase() !== 'exists' || args[1] !== ghostKey) return;
        looks.push(Number(time) * 1000);
        onLook(looks, ghostKey);
      });
      const ran = [];
      const sink = logSink('info');
      const worker = new Worker(QUEUE, { 'idem.effect': (payload) => { ran.push(payload); } }, {
        connection: { host: '127.0.0.1', port: server.port }, prefix, leaseMs: LEASE_MS, blockMs: 200,
        deferMs: 10_000, promoter: false, logger: sink.logger,
      });
      await worker.waitUntilReady();
      await sleep(2 * INTERVAL_MS + 100);
      await new Producer(redis, { prefix }).publish(QUEUE, { task_type: 'idem.effect', payload: {}, idempotency_key: 'K' });
      const close = async () => {
        await worker.stop({ graceMs: 0 });
        monitor.disconnect();
      };
      return { worker, ran, looks, lines: sink.lines, idemKey, close };
    }

    test('a holder that renews within one interval keeps its claim: the task is deferred', { timeout: 15_000 }, async () => {
      const t = await claimedByGhost((looks, ghostKey) => {
        if (looks.length === 1) redis.set(ghostKey, 'h 1 python', 'PX', 60_000); // the holder renews after the first look
      });
      try {
        await waitFor(() => t.worker.stats.deferred === 1, { timeoutMs: 5000, message: 'the task was deferred' });
        assert.equal(t.looks.length, 2);
        assert.deepEqual(t.ran, []);
        assert.equal(await redis.get(t.idemKey), 'running ghost task-0');
        assert.ok(!t.lines.some((l) => l.msg.includes('taking it over')));
      } finally {
        await t.close();
      }
    });

    test('a holder whose key stays gone loses its claim after a second look one interval later', { timeout: 15_000 }, async () => {
      const t = await claimedByGhost(() => {});
      try {
        await waitFor(() => t.ran.length === 1, { timeoutMs: 5000, message: 'the task ran' });
        assert.equal(t.looks.length, 2);
        assert.ok(t.looks[1] - t.looks[0] >= INTERVAL_MS - 20, `looks ${t.looks[1] - t.looks[0]} ms apart`);
        assert.equal(t.worker.stats.deferred, 0);
        assert.match(await redis.get(t.idemKey), /^done /);
        assert.ok(t.lines.some((l) => l.msg.includes('taking it over')));
      } finally {
        await t.close();
      }
    });
  });
});
