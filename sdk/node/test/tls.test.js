// TLS against real redis-servers that speak TLS only, with a throw-away CA
// (support/certificates.js): one server (rediss:// with ssl_ca_certs, no CA,
// ssl_cert_reqs=none, a client certificate), a Sentinel group whose sentinels
// and data nodes all speak TLS, and a Redis Cluster over TLS. On each, a
// producer publishes and a worker runs the task, and trusting another CA fails
// both at once with a RedisTlsError.

import assert from 'node:assert/strict';
import crypto from 'node:crypto';
import { after, before, describe, test } from 'node:test';
import { Producer, Worker, createLogger } from '../src/index.js';
import { RedisTlsError } from '../src/tls.js';
import { makeCertificates } from '../support/certificates.js';
import { onNode, startCluster, startRedisServer, startSentinelGroup, waitFor } from '../support/helpers.js';

const FAST = { leaseMs: 1500, blockMs: 200, promoterMaxIdleMs: 200, logger: createLogger({ level: 'error' }) };
const prefixFor = () => `tls-${crypto.randomBytes(4).toString('hex')}`;

/** Publish one task with a producer on `producerUrl`; a worker on `workerUrl` runs it. */
async function publishAndRun(producerUrl, workerUrl = producerUrl) {
  const prefix = prefixFor();
  const ran = [];
  const worker = new Worker('tls', { 'tls.echo': (payload) => { ran.push(payload.n); } },
    { ...FAST, connection: workerUrl, prefix });
  const producer = new Producer({ connection: producerUrl, prefix });
  try {
    await worker.waitUntilReady();
    await producer.publish('tls', { task_type: 'tls.echo', payload: { n: 1 } });
    await waitFor(() => ran.length === 1, { timeoutMs: 5000, message: 'the task did not run' });
  } finally {
    await producer.close();
    await worker.close({ graceMs: 0 });
  }
}

/** `fn()` rejects within `withinMs` with a RedisTlsError (a certificate check that failed). */
// "At once" means well within the 30 s outage tolerance a retried outage would take; a
// Cluster client reads the slot map from every seed first, which takes seconds when loaded.
async function failsWithTlsError(fn, withinMs = 10000) {
  const started = Date.now();
  await assert.rejects(fn, (err) => {
    assert.ok(err instanceof RedisTlsError, `not a TLS error: ${err?.stack}`);
    assert.match(err.message, /^TLS connection to Redis failed: .*certificate/);
    return true;
  });
  const took = Date.now() - started;
  assert.ok(took < withinMs, `the TLS failure took ${took} ms to surface`);
}

/** A producer's publish and a worker's start on `url` both fail at once with a RedisTlsError. */
async function refusesCertificate(url) {
  const producer = new Producer({ connection: url, prefix: prefixFor() });
  try {
    await failsWithTlsError(() => producer.publish('tls', { task_type: 'tls.echo', payload: {} }));
    await failsWithTlsError(() => producer.publish('tls', { task_type: 'tls.echo', payload: {} }));
  } finally {
    await producer.close();
  }
  const worker = new Worker('tls', { 'tls.echo': () => {} }, { ...FAST, connection: url, prefix: prefixFor() });
  try {
    await failsWithTlsError(() => worker.waitUntilReady());
  } finally {
    await worker.close({ graceMs: 0 });
  }
}

/** `url` trusting `ca` instead of the CA it names. */
const trusting = (url, certs, ca) => url.replace(encodeURIComponent(certs.ca), encodeURIComponent(ca.ca));

