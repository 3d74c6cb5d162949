// Shared test helpers: the conformance vectors and a Redis to run against: one
// private redis-server, a Sentinel group or a Redis Cluster, all started from the
// redis-server binary on free loopback ports, in plain TCP or TLS only
// (support/certificates.js).

import { execFile, spawn } from 'node:child_process';
import crypto from 'node:crypto';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { after } from 'node:test';
import { Writable } from 'node:stream';
import { promisify } from 'node:util';
import { fileURLToPath } from 'node:url';
import { setTimeout as sleep } from 'node:timers/promises';
import Redis from 'ioredis';
import { parseJson } from '../src/json.js';
import { createLogger } from '../src/log.js';
import { parseRedisUrl } from '../src/url.js';
import { tlsDirectives } from './certificates.js';

/** A logger whose JSON lines (at `level` and above) are collected in `lines`. */
export function logSink(level = 'debug') {
  const lines = [];
  const stream = new Writable({
    write(chunk, _enc, done) {
      for (const line of chunk.toString().split('\n')) if (line) lines.push(JSON.parse(line));
      done();
    },
  });
  return { lines, logger: createLogger({ stream, level }) };
}

/** A logger that writes nowhere. */
export function quietLogger() {
  return createLogger({ stream: new Writable({ write: (_c, _e, done) => done() }) });
}

/**
 * The conformance vectors: $ENVELOPE_CONFORMANCE_DIR when set, else the first
 * conformance/ folder with a manifest.json found walking up from this file
 * (the repository root when the package is sdk/node of the repository).
 */
function findConformance() {
  if (process.env.ENVELOPE_CONFORMANCE_DIR) return path.resolve(process.env.ENVELOPE_CONFORMANCE_DIR);
  let dir = path.dirname(fileURLToPath(import.meta.url));
  for (;;) {
    const candidate = path.join(dir, 'conformance');
    if (fs.existsSync(path.join(candidate, 'manifest.json'))) return candidate;
    const parent = path.dirname(dir);
    if (parent === dir) throw new Error('no conformance/manifest.json above sdk/node; set ENVELOPE_CONFORMANCE_DIR');
    dir = parent;
  }
}

export const CONFORMANCE = findConformance();
export const REPO_ROOT = path.dirname(CONFORMANCE);

export function readVector(relative) {
  return parseJson(fs.readFileSync(path.join(CONFORMANCE, relative), 'utf8')).value;
}

export function manifest() {
  return readVector('manifest.json');
}

