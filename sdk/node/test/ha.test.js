// High availability against real topologies started from redis-server: a Sentinel
// group (a primary, two replicas, three sentinels) and a Redis Cluster (three
// primaries with a replica each). On each: producer -> worker round trips of
// immediate and delayed tasks; on the Cluster, queues on different shards, a
// dead letter and a cancel; and a failover drill: the primary (or one Cluster
// primary) is SIGKILLed while a worker runs and a producer publishes idempotent
// tasks whose handler records its effect in a separate Redis (the ledger).

import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import { once } from 'node:events';
import { Writable } from 'node:stream';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, afterEach, before, describe, test } from 'node:test';
import Redis, { Cluster } from 'ioredis';
import { DeadLetters, KeySpace, Producer, Promoter, Worker, createLogger, createRedis } from '../src/index.js';
import { closeClient, disconnectClient } from '../src/connection.js';
import {
  clusterNodes, moveSlot, onNode, startCluster, startRedisServer, startSentinelGroup, waitFor,
} from '../support/helpers.js';

const FAST = { leaseMs: 3000, blockMs: 200, promoterMaxIdleMs: 200 };
const prefixFor = () => `ha-${crypto.randomBytes(4).toString('hex')}`;
const soon = (ms) => new Date(Date.now() + ms).toISOString();

/**
 * What a test opened (workers, producers, promoters, tools, clients), closed
 * after it even when it failed: a Sentinel or Cluster client left open
 * reconnects for ever to the servers stopped after the suite, and keeps the
 * test process alive after its last test.
 */
const opened = [];
const keep = (thing) => { opened.push(thing); return thing; };
async function closeOpened() {
  for (const thing of opened.splice(0).reverse()) {
    if (thing instanceof Worker) await thing.close({ graceMs: 0 });
    else if (thing instanceof Promoter) await thing.stop();
    else if (thing instanceof Producer || thing instanceof DeadLetters) await thing.close();
    else thing.disconnect();
  }
}

/** A logger that keeps its lines (JSON objects), for diagnostics. */
function sink() {
  const lines = [];
  const stream = new Writable({
    write(chunk, _enc, done) {
      for (const line of chunk.toString().split('\n')) if (line) lines.push(JSON.parse(line));
      done();
    },
  });
  return { lines, logger: createLogger({ stream, level: 'info' }) };
}

/** Start one worker per queue and wait until each reads its queue. */
async function startWorkers(queues, handlers, options) {
  const workers = queues.map((queue) => keep(new Worker(queue, handlers, { ...FAST, ...options })));
  await Promise.all(workers.map((w) => w.waitUntilReady()));
  return workers;
}

/** Publish an immediate and a delayed task to each queue and wait until every one ran. */
async function roundTrip(producerConnection, workerConnection, queues) {
  const prefix = prefixFor();
  const ran = [];
  const { logger } = sink();
  const workers = await startWorkers(queues, { 'ha.echo': (payload) => { ran.push(payload.id); } },
    { connection: workerConnection, prefix, logger });
  const producer = keep(new Producer({ connection: producerConnection, prefix }));
  const expected = [];
  for (const queue of queues) {
    for (const delayed of [false, true]) {
      const id = `${queue}-${delayed ? 'delayed' : 'now'}`;
      const result = await producer.publish(queue, {
        task_type: 'ha.echo', payload: { id }, ...(delayed ? { schedule_time: soon(300) } : {}),
      });
      assert.equal(result.delayed, delayed);
      expected.push(id);
    }
  }
  await waitFor(() => ran.length >= expected.length, { message: () => `ran ${JSON.stringify(ran)}` });
  assert.deepEqual([...ran].sort(), [...expected].sort());
  await producer.close();
  for (const w of workers) await w.close({ graceMs: 0 });
  return prefix;
}

/**
 * The failover drill: workers on `queues` (through `connection`), four
 * publishers of idempotent tasks (one in three delayed by 400 ms), `kill()` after
 * 800 ms, `failedOver()` awaited, the old primary started again as a replica
 * (`rejoin()`), publishing for another 300 ms; then the ledger is read until
 * every task whose publish returned has its effect, or no new effect came for
 * 3 s (what is missing then is lost). Returns the counts.
 */
