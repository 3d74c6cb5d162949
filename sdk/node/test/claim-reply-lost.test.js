// An idempotency claim that landed but whose reply was lost (docs/protocol.md
// section 9): the worker releases it with its holder before handing the task
// back, so the next attempt, on another live consumer, is not deferred until
// the claim expires. A TCP proxy between one worker and a real redis-server
// forwards the first idem_begin.lua call and drops its reply with the
// connection; it drops the later ones unsent, so that worker's claims keep failing.

import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import fs from 'node:fs';
import net from 'node:net';
import { describe, test } from 'node:test';
import { KeySpace } from '../src/keys.js';
import { Producer } from '../src/producer.js';
import { parseRedisUrl } from '../src/url.js';
import { Worker } from '../src/worker.js';
import { registerBuiltinHandlers } from '../support/handlers.js';
import { logSink, redisSuite, waitFor } from '../support/helpers.js';

const { server, skip, prefixFor, connect } = await redisSuite('lost');
const QUEUE = 'jobs';
const IDEM_BEGIN = fs.readFileSync(new URL('../lua/idem_begin.lua', import.meta.url), 'utf8');
// How the request names idem_begin.lua: EVALSHA with its SHA-1, or EVAL with its text.
const MARKS = [crypto.createHash('sha1').update(IDEM_BEGIN).digest('hex'), IDEM_BEGIN.split('\n', 1)[0]];

/**
 * A proxy on a free loopback port to `target` ({ host, port }). The connection
 * that sends the first idem_begin.lua call has that call forwarded, its reply
 * dropped and is closed; a later one is closed before the call is forwarded.
 * `lost()` lists the replies dropped (as text). Returns { port, lost(), close() }.
 */
async function claimReplyDropper(target) {
  const sockets = new Set();
  const lost = [];
  const proxy = net.createServer((client) => {
    const upstream = net.connect(target.port, target.host);
    for (const s of [client, upstream]) {
      sockets.add(s);
      s.on('error', () => {});
      s.on('close', () => { client.destroy(); upstream.destroy(); sockets.delete(s); });
    }
    let dropReply = false;
    client.on('data', (chunk) => {
      const text = chunk.toString('latin1');
      if (!MARKS.some((mark) => text.includes(mark))) return void upstream.write(chunk);
      if (dropReply || lost.length) return void client.destroy();
      dropReply = true;
      upstream.write(chunk);
    });
    upstream.on('data', (chunk) => {
      if (!dropReply) return void client.write(chunk);
      // The claim has run (Redis answered): its reply, and any before it, are lost.
      lost.push(chunk.toString('latin1'));
      client.destroy();
    });
  });
  await new Promise((resolve) => proxy.listen(0, '127.0.0.1', resolve));
  return {
    port: proxy.address().port,
    lost: () => [...lost],
    close: async () => {
      for (const s of sockets) s.destroy();
      await new Promise((resolve) => proxy.close(resolve));
    },
  };
}

describe('an idempotency claim whose reply was lost', { skip, concurrency: false }, () => {
  const { redis, workers } = connect();

  test('is released when the task is handed back; the task then runs once on another consumer', async () => {
    const prefix = prefixFor();
    const ks = new KeySpace(prefix);
    const direct = parseRedisUrl(server.url);
    const dropper = await claimReplyDropper({ host: direct.host, port: direct.port });
    await redis.script('LOAD', IDEM_BEGIN); // EVALSHA runs it (no NOSCRIPT reply to lose instead)
    try {
      const start = async (consumer, connection, options = {}) => {
        const sink = logSink();
        const worker = new Worker({
          redis: connection, prefix, queue: QUEUE, consumer, leaseMs: 1500, blockMs: 100, deferMs: 150,
          promoterMaxIdleMs: 200, logger: sink.logger, ...options,
        });
        registerBuiltinHandlers(worker);
        workers.push(worker);
        await worker.start();
        return { worker, lines: sink.lines };
      };
      // No resend by ioredis after the lost reply: the call fails, and the worker retries it for 300 ms.
      const a = await start('node-a', { ...direct, port: dropper.port, maxRetriesPerRequest: 0, retryStrategy: () => 20 },
        { outageToleranceMs: 300 });
      const { taskId } = await new Producer(redis, { prefix }).publish(QUEUE, {
        task_type: 'order.close_timeout', payload: { order_id: 'R1' }, idempotency_key: 'lost-1',
      });
      await waitFor(() => a.worker.stats.deferred >= 1, { timeoutMs: 5000, message: 'the task was not handed back' });
      assert.equal(dropper.lost().length, 1);
      assert.match(dropper.lost()[0], /\$8\r\nacquired\r\n/, 'the claim was acquired, its reply lost');
      const idemKey = ks.idempotency('order.close_timeout', 'lost-1');
      assert.equal(await redis.get(idemKey), null, 'the claim was released with the hand-back');
      assert.ok(a.lines.some((l) => l.msg === 'the idempotency claim failed; deferred'));
      assert.ok(!a.lines.some((l) => /taken over/.test(l.msg)), 'a release of a claim that may not have landed is no takeover');
      assert.equal(a.worker.stats.retried, 0, 'handed back, not failed');
      assert.equal(await redis.get(`${prefix}:effects:order.close_timeout:R1`), null, 'not run');
      // A second consumer, straight to Redis, while node-a lives on and still cannot claim.
      const b = await start('node-b', server.url);
      await waitFor(() => b.worker.stats.succeeded === 1, { timeoutMs: 5000, message: 'node-b did not run the task' });
      assert.match(await redis.get(idemKey), new RegExp(`^done ${taskId} `));
      assert.equal(await redis.get(`${prefix}:effects:order.close_timeout:R1`), '1', 'its effect once');
      assert.equal(a.worker.stats.succeeded, 0);
      assert.equal(await redis.xlen(ks.queue(QUEUE).dead), 0, 'nothing dead-lettered');
    } finally {
      for (const w of workers.splice(0)) await w.stop({ graceMs: 0 }).catch(() => {});
      await dropper.close();
    }
  });
});