async function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.unref();
    server.on('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/** How far above its port a Cluster node binds its bus. */
const CLUSTER_BUS_OFFSET = 10000;

/** Whether nothing listens on loopback `port`. */
async function portIsFree(port) {
  return new Promise((resolve) => {
    const server = net.createServer();
    server.unref();
    server.once('error', () => resolve(false));
    server.listen(port, '127.0.0.1', () => server.close(() => resolve(true)));
  });
}

/**
 * A free port whose cluster-bus port is free as well and at most 65535: redis-server
 * refuses to start otherwise, and freePort answers ports up to 60999 on Linux.
 */
async function freeClusterPort() {
  for (;;) {
    const port = await freePort();
    if (port + CLUSTER_BUS_OFFSET <= 65535 && (await portIsFree(port + CLUSTER_BUS_OFFSET))) return port;
  }
}

function onPath(command) {
  return (process.env.PATH ?? '').split(path.delimiter).some((dir) => {
    try {
      fs.accessSync(path.join(dir, command), fs.constants.X_OK);
      return true;
    } catch {
      return false;
    }
  });
}

/**
 * A Redis URL for the integration tests: $ENVELOPE_TEST_REDIS_URL (the
 * Python suite passes its private server), else a private redis-server on a
 * free loopback port when one is on PATH, else null (the tests skip).
 * Returns { url, close }.
 */
export async function testRedis() {
  const external = process.env.ENVELOPE_TEST_REDIS_URL || process.env.KOMBU_ENVELOPE_TEST_REDIS_URL;
  if (external) return { url: external, close: async () => {} };
  if (!onPath('redis-server')) return null;
  return startRedisServer();
}

/**
 * The Redis of one test file's suites (testRedis()): `server` (null without
 * one), `skip` (false, or why the suites skip), `prefixFor()` (a fresh key
 * prefix `<tag>-<10 hex digits>` for each test) and `connect()`, called in a
 * describe: { redis, workers }, an ioredis client of the server for its tests
 * and a list to push their Workers on. After the suite the Workers stop (grace
 * 0, errors ignored), then the client disconnects and the server closes.
 */
export async function redisSuite(tag) {
  const server = await testRedis();
  const skip = server ? false : 'no Redis: set ENVELOPE_TEST_REDIS_URL or put redis-server on PATH';
  const prefixFor = () => `${tag}-${crypto.randomBytes(5).toString('hex')}`;
  const connect = () => {
    const redis = server ? new Redis(parseRedisUrl(server.url)) : null;
    const workers = [];
    after(async () => {
      for (const w of workers) await w.stop({ graceMs: 0 }).catch(() => {});
      redis?.disconnect();
      await server?.close();
    });
    return { redis, workers };
  };
  return { server, skip, prefixFor, connect };
}

/** The password of each port whose server requires one (startRedisServer's `password`). */
const passwords = new Map();
/** The ioredis `tls` options of each port whose server speaks TLS only (startRedisServer's `tls`). */
const tlsPorts = new Map();

/** A connection to 127.0.0.1:port that never retries (for probes and admin commands). */
export function directClient(port) {
  const client = new Redis({
    host: '127.0.0.1', port, password: passwords.get(port), tls: tlsPorts.get(port),
    lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null,
  });
  client.on('error', () => {});
  return client;
}

/** Run `fn(client)` on a fresh direct connection to `port`, closed afterwards. */
export async function onNode(port, fn) {
  const client = directClient(port);
  try {
    await client.connect();
    return await fn(client);
  } finally {
    client.disconnect();
  }
}

/** Every redis-server started here, killed when the test process exits however it ends. */
const children = new Set();
process.once('exit', () => {
  for (const child of children) child.kill('SIGKILL');
});

/**
 * A private redis-server on a loopback port (a free one unless given), ready
 * to answer; `args` are more redis-server arguments (a config file first
 * when `args[0]` is one), `password` the one they make it require (for the
 * probes of onNode), `tls` certificates (makeCertificates()) to speak TLS
 * only with, on that port. Returns { url, port, args, password, tls, child,
 * stop(signal), close }; the url is rediss:// trusting the CA when `tls`.
 */
export async function startRedisServer(port = null, args = [], { password, tls } = {}) {
  const chosen = port ?? (await freePort());
  if (password !== undefined) passwords.set(chosen, password);
  // Probes show the certificate as a client's too, for a server started with --tls-auth-clients yes.
  if (tls) tlsPorts.set(chosen, { ca: fs.readFileSync(tls.ca), cert: fs.readFileSync(tls.cert), key: fs.readFileSync(tls.key) });
  const [conf, ...given] = args[0] && !args[0].startsWith('--') ? args : [null, ...args];
  const rest = [...(tls ? tlsDirectives(tls, chosen).flatMap(([name, value]) => [`--${name}`, value]) : []), ...given];
  // A replica's full sync starts at once (not after the default 5 s wait for more replicas)
  // and writes its RDB file in the temporary directory, one name per port.
  const child = spawn('redis-server', [...(conf ? [conf] : []), '--port', String(chosen), '--bind', '127.0.0.1',
    '--save', '', '--appendonly', 'no', '--repl-diskless-sync-delay', '0',
    '--dir', os.tmpdir(), '--dbfilename', `envelope-test-${chosen}.rdb`, ...rest], { stdio: 'ignore' });
  children.add(child);
  const exited = new Promise((resolve) => child.once('exit', () => {
    children.delete(child);
    resolve();
  }));
  const deadline = Date.now() + 10_000;
  for (;;) {
    try {
      await onNode(chosen, (probe) => probe.ping());
      break;
    } catch {
      if (Date.now() > deadline || child.exitCode !== null) {
        child.kill('SIGKILL');
        throw new Error(`redis-server ${[conf, ...rest].filter(Boolean).join(' ')} did not start on port ${chosen}`);
      }
      await sleep(50);
    }
  }
  const stop = async (signal = 'SIGTERM') => {
    if (child.exitCode === null && child.signalCode === null) child.kill(signal);
    await exited;
    fs.rmSync(path.join(os.tmpdir(), `envelope-test-${chosen}.rdb`), { force: true });
  };
  const url = `${tls ? 'rediss' : 'redis'}://127.0.0.1:${chosen}/0${caQuery(tls, '?')}`;
  return { url, port: chosen, args, password, tls, child, stop, close: () => stop() };
}

/** Wait until the redis-server on `port` is a replica whose link to its primary is up. */
async function replicaInSync(port) {
  await waitFor(async () => {
    const info = String(await onNode(port, (c) => c.info('replication')).catch(() => ''));
    return info.includes('role:slave') && info.includes('master_link_status:up');
  }, { timeoutMs: 20_000, intervalMs: 100, message: `the node on ${port} did not become a replica in sync` });
}

/** Start `server` again on its port (with `args`, or its own) in place of the stopped one in `nodes`. */
async function restartIn(nodes, server, args = server.args) {
  const again = await startRedisServer(server.port, args, { password: server.password, tls: server.tls });
  nodes.splice(nodes.indexOf(server), 1, again);
  return again;
}

/** The query parameter trusting the CA of `tls` certificates, after `separator`; '' without them. */
function caQuery(tls, separator) {
  return tls ? `${separator}ssl_ca_certs=${encodeURIComponent(tls.ca)}` : '';
}

/** A fresh temporary directory, removed by the returned cleanup. */
function tempDir(name) {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), `envelope-${name}-`));
  return { dir, remove: () => fs.rmSync(dir, { recursive: true, force: true }) };
}

