// The replies of a node that is no longer a usable primary (docs/protocol.md
// section 5, "Failover"): they are outages, and the connection that got one
// finds the primary again instead of staying on that node. The Sentinel cases
// run against their own group (min-replicas-to-write 1): the old primary is
// kept from being demoted (its ACL refuses REPLICAOF), so that it stays a
// primary cut off from its replicas and answers NOREPLICAS, as one that resumes
// after a stall does.

import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import { setTimeout as sleep } from 'node:timers/promises';
import { after, before, describe, test } from 'node:test';
import { Producer, Worker, isRedisAway, reconnectOnFailover } from '../src/index.js';
import { roleConnection } from '../src/connection.js';
import { KeySpace } from '../src/keys.js';
import { logSink, onNode, quietLogger, startSentinelGroup, waitFor } from '../support/helpers.js';

const replyError = (message, extra = {}) => Object.assign(new Error(message), { name: 'ReplyError', ...extra });

describe('failover replies', () => {
  test('each reply of a node that is not a usable primary is an outage', () => {
    for (const message of ['READONLY You can\'t write against a read only replica.', 'NOREPLICAS Not enough good replicas to write.',
      'NOREPLICAS Not enough good replicas to write. script: ee5b, on @user_script:1.',
      'MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to \'no\'.',
      'LOADING Redis is loading the dataset in memory', 'TRYAGAIN Multiple keys request during rehashing of slot',
      'CLUSTERDOWN The cluster is down', 'UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)']) {
      assert.equal(isRedisAway(replyError(message)), true, message);
    }
    // A MULTI that Redis discarded because a queued command was refused by such a node.
    const aborted = (why) => replyError('EXECABORT Transaction discarded because of previous errors.', { previousErrors: [replyError(why)] });
    assert.equal(isRedisAway(aborted('NOREPLICAS Not enough good replicas to write.')), true);
    assert.equal(isRedisAway(aborted('READONLY You can\'t write against a read only replica.')), true);
    assert.equal(isRedisAway(aborted('ERR unknown command')), false);
    assert.equal(isRedisAway(replyError('WRONGTYPE Operation against a key holding the wrong kind of value')), false);
  });

  test('a connection leaves a node that stopped being a usable primary, and no other', () => {
    for (const message of ['READONLY x', 'NOREPLICAS Not enough good replicas to write.', 'MASTERDOWN x', 'LOADING x',
      'UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)']) {
      assert.equal(reconnectOnFailover(replyError(message)), 1, message);
    }
    for (const message of ['UNBLOCKED the stream key no longer exists', 'ERR syntax error', 'NOSCRIPT No matching script', 'MOVED 1 127.0.0.1:7000']) {
      assert.equal(reconnectOnFailover(replyError(message)), false, message);
    }
  });

  test('a Cluster connection refreshes its slot map on such a reply', () => {
    let refreshed = 0;
    let built = null;
    const fakeCluster = {
      isCluster: true,
      options: { redisOptions: {} },
      defineCommand() {},
      duplicate(_nodes, options) {
        built = { isCluster: true, options, refreshSlotsCache: () => { refreshed += 1; } };
        return built;
      },
    };
    const duplicate = roleConnection(fakeCluster, 'envelope-node-cmd');
    assert.equal(duplicate, built);
    const handler = built.options.redisOptions.reconnectOnError;
    assert.equal(handler(replyError('NOREPLICAS Not enough good replicas to write.')), 1);
    assert.equal(refreshed, 1);
    assert.equal(handler(replyError('ERR syntax error')), false);
    assert.equal(refreshed, 1);
  });
  test('creating a consumer group that exists is no error, also when a Cluster redirected it too often', async () => {
    const replies = ['Too many Cluster redirections. Last error: ReplyError: BUSYGROUP Consumer Group name already exists',
      'BUSYGROUP Consumer Group name already exists'];
    let calls = 0;
    const worker = Object.assign(Object.create(Worker.prototype), {
      queueOfStream: new Map([['s:high', 'q'], ['s:normal', 'q']]), opts: { group: 'workers', outageToleranceMs: 5000 },
      log: quietLogger(),
      cmd: { xgroup: async () => { calls += 1; throw replyError(replies[calls === 1 ? 0 : 1]); } },
    });
    await worker.ensureGroups();
    assert.equal(calls, 3, 'the redirected try was repeated, then each stream answered BUSYGROUP');
    worker.cmd = { xgroup: async () => { throw replyError('WRONGTYPE Operation against a key holding the wrong kind of value'); } };
    await assert.rejects(worker.ensureGroups(), /WRONGTYPE/);
  });
});