async function drill(t, { name, connection, queues, waitReplicas, ledger, kill, failedOver, rejoin }) {
  const prefix = prefixFor();
  const { lines, logger } = sink();
  const handlers = {
    'ha.effect': async (payload) => { await ledger.incr(`${prefix}:effect:${payload.n}`); },
  };
  const workers = await startWorkers(queues, handlers, { connection, prefix, logger, waitReplicas, waitTimeoutMs: 200, concurrency: 4 });
  const errors = [];
  for (const w of workers) w.on('error', (err) => errors.push(err));
  const producer = keep(new Producer({ connection, prefix, logger, waitReplicas, waitTimeoutMs: 200 }));
  const published = [];
  const publishFailed = [];
  let publishing = true;
  let next = 0;
  const publisher = async () => {
    while (publishing) {
      const i = next;
      next += 1;
      const n = `${name}-${i}`;
      try {
        await producer.publish(queues[i % queues.length], {
          task_type: 'ha.effect', payload: { n }, idempotency_key: n, ...(i % 3 === 0 ? { schedule_time: soon(400) } : {}),
        });
        published.push(n);
      } catch (err) {
        publishFailed.push(err.message); // not acknowledged: not counted as lost
      }
      await sleep(20);
    }
  };
  const publishers = Array.from({ length: 4 }, publisher);
  await sleep(800);
  const killedAt = Date.now();
  // A write whose WAIT fell short before the kill may be lost with the primary (protocol
  // section 5: the write stands, logged): only those may go missing or run twice.
  const shortBeforeKill = lines.filter((l) => l.msg.startsWith('fewer replicas than asked')).length;
  await kill();
  await failedOver();
  const failoverMs = Date.now() - killedAt;
  await rejoin();
  await sleep(300);
  publishing = false;
  await Promise.all(publishers);

  const keys = published.map((n) => `${prefix}:effect:${n}`);
  const counts = async () => (await ledger.mget(...keys)).map((v) => Number(v ?? 0));
  let effects = await counts();
  for (let seen = -1, changedAt = Date.now(); Date.now() - changedAt < 3000 && effects.some((c) => c === 0);) {
    const done = effects.filter((c) => c > 0).length;
    if (done !== seen) [seen, changedAt] = [done, Date.now()];
    await sleep(100);
    effects = await counts();
  }
  const lost = effects.filter((c) => c === 0).length;
  const twice = effects.filter((c) => c > 1).length;
  const tally = (level) => {
    const counts = {};
    for (const l of lines.filter((x) => x.level === level)) counts[l.msg] = (counts[l.msg] ?? 0) + 1;
    return JSON.stringify(counts);
  };
  t.diagnostic(`${name}: failover took ${failoverMs} ms; ${published.length} publishes acknowledged, ${publishFailed.length} failed ${JSON.stringify([...new Set(publishFailed)])}; `
    + `lost (acknowledged, no effect): ${lost}; effect more than once: ${twice}; waitReplicas ${waitReplicas}; `
    + `warnings logged ${tally('warn')}; errors logged ${tally('error')}`);

  // No worker stopped: each is running and still consumes its queue.
  assert.deepEqual(errors, []);
  for (const w of workers) assert.equal(w.running, true);
  const probes = await Promise.all(workers.map(async (w, i) => {
    const completed = once(w, 'completed');
    await producer.publish(queues[i], { task_type: 'ha.effect', payload: { n: `${name}-probe-${i}` } });
    return completed;
  }));
  assert.equal(probes.length, queues.length);
  await producer.close();
  for (const w of workers) await w.close({ graceMs: 1000 });
  assert.ok(published.length > 20, `only ${published.length} publishes were acknowledged`);
  const excused = waitReplicas ? shortBeforeKill : 0;
  assert.ok(twice <= excused, `an idempotent task had its effect more than once: ${twice}, `
    + `${excused} WAITs fell short before the kill`);
  if (waitReplicas) {
    assert.ok(lost <= excused, `with WAIT, acknowledged publishes were lost: ${lost}, `
      + `${excused} WAITs fell short before the kill`);
  }
  return { lost, twice, published: published.length };
}