describe('one redis-server over TLS', { concurrency: false }, () => {
  let certs;
  let otherCa;
  let server;
  before(async () => {
    certs = makeCertificates('server');
    otherCa = makeCertificates('other');
    server = await startRedisServer(null, [], { tls: certs });
  });
  after(async () => {
    await server?.close();
    certs?.remove();
    otherCa?.remove();
  });

  const urlWith = (query) => `rediss://127.0.0.1:${server.port}/0${query}`;

  test('a producer and a worker trusting the CA with ssl_ca_certs run a task', async () => {
    assert.match(server.url, /^rediss:\/\/127\.0\.0\.1:\d+\/0\?ssl_ca_certs=/);
    await publishAndRun(server.url);
  });

  test('the plain port is closed: the server speaks only TLS', async () => {
    assert.deepEqual(await onNode(server.port, (c) => c.config('GET', 'port')), ['port', '0']);
  });

  test('with another CA, or none, the certificate check fails at once, for a producer and a worker', async () => {
    await refusesCertificate(trusting(server.url, certs, otherCa));
    await refusesCertificate(urlWith(''));
  });

  test('ssl_cert_reqs=none skips the certificate check; required is the default', async () => {
    const unchecked = urlWith(`?ssl_cert_reqs=none&ssl_ca_certs=${encodeURIComponent(otherCa.ca)}`);
    await publishAndRun(unchecked);
    const required = urlWith(`?ssl_cert_reqs=required&ssl_ca_certs=${encodeURIComponent(otherCa.ca)}`);
    const producer = new Producer({ connection: required, prefix: prefixFor() });
    try {
      await failsWithTlsError(() => producer.publish('tls', { task_type: 'tls.echo', payload: {} }));
    } finally {
      await producer.close();
    }
  });

  test('a client certificate is sent with ssl_certfile and ssl_keyfile to a server that requires one', async () => {
    const strict = await startRedisServer(null, ['--tls-auth-clients', 'yes'], { tls: certs });
    try {
      assert.deepEqual(await onNode(strict.port, (c) => c.config('GET', 'tls-auth-clients')), ['tls-auth-clients', 'yes']);
      await publishAndRun(`${strict.url}&ssl_certfile=${encodeURIComponent(certs.cert)}&ssl_keyfile=${encodeURIComponent(certs.key)}`);
    } finally {
      await strict.close();
    }
  });
});

describe('Sentinel over TLS', { concurrency: false }, () => {
  let certs;
  let otherCa;
  let group;
  before(async () => {
    certs = makeCertificates('sentinel');
    otherCa = makeCertificates('other');
    group = await startSentinelGroup({ replicas: 1, tls: certs });
  });
  after(async () => {
    await group?.close();
    certs?.remove();
    otherCa?.remove();
  });

  test('a producer and a worker find the primary through TLS sentinels with a password and reach it over TLS', async () => {
    assert.match(group.url, /^rediss-sentinel:\/\/.*sentinel_password=.*ssl_ca_certs=/);
    for (const port of group.nodes.map((n) => n.port)) {
      assert.deepEqual(await onNode(port, (c) => c.config('GET', 'port')), ['port', '0'], `port ${port} speaks plain TCP`);
    }
    await publishAndRun(group.url);
    const stream = await onNode(await group.primaryPort(), (c) => c.keys('tls-*'));
    assert.ok(stream.length > 0, 'nothing was written on the primary');
  });

  test('sentinels whose certificate does not check out fail a producer and a worker at once', async () => {
    await refusesCertificate(trusting(group.url, certs, otherCa));
  });
});

describe('Redis Cluster over TLS', { concurrency: false }, () => {
  let certs;
  let otherCa;
  let cluster;
  before(async () => {
    certs = makeCertificates('cluster');
    otherCa = makeCertificates('other');
    cluster = await startCluster({ replicas: 0, tls: certs });
  });
  after(async () => {
    await cluster?.close();
    certs?.remove();
    otherCa?.remove();
  });

  test('a producer and a worker on rediss-cluster:// run a task', async () => {
    assert.match(cluster.url, /^rediss-cluster:\/\/.*\?ssl_ca_certs=/);
    for (const port of cluster.ports) {
      assert.deepEqual(await onNode(port, (c) => c.config('GET', 'tls-cluster')), ['tls-cluster', 'yes']);
    }
    await publishAndRun(cluster.url);
  });

  test('nodes whose certificate does not check out fail a producer and a worker at once', async () => {
    await refusesCertificate(trusting(cluster.url, certs, otherCa));
  });
});