/**
 * A Sentinel group: a primary, `replicas` replicas and three sentinels (quorum 2,
 * down-after-milliseconds 2000, failover-timeout 3000) monitoring it as
 * `masterName`; the data nodes require `password`, the sentinels
 * `sentinelPassword`; with `tls` certificates every process speaks TLS only,
 * replication and the sentinels' links included. Resolves once the replicas
 * are in sync and every sentinel sees them and the other sentinels. Returns
 * { masterName, password, sentinelPassword, sentinels: [port], nodes: [server],
 * url (redis-sentinel://... with both passwords; rediss-sentinel://... trusting
 * the CA with `tls`), primaryPort(), rejoin(port), close }; rejoin starts a
 * stopped node again as a replica of the current primary.
 */
export async function startSentinelGroup({
  masterName = 'envelope-test', password = 'data-secret', sentinelPassword = 'sentinel-secret', replicas = 2, tls,
} = {}) {
  const auth = ['--requirepass', password, '--masterauth', password];
  const dataNode = (args = []) => startRedisServer(null, [...auth, ...args], { password, tls });
  const tmp = tempDir('sentinel');
  const nodes = [];
  const sentinels = [];
  const close = async () => {
    for (const server of [...sentinels, ...nodes]) await server.stop('SIGKILL');
    tmp.remove();
  };
  try {
    nodes.push(await dataNode());
    for (let i = 0; i < replicas; i += 1) nodes.push(await dataNode(['--replicaof', '127.0.0.1', String(nodes[0].port)]));
    for (const replica of nodes.slice(1)) await replicaInSync(replica.port);
    for (let i = 0; i < 3; i += 1) {
      const conf = path.join(tmp.dir, `sentinel-${i}.conf`);
      fs.writeFileSync(conf, [
        `dir ${tmp.dir}`,
        `requirepass ${sentinelPassword}`,
        `sentinel sentinel-pass ${sentinelPassword}`,
        `sentinel monitor ${masterName} 127.0.0.1 ${nodes[0].port} 2`,
        `sentinel auth-pass ${masterName} ${password}`,
        `sentinel down-after-milliseconds ${masterName} 2000`,
        `sentinel failover-timeout ${masterName} 3000`,
        `sentinel parallel-syncs ${masterName} 2`,
        '',
      ].join('\n'));
      sentinels.push(await startRedisServer(null, [conf, '--sentinel'], { password: sentinelPassword, tls }));
    }
    await waitFor(async () => {
      for (const s of sentinels) {
        const [seen, others] = await onNode(s.port, (c) => Promise.all([
          c.call('SENTINEL', 'REPLICAS', masterName), c.call('SENTINEL', 'SENTINELS', masterName)]));
        if (seen.length < replicas || others.length < 2) return false;
      }
      return true;
    }, { timeoutMs: 20_000, intervalMs: 200, message: 'the sentinels did not discover the group' });
  } catch (err) {
    await close();
    throw err;
  }
  const hosts = sentinels.map((s) => `127.0.0.1:${s.port}`).join(',');
  const primaryPort = async () => Number((await onNode(sentinels[0].port,
    (c) => c.call('SENTINEL', 'GET-MASTER-ADDR-BY-NAME', masterName)))[1]);
  return {
    masterName,
    password,
    sentinelPassword,
    sentinels: sentinels.map((s) => s.port),
    nodes,
    url: `${tls ? 'rediss' : 'redis'}-sentinel://:${encodeURIComponent(password)}@${hosts}/0`
      + `?sentinel_password=${encodeURIComponent(sentinelPassword)}${caQuery(tls, '&')}#${masterName}`,
    /** The port of the primary the sentinels announce now. */
    primaryPort,
    rejoin: async (port) => {
      await restartIn(nodes, nodes.find((n) => n.port === port), [...auth, '--replicaof', '127.0.0.1', String(await primaryPort())]);
      await replicaInSync(port);
    },
    close,
  };
}

const execFileAsync = promisify(execFile);