describe('Sentinel: a primary cut off from its replicas (NOREPLICAS)', { concurrency: false }, () => {
  let group;

  before(async () => {
    group = await startSentinelGroup();
    for (const node of group.nodes) {
      await onNode(node.port, (c) => c.call('CONFIG', 'SET', 'min-replicas-to-write', '1', 'min-replicas-max-lag', '2'));
    }
  });

  after(async () => {
    await group?.close();
  });

  /**
   * A worker (leaseMs 1500, waitReplicas 1) and a producer on the group, a
   * handler that holds the task 'held' until release(), the old primary made
   * unable to be demoted, and failover(): the sentinels promote a replica. Each case ends with the
   * old primary's ACL restored and every replica following the new primary.
   */
  async function withWorker(t, body) {
    const prefix = `nr-${crypto.randomBytes(4).toString('hex')}`;
    const { lines, logger } = logSink('info');
    const runs = [];
    let release;
    const gate = new Promise((resolve) => { release = resolve; });
    const worker = new Worker('nr.q', {
      'nr.hold': async (payload) => { runs.push(payload.id); if (payload.id === 'held') await gate; },
    }, { connection: group.url, prefix, logger, leaseMs: 1500, blockMs: 200, promoterMaxIdleMs: 200, waitReplicas: 1, waitTimeoutMs: 200 });
    const producer = new Producer({ connection: group.url, prefix, logger });
    const old = await group.primaryPort();
    const failover = async () => {
      await waitFor(() => onNode(group.sentinels[0], (c) => c.call('SENTINEL', 'FAILOVER', group.masterName)).then(() => true, (err) => {
        if (/^INPROG|^NOGOODSLAVE/.test(err.message)) return false;
        throw err;
      }), { timeoutMs: 20_000, intervalMs: 200, message: 'the sentinels kept a failover in progress' });
      await waitFor(async () => (await group.primaryPort()) !== old, { timeoutMs: 20_000, intervalMs: 100, message: 'no failover' });
      return group.primaryPort();
    };
    const refusesWrites = () => waitFor(() => onNode(old, (c) => c.set(`${prefix}:probe`, '1')).then(() => false, (err) => /^NOREPLICAS/.test(err.message)),
      { timeoutMs: 10_000, intervalMs: 100, message: 'the old primary did not refuse writes' });
    try {
      await worker.waitUntilReady();
      await onNode(old, (c) => c.call('ACL', 'SETUSER', 'default', '-replicaof', '-slaveof'));
      await body({ prefix, keys: new KeySpace(prefix), lines, runs, release, worker, producer, old, failover, refusesWrites });
    } finally {
      release();
      await producer.close();
      await worker.close({ graceMs: 0 });
      const oldNode = group.nodes.find((n) => n.port === old);
      oldNode.child.kill('SIGCONT');
      await onNode(old, (c) => c.call('ACL', 'SETUSER', 'default', '+@all')).catch(() => {});
      const primary = await group.primaryPort();
      await waitFor(() => onNode(primary, async (c) => {
        const info = String(await c.info('replication'));
        return (info.match(/state=online/g) ?? []).length === 2;
      }), { timeoutMs: 20_000, intervalMs: 100, message: 'the replicas did not follow the new primary' });
    }
  }

  /** The entry of `stream` is settled on the node on `port`: neither pending nor left in the stream. */
  const settledOn = (port, stream, lines) => waitFor(async () => Number((await onNode(port, (c) => c.xpending(stream, 'workers')))[0]) === 0
    && (await onNode(port, (c) => c.xlen(stream))) === 0,
  { timeoutMs: 10_000, intervalMs: 100, message: () => `the entry was not settled on the new primary: ${JSON.stringify(lines.filter((l) => l.level !== 'info').slice(0, 3))}` });

  test('a worker finds the new primary to settle, renew and read: the task runs once', (t) => withWorker(t, async ({
    keys, lines, runs, release, worker, producer, failover, refusesWrites,
  }) => {
    await producer.publish('nr.q', { task_type: 'nr.hold', payload: { id: 'held' } });
    await waitFor(() => runs.includes('held'));
    const now = await failover();
    await refusesWrites();
    release();
    // The ack landed on the new primary, the worker reads there, and its liveness key lives there.
    await settledOn(now, keys.queue('nr.q').stream('normal'), lines);
    await producer.publish('nr.q', { task_type: 'nr.hold', payload: { id: 'after' } });
    await waitFor(() => runs.includes('after'), { timeoutMs: 10_000, message: 'the worker did not read on the new primary' });
    await sleep(1600); // more than a lease: only renewals keep the key
    assert.equal(await onNode(now, (c) => c.exists(keys.consumer(worker.consumer))), 1, 'the liveness key is renewed on the new primary');
    assert.deepEqual(runs, ['held', 'after'], 'each task ran once');
    assert.deepEqual(lines.filter((l) => l.level === 'error'), []);
    assert.equal(worker.running, true);
  }));

  test('a done marker taken by a stalled primary as it resumes is written again on the new one', (t) => withWorker(t, async ({
    keys, lines, runs, release, old, producer, failover,
  }) => {
    await producer.publish('nr.q', { task_type: 'nr.hold', payload: { id: 'held' }, idempotency_key: 'held' });
    await waitFor(() => runs.includes('held'));
    await sleep(300); // the claim reached the replicas
    const oldNode = group.nodes.find((n) => n.port === old);
    oldNode.child.kill('SIGSTOP');
    release(); // the done marker waits in the stalled primary's socket
    const now = await failover();
    // On resuming, the old primary runs what it was sent before it counts its replicas again:
    // it takes the done marker (no replica gets it), then refuses writes.
    oldNode.child.kill('SIGCONT');
    await settledOn(now, keys.queue('nr.q').stream('normal'), lines);
    const marker = keys.idempotency('nr.hold', 'held');
    await waitFor(async () => String(await onNode(now, (c) => c.get(marker))).startsWith('done '),
      { timeoutMs: 5000, intervalMs: 100, message: 'the new primary has no done marker' });
    assert.deepEqual(lines.filter((l) => l.level === 'error'), []);
  }));
});