describe('Sentinel', { concurrency: false }, () => {
  let group;
  let ledgerServer;
  let ledger;

  before(async () => {
    [group, ledgerServer] = await Promise.all([startSentinelGroup(), startRedisServer()]);
    ledger = new Redis(ledgerServer.url);
  });

  afterEach(closeOpened);

  after(async () => {
    ledger?.disconnect();
    await ledgerServer?.close();
    await group?.close();
  });

  test('round trips through a redis-sentinel:// URL and an ioredis Sentinel client, with data and sentinel passwords', async () => {
    await roundTrip(group.url, group.url, ['ha.sentinel']);
    const client = keep(new Redis({
      sentinels: group.sentinels.map((port) => ({ host: '127.0.0.1', port })), name: group.masterName,
      password: group.password, sentinelPassword: group.sentinelPassword,
    }));
    client.on('error', () => {});
    const prefix = await roundTrip(client, client, ['ha.sentinel']);
    assert.equal(await client.sismember(new KeySpace(prefix).queues, 'ha.sentinel'), 1, 'the delayed publish registered its queue');
    client.disconnect();
  });

  /** SIGKILL the primary the sentinels announce; resolve once they announce another. */
  const failover = () => {
    let old;
    return {
      kill: async () => {
        old = await group.primaryPort();
        await group.nodes.find((n) => n.port === old).stop('SIGKILL');
      },
      failedOver: () => waitFor(async () => (await group.primaryPort()) !== old,
        { timeoutMs: 20_000, intervalMs: 100, message: 'no failover' }),
      rejoin: () => group.rejoin(old),
    };
  };

  test('failover drill without WAIT: lost publishes are counted', async (t) => {
    await drill(t, { name: 'sentinel-nowait', connection: group.url, queues: ['ha.drill'], waitReplicas: 0, ledger, ...failover() });
  });

  test('failover drill with WAIT 2 (every replica): nothing acknowledged is lost', async (t) => {
    // WAIT for both replicas: the sentinels promote the replica whose offset they last saw
    // highest, which may lag the one that answered a WAIT 1 (docs/protocol.md section 5).
    // Both replicas follow the primary of the first failover before the second.
    await waitFor(async () => onNode(await group.primaryPort(), async (c) => {
      const info = String(await c.info('replication'));
      return /connected_slaves:2/.test(info) && (info.match(/state=online/g) ?? []).length === 2;
    }), { timeoutMs: 20_000, intervalMs: 100, message: 'the replicas did not follow the new primary' });
    await drill(t, { name: 'sentinel-wait', connection: group.url, queues: ['ha.drill'], waitReplicas: 2, ledger, ...failover() });
  });

  test('a manual failover (the primary becomes a replica: UNBLOCKED, READONLY) does not stop a worker', async () => {
    const prefix = prefixFor();
    const ran = [];
    const { lines, logger } = sink();
    // A long block, so that the read waits on the old primary when it changes role.
    const [worker] = await startWorkers(['ha.manual'], { 'ha.echo': (payload) => { ran.push(payload.id); } },
      { connection: group.url, prefix, logger, blockMs: 5000 });
    const producer = keep(new Producer({ connection: group.url, prefix, logger }));
    await producer.publish('ha.manual', { task_type: 'ha.echo', payload: { id: 'before' } });
    await waitFor(() => ran.includes('before'));
    await sleep(200); // the reader blocks again
    const old = await group.primaryPort();
    // The sentinels refuse while they still finish the drills' failovers (INPROG), and until
    // their next look at the replicas (every 10 s) finds one in sync (NOGOODSLAVE).
    await waitFor(() => onNode(group.sentinels[0], (c) => c.call('SENTINEL', 'FAILOVER', group.masterName)).then(() => true, (err) => {
      if (/^(INPROG|NOGOODSLAVE)/.test(err.message)) return false;
      throw err;
    }), { timeoutMs: 20_000, intervalMs: 200, message: 'the sentinels kept a failover in progress' });
    await waitFor(async () => (await group.primaryPort()) !== old, { timeoutMs: 20_000, intervalMs: 100, message: 'no manual failover' });
    // Sentinel demotes the old primary after its next periodic check (seconds later): do it now, as it would.
    const now = await group.primaryPort();
    await onNode(old, (c) => c.call('REPLICAOF', '127.0.0.1', String(now)));
    const ids = ['now-1', 'now-2', 'delayed'];
    for (const id of ids) {
      await producer.publish('ha.manual', { task_type: 'ha.echo', payload: { id }, ...(id === 'delayed' ? { schedule_time: soon(300) } : {}) });
    }
    await waitFor(() => ids.every((id) => ran.includes(id)), { timeoutMs: 20_000, message: () => JSON.stringify(ran) });
    assert.equal(worker.running, true);
    assert.deepEqual(lines.filter((l) => l.level === 'error'), []);
    // The worker's connections left the demoted node for the new primary.
    const names = String(await onNode(now, (c) => c.call('CLIENT', 'LIST')));
    for (const role of ['cmd', 'reader']) assert.match(names, new RegExp(`name=envelope-node-${role} `));
    await producer.close();
    await worker.close({ graceMs: 1000 });
  });
});