/** The CLUSTER NODES lines of the node on `port`, as { id, port, flags, master, slots }. */
export async function clusterNodes(port) {
  const text = await onNode(port, (c) => c.call('CLUSTER', 'NODES'));
  return String(text).trim().split('\n').map((line) => {
    const [id, addr, flags, master, , , , , ...slots] = line.split(' ');
    return { id, port: Number(addr.split('@')[0].split(':')[1]), flags: flags.split(','), master, slots };
  });
}

/**
 * Move hash slot `slot` from the primary on `fromPort` to the primary on
 * `toPort` while clients use it, as a resharding does: IMPORTING / MIGRATING,
 * MIGRATE of its keys in batches, then SETSLOT NODE on both (gossip tells the rest).
 */
export async function moveSlot(fromPort, toPort, slot) {
  const idOf = async (port) => (await clusterNodes(port)).find((n) => n.flags.includes('myself')).id;
  const [fromId, toId] = [await idOf(fromPort), await idOf(toPort)];
  await onNode(toPort, (c) => c.call('CLUSTER', 'SETSLOT', slot, 'IMPORTING', fromId));
  await onNode(fromPort, (c) => c.call('CLUSTER', 'SETSLOT', slot, 'MIGRATING', toId));
  await onNode(fromPort, async (c) => {
    for (;;) {
      const keys = await c.call('CLUSTER', 'GETKEYSINSLOT', slot, 100);
      if (!keys.length) break;
      await c.call('MIGRATE', '127.0.0.1', toPort, '', 0, 5000, 'KEYS', ...keys);
    }
  });
  for (const port of [toPort, fromPort]) await onNode(port, (c) => c.call('CLUSTER', 'SETSLOT', slot, 'NODE', toId));
}

/**
 * A Redis Cluster of three primaries with `replicas` replicas each
 * (cluster-node-timeout 1000 ms), made with `redis-cli --cluster create`; with
 * `tls` certificates every node speaks TLS only, cluster bus and replication
 * included. Resolves once every node answers cluster_state:ok and every replica
 * is in sync. Returns { ports, nodes: [server], url (redis-cluster://...;
 * rediss-cluster://... trusting the CA with `tls`), byPort(port), rejoin(port),
 * close }; rejoin starts a stopped node again, which comes back as a replica.
 */
export async function startCluster({ replicas = 1, tls } = {}) {
  const tmp = tempDir('cluster');
  const nodes = [];
  const close = async () => {
    for (const server of nodes) await server.stop('SIGKILL');
    tmp.remove();
  };
  try {
    for (let i = 0; i < 3 * (1 + replicas); i += 1) {
      const port = await freeClusterPort();
      nodes.push(await startRedisServer(port, ['--cluster-enabled', 'yes', '--cluster-node-timeout', '1000',
        '--cluster-config-file', path.join(tmp.dir, `nodes-${port}.conf`), '--dir', tmp.dir,
        ...(tls ? ['--tls-cluster', 'yes'] : [])], { tls }));
    }
    await execFileAsync('redis-cli', [...(tls ? ['--tls', '--cacert', tls.ca] : []),
      '--cluster', 'create', ...nodes.map((n) => `127.0.0.1:${n.port}`),
      '--cluster-replicas', String(replicas), '--cluster-yes'], { timeout: 30_000 });
    await waitFor(async () => {
      for (const n of nodes) {
        const info = String(await onNode(n.port, (c) => c.call('CLUSTER', 'INFO')));
        if (!info.includes('cluster_state:ok')) return false;
        const repl = String(await onNode(n.port, (c) => c.info('replication')));
        if (repl.includes('role:slave') && !repl.includes('master_link_status:up')) return false;
      }
      return true;
    }, { timeoutMs: 30_000, intervalMs: 100, message: 'the cluster did not reach cluster_state:ok' });
  } catch (err) {
    await close();
    throw err;
  }
  return {
    ports: nodes.map((n) => n.port),
    nodes,
    url: `${tls ? 'rediss' : 'redis'}-cluster://${nodes.slice(0, 3).map((n) => `127.0.0.1:${n.port}`).join(',')}${caQuery(tls, '?')}`,
    byPort: (port) => nodes.find((n) => n.port === port),
    rejoin: async (port) => {
      await restartIn(nodes, nodes.find((n) => n.port === port));
      await replicaInSync(port);
    },
    close,
  };
}

/** Poll `predicate` until it returns a truthy value (or throw after timeoutMs). */
export async function waitFor(predicate, { timeoutMs = 10_000, intervalMs = 20, message = 'condition not met' } = {}) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await predicate();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms: ${typeof message === 'function' ? message() : message}`);
    await sleep(intervalMs);
  }
}
