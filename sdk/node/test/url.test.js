// Redis URLs: one Redis, Sentinel and Cluster forms, their TLS options, and the errors of bad ones.

import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { describe, test } from 'node:test';
import Redis, { Cluster } from 'ioredis';
import { InvalidRedisUrl, createRedis, parseRedisLocation, parseRedisUrl } from '../src/url.js';

describe('Redis URLs', () => {
  test('redis:// and rediss:// give one client\'s options', () => {
    assert.deepEqual(parseRedisUrl('redis://127.0.0.1:6390/2'), { host: '127.0.0.1', port: 6390, db: 2 });
    assert.deepEqual(parseRedisUrl('rediss://u:p%40ss@cache.example:6380'),
      { host: 'cache.example', port: 6380, db: 0, username: 'u', password: 'p@ss', tls: {} });
    assert.deepEqual(parseRedisUrl('redis://:secret@[::1]'), { host: '::1', port: 6379, db: 0, password: 'secret' });
    assert.deepEqual(parseRedisUrl('redis://'), { host: '127.0.0.1', port: 6379, db: 0 });
  });

  test('redis-sentinel:// names the sentinels, the master and the credentials of each side', () => {
    assert.deepEqual(
      parseRedisUrl('redis-sentinel://app:pw@s1,s2:26380,[::1]:26381/3?sentinel_username=sen&sentinel_password=s%20pw#mymaster'),
      {
        username: 'app', password: 'pw', db: 3, name: 'mymaster',
        sentinels: [{ host: 's1', port: 26379 }, { host: 's2', port: 26380 }, { host: '::1', port: 26381 }],
        sentinelUsername: 'sen', sentinelPassword: 's pw',
      });
    assert.deepEqual(parseRedisUrl('rediss-sentinel://s1#m'), {
      db: 0, name: 'm', sentinels: [{ host: 's1', port: 26379 }], tls: {}, sentinelTLS: {}, enableTLSForSentinelMode: true,
    });
  });

  test('redis-cluster:// names seed nodes', () => {
    assert.deepEqual(parseRedisLocation('rediss-cluster://:pw@n1:7000,n2'), {
      kind: 'cluster', tls: true, tlsOptions: {}, db: 0, password: 'pw', hosts: [{ host: 'n1', port: 7000 }, { host: 'n2', port: 6379 }],
    });
    assert.throws(() => parseRedisUrl('redis-cluster://n1'), (err) => err instanceof InvalidRedisUrl && err.part === 'scheme');
  });

  test('a rediss URL of any form reads its TLS options from the query, for every connection', () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'envelope-url-tls-'));
    try {
      for (const name of ['ca.pem', 'cert.pem', 'key.pem']) fs.writeFileSync(path.join(dir, name), name);
      const q = (name) => encodeURIComponent(path.join(dir, name));
      const files = `ssl_ca_certs=${q('ca.pem')}&ssl_certfile=${q('cert.pem')}&ssl_keyfile=${q('key.pem')}`;
      const read = { ca: Buffer.from('ca.pem'), cert: Buffer.from('cert.pem'), key: Buffer.from('key.pem') };
      assert.deepEqual(parseRedisUrl(`rediss://h/1?${files}`), { host: 'h', port: 6379, db: 1, tls: read });
      assert.deepEqual(parseRedisUrl('rediss://h?ssl_cert_reqs=none').tls, { rejectUnauthorized: false });
      assert.deepEqual(parseRedisUrl('rediss://h?ssl_cert_reqs=required').tls, {});
      const sentinel = parseRedisUrl(`rediss-sentinel://s1?sentinel_password=x&ssl_ca_certs=${q('ca.pem')}#m`);
      assert.deepEqual([sentinel.tls, sentinel.sentinelTLS, sentinel.sentinelPassword], [{ ca: read.ca }, { ca: read.ca }, 'x']);
      const cluster = createRedis(`rediss-cluster://n1?ssl_ca_certs=${q('ca.pem')}`, { lazyConnect: true });
      try {
        assert.deepEqual(cluster.options.redisOptions.tls, { ca: read.ca });
      } finally {
        cluster.disconnect();
      }
      const wrong = [
        ['rediss://h?ssl_ca_certs=/no/such/ca.pem', /ssl_ca_certs: cannot read "\/no\/such\/ca.pem" \(ENOENT\)/],
        [`rediss://h?ssl_certfile=${q('cert.pem')}`, /ssl_certfile and ssl_keyfile go together/],
        ['rediss://h?ssl_cert_reqs=optional', /ssl_cert_reqs "optional" is not required or none/],
        [`redis://h?ssl_ca_certs=${q('ca.pem')}`, /ssl_ca_certs needs TLS: use rediss:\/\//],
        [`redis-sentinel://s1?ssl_cert_reqs=none#m`, /ssl_cert_reqs needs TLS/],
        ['rediss://h?ssl_verify=no', /unknown parameter "ssl_verify" \(known: ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs\)/],
      ];
      for (const [url, message] of wrong) {
        assert.throws(() => parseRedisLocation(url), (err) => err instanceof InvalidRedisUrl && err.part === 'query' && message.test(err.message), url);
      }
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  test('createRedis builds a Redis, a Sentinel-managed Redis or a Cluster', () => {
    const plain = createRedis('redis://127.0.0.1:1/0', { lazyConnect: true });
    const sentinel = createRedis('redis-sentinel://127.0.0.1:1#m', { lazyConnect: true });
    const cluster = createRedis('redis-cluster://:pw@127.0.0.1:1', { lazyConnect: true });
    try {
      assert.ok(plain instanceof Redis && !plain.options.sentinels);
      assert.ok(sentinel instanceof Redis);
      assert.deepEqual(sentinel.options.sentinels, [{ host: '127.0.0.1', port: 1 }]);
      assert.equal(sentinel.options.name, 'm');
      assert.ok(cluster instanceof Cluster);
      assert.equal(cluster.options.redisOptions.password, 'pw');
      assert.equal(cluster.options.redisOptions.lazyConnect, true);
    } finally {
      for (const c of [plain, sentinel, cluster]) c.disconnect();
    }
  });

  test('a bad URL fails at once, naming the part that is wrong', () => {
    const cases = [
      ['http://h', 'scheme'],
      ['h:6379', 'scheme'],
      ['redis://h:99999', 'port'],
      ['redis://h:', 'port'],
      ['redis://h:x', 'host'],
      ['redis://a,b', 'host'],
      ['redis-sentinel://#m', 'host'],
      ['redis-sentinel://s1,,s2#m', 'host'],
      ['redis-sentinel://s1/0', 'master_name'],
      ['redis://h#m', 'master_name'],
      ['redis://h/x', 'db'],
      ['redis-cluster://n1/1', 'db'],
      ['redis-sentinel://s1?sentinel_pass=x#m', 'query'],
      ['redis://h?sentinel_password=x', 'query'],
      ['redis://%zz@h', 'username'],
    ];
    for (const [url, part] of cases) {
      assert.throws(() => parseRedisLocation(url), (err) => {
        assert.ok(err instanceof InvalidRedisUrl, url);
        assert.equal(err.part, part, `${url}: ${err.message}`);
        assert.match(err.message, new RegExp(`^invalid Redis URL: ${part}: `));
        return true;
      });
    }
  });
});