describe('Cluster', { concurrency: false }, () => {
  let cluster;
  let ledgerServer;
  let ledger;
  let client;
  const shardQueues = new Map(); // primary port -> a queue whose slot it serves

  /** The hash slot of `{queue}` and the port of the primary serving it. */
  const placeOf = async (queue) => {
    const slot = Number(await onNode(cluster.ports[0], (c) => c.call('CLUSTER', 'KEYSLOT', `{${queue}}`)));
    const primaries = (await clusterNodes(cluster.ports[0])).filter((n) => n.flags.includes('master'));
    const owner = primaries.find((p) => p.slots.some((range) => {
      const [lo, hi = lo] = range.split('-').map(Number);
      return slot >= lo && slot <= hi;
    }));
    return { slot, port: owner.port };
  };

  before(async () => {
    [cluster, ledgerServer] = await Promise.all([startCluster(), startRedisServer()]);
    ledger = new Redis(ledgerServer.url);
    client = createRedis(cluster.url);
    client.on('error', () => {}); // the drills kill nodes: ioredis reconnects
    for (let i = 0; shardQueues.size < 3 && i < 1000; i += 1) {
      const queue = `ha.q${i}`;
      const { port } = await placeOf(queue);
      if (!shardQueues.has(port)) shardQueues.set(port, queue);
    }
    assert.equal(shardQueues.size, 3, 'one queue per shard');
  });

  afterEach(closeOpened);

  after(async () => {
    client?.disconnect();
    ledger?.disconnect();
    await ledgerServer?.close();
    await cluster?.close();
  });

  const queuesOn = () => [...shardQueues.values()];

  test('round trips on queues of two shards, through a redis-cluster:// URL and an ioredis Cluster', async () => {
    const given = keep(new Cluster(cluster.ports.slice(0, 1).map((port) => ({ host: '127.0.0.1', port }))));
    given.on('error', () => {});
    const prefix = await roundTrip(given, cluster.url, queuesOn().slice(0, 2));
    assert.deepEqual((await client.smembers(new KeySpace(prefix).queues)).sort(), queuesOn().slice(0, 2).sort());
    given.disconnect();
  });

  test('one worker reads queues of two shards, each with its own blocking wait, and dead-letters in each entry\'s queue', async () => {
    const prefix = prefixFor();
    const queues = queuesOn().slice(0, 2);
    const ran = [];
    const worker = keep(new Worker(queues, { 'ha.echo': (payload) => { ran.push(payload.id); } },
      { ...FAST, connection: cluster.url, prefix, blockMs: 5000, logger: sink().logger }));
    await worker.waitUntilReady();
    await sleep(300); // both waits are blocked, for seconds more
    const producer = keep(new Producer({ connection: cluster.url, prefix }));
    for (const queue of [...queues].reverse()) {
      await producer.publish(queue, { task_type: 'ha.echo', payload: { id: queue } });
      await waitFor(() => ran.includes(queue), { timeoutMs: 1000, message: `a task of ${queue} woke the worker` });
    }
    await producer.publish(queues[1], { task_type: 'ha.unknown', payload: {} });
    const keys = new KeySpace(prefix);
    await waitFor(async () => (await client.xlen(keys.queue(queues[1]).dead)) === 1, { message: 'dead-lettered in its queue' });
    assert.equal(await client.xlen(keys.queue(queues[0]).dead), 0);
    assert.deepEqual(await client.smembers(keys.deadQueues), [queues[1]]);
  });

  test('a Cluster client closed while it connects ends and fails the commands it queued', async () => {
    const settled = (promise) => Promise.race([
      promise.then(() => 'resolved', (err) => `rejected: ${err.message}`), sleep(5000).then(() => 'still pending after 5 s')]);
    // The worker's reading connection, disconnected at shutdown while it (re)connects.
    const reader = keep(createRedis(cluster.url));
    reader.on('error', () => {});
    const read = reader.xread('BLOCK', 200, 'STREAMS', 'ha.closing', '$');
    disconnectClient(reader);
    assert.match(await settled(read), /^rejected: Connection is closed/);
    assert.equal(reader.status, 'end');
    // A producer's, promoter's or worker's other connections, closed with QUIT while they (re)connect.
    const other = keep(createRedis(cluster.url));
    other.on('error', () => {});
    const queued = other.get('ha.closing');
    await closeClient(other);
    assert.match(await settled(queued), /^rejected: Connection is closed/);
    assert.equal(other.status, 'end');
  });

  test('a standalone promoter from a redis-cluster:// URL promotes the delayed tasks of every shard', async () => {
    const prefix = prefixFor();
    const queues = queuesOn();
    const producer = keep(new Producer({ connection: client, prefix }));
    for (const queue of queues) await producer.publish(queue, { task_type: 'ha.echo', payload: {}, schedule_time: soon(200) });
    const promoter = keep(new Promoter({ connection: cluster.url, prefix, maxIdleMs: 100, log: sink().logger }));
    await promoter.start();
    const keys = new KeySpace(prefix);
    await waitFor(async () => {
      const lengths = await Promise.all(queues.map((q) => client.xlen(keys.queue(q).stream('normal'))));
      return lengths.every((n) => n === 1);
    }, { message: 'not every shard\'s delayed task was promoted' });
    await promoter.stop();
    await producer.close();
  });

  test('a dead letter and a cancel on a Cluster', async () => {
    const prefix = prefixFor();
    const [deadQueue, cancelQueue] = queuesOn();
    const { logger } = sink();
    const ran = [];
    const workers = await startWorkers([deadQueue, cancelQueue], { 'ha.echo': (payload) => { ran.push(payload.id); } },
      { connection: cluster.url, prefix, logger });
    const producer = keep(new Producer({ connection: client, prefix }));
    const dead = once(workers[0], 'dead');
    await producer.publish(deadQueue, { task_type: 'ha.unknown', payload: {} });
    const [, failure] = await dead;
    assert.equal(failure.failure_class, 'unknown_task_type');
    const tools = keep(new DeadLetters({ connection: cluster.url, prefix }));
    assert.deepEqual(await tools.queues(), [deadQueue]);
    const [entry] = await tools.list(deadQueue);
    assert.equal(entry.taskType, 'ha.unknown');
    await tools.close();

    const delayed = await producer.publish(cancelQueue, { task_type: 'ha.echo', payload: { id: 'delayed' }, schedule_time: soon(60_000) });
    assert.deepEqual(await producer.cancel(delayed.taskId), { outcome: 'removed', queue: cancelQueue });
    assert.equal(await client.zscore(new KeySpace(prefix).queue(cancelQueue).delayed, delayed.taskId), null);
    const taskId = crypto.randomUUID();
    assert.deepEqual(await producer.cancel(taskId), { outcome: 'marked', queue: null });
    await producer.publish(cancelQueue, { task_id: taskId, task_type: 'ha.echo', payload: { id: 'cancelled' } });
    await producer.publish(cancelQueue, { task_type: 'ha.echo', payload: { id: 'after' } });
    await waitFor(() => ran.includes('after'));
    assert.deepEqual(ran, ['after']);
    assert.equal(workers[1].stats.cancelled, 1);
    await producer.close();
    for (const w of workers) await w.close({ graceMs: 0 });
  });

  test('a worker keeps consuming while its queue\'s slot moves to another shard', async () => {
    const prefix = prefixFor();
    const queue = 'ha.moving';
    const from = await placeOf(queue);
    const to = [...shardQueues.keys()].find((port) => port !== from.port);
    const { lines, logger } = sink();
    const [worker] = await startWorkers([queue], {
      'ha.effect': async (payload) => { await ledger.incr(`${prefix}:effect:${payload.n}`); },
    }, { connection: cluster.url, prefix, logger, concurrency: 4 });
    const producer = keep(new Producer({ connection: cluster.url, prefix, logger }));
    const published = [];
    let publishing = true;
    const publisher = async (p) => {
      for (let i = 0; publishing; i += 1) {
        const n = `${p}-${i}`;
        await producer.publish(queue, {
          task_type: 'ha.effect', payload: { n }, idempotency_key: n, ...(i % 3 === 0 ? { schedule_time: soon(300) } : {}),
        });
        published.push(n);
        await sleep(10);
      }
    };
    const publishers = [0, 1, 2].map(publisher);
    await sleep(300);
    await moveSlot(from.port, to, from.slot);
    assert.equal((await placeOf(queue)).port, to, 'the slot moved');
    await sleep(500);
    publishing = false;
    await Promise.all(publishers);
    const keys = published.map((n) => `${prefix}:effect:${n}`);
    await waitFor(async () => (await ledger.mget(...keys)).every((v) => v !== null), {
      timeoutMs: 15_000, message: () => JSON.stringify(lines.filter((l) => l.level !== 'info').slice(0, 5)),
    });
    assert.deepEqual((await ledger.mget(...keys)).filter((v) => v !== '1'), [], 'each task had its effect once');
    assert.ok(published.length > 20, `only ${published.length} publishes`);
    assert.equal(worker.running, true);
    assert.deepEqual(lines.filter((l) => l.level === 'error'), []);
    await producer.close();
    await worker.close({ graceMs: 1000 });
  });

  /** SIGKILL a primary; resolve once the others mark it failed and every live node is ok again (its replica serves its slots). */
  const failover = (primaryPort) => ({
    kill: () => cluster.byPort(primaryPort).stop('SIGKILL'),
    rejoin: () => cluster.rejoin(primaryPort),
    failedOver: () => waitFor(async () => {
      const alive = cluster.nodes.filter((n) => n.port !== primaryPort && n.child.exitCode === null && n.child.signalCode === null);
      const view = await clusterNodes(alive[0].port);
      if (!view.find((n) => n.port === primaryPort).flags.includes('fail')) return false;
      for (const node of alive) {
        if (!String(await onNode(node.port, (c) => c.call('CLUSTER', 'INFO'))).includes('cluster_state:ok')) return false;
      }
      return true;
    }, { timeoutMs: 20_000, intervalMs: 100, message: 'no Cluster failover' }),
  });

  test('failover drill without WAIT: lost publishes are counted', async (t) => {
    const [primary] = shardQueues.keys();
    const queues = [shardQueues.get(primary), queuesOn()[1]];
    await drill(t, { name: 'cluster-nowait', connection: cluster.url, queues, waitReplicas: 0, ledger, ...failover(primary) });
  });

  test('failover drill with WAIT 1 on another shard: nothing acknowledged is lost', async (t) => {
    const primary = [...shardQueues.keys()][1];
    const queues = [shardQueues.get(primary), queuesOn()[2]];
    await drill(t, { name: 'cluster-wait', connection: cluster.url, queues, waitReplicas: 1, ledger, ...failover(primary) });
  });
});
