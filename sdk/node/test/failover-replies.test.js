// The replies of a node that is no longer a usable primary (docs/protocol.md
// section 5, "Failover"): they are outages, and the connection that got one
// finds the primary again instead of staying on that node. The Sentinel case
// runs against its own group: the old primary is kept from being demoted, so
// that it stays a primary cut off from its replicas and answers NOREPLICAS
// (min-replicas-to-write), as one that resumes after a stall does.

import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import { Writable } from 'node:stream';
import { after, before, describe, test } from 'node:test';
import { Producer, Worker, createLogger, isRedisAway } from '../src/index.js';
import { reconnectOnFailover, roleConnection } from '../src/connection.js';
import { KeySpace } from '../src/keys.js';
import { onNode, startSentinelGroup, waitFor } from '../support/helpers.js';

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
});

describe('Sentinel: a primary cut off from its replicas (NOREPLICAS)', () => {
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

  test('a worker finds the new primary to settle, renew and read: the task runs once', async () => {
    const prefix = `nr-${crypto.randomBytes(4).toString('hex')}`;
    const keys = new KeySpace(prefix);
    const lines = [];
    const stream = new Writable({
      write(chunk, _enc, done) {
        for (const line of chunk.toString().split('\n')) if (line) lines.push(JSON.parse(line));
        done();
      },
    });
    const logger = createLogger({ stream, level: 'info' });
    const runs = [];
    let release;
    const gate = new Promise((resolve) => { release = resolve; });
    const worker = new Worker('nr.q', {
      'nr.hold': async (payload) => { runs.push(payload.id); if (payload.id === 'held') await gate; },
    }, { connection: group.url, prefix, logger, leaseMs: 1500, blockMs: 200, promoterMaxIdleMs: 200 });
    const producer = new Producer({ connection: group.url, prefix, logger });
    const old = await group.primaryPort();
    try {
      await worker.waitUntilReady();
      await producer.publish('nr.q', { task_type: 'nr.hold', payload: { id: 'held' } });
      await waitFor(() => runs.includes('held'));
      // The sentinels cannot demote the old primary: it stays one, without replicas once they follow the new one.
      await onNode(old, (c) => c.call('ACL', 'SETUSER', 'default', '-replicaof', '-slaveof'));
      await waitFor(() => onNode(group.sentinels[0], (c) => c.call('SENTINEL', 'FAILOVER', group.masterName)).then(() => true, (err) => {
        if (/^INPROG/.test(err.message)) return false;
        throw err;
      }), { timeoutMs: 20_000, intervalMs: 200, message: 'the sentinels kept a failover in progress' });
      await waitFor(async () => (await group.primaryPort()) !== old, { timeoutMs: 20_000, intervalMs: 100, message: 'no failover' });
      const now = await group.primaryPort();
      await waitFor(() => onNode(old, (c) => c.set(`${prefix}:probe`, '1')).then(() => false, (err) => /^NOREPLICAS/.test(err.message)),
        { timeoutMs: 10_000, intervalMs: 100, message: 'the old primary did not refuse writes' });
      release();
      // The ack landed on the new primary, the worker reads there, and its liveness key lives there.
      const taskStream = keys.queue('nr.q').stream('normal');
      await waitFor(async () => Number((await onNode(now, (c) => c.xpending(taskStream, 'workers')))[0]) === 0
        && (await onNode(now, (c) => c.xlen(taskStream))) === 0,
      { timeoutMs: 10_000, intervalMs: 100, message: () => `the entry was not settled on the new primary: ${JSON.stringify(lines.filter((l) => l.level !== 'info').slice(0, 3))}` });
      await producer.publish('nr.q', { task_type: 'nr.hold', payload: { id: 'after' } });
      await waitFor(() => runs.includes('after'), { timeoutMs: 10_000, message: 'the worker did not read on the new primary' });
      await new Promise((resolve) => setTimeout(resolve, 1600)); // more than a lease: only renewals keep the key
      assert.equal(await onNode(now, (c) => c.exists(keys.consumer(worker.consumer))), 1, 'the liveness key is renewed on the new primary');
      assert.deepEqual(runs, ['held', 'after'], 'each task ran once');
      assert.deepEqual(lines.filter((l) => l.level === 'error'), []);
      assert.equal(worker.running, true);
    } finally {
      release();
      await onNode(old, (c) => c.call('ACL', 'SETUSER', 'default', '+@all')).catch(() => {});
      await producer.close();
      await worker.close({ graceMs: 0 });
    }
  });
});
