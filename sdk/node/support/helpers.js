// Shared test helpers: the conformance vectors and a Redis to run against.

import { spawn } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { setTimeout as sleep } from 'node:timers/promises';
import Redis from 'ioredis';
import { parseJson } from '../src/json.js';
import { parseRedisUrl } from '../src/worker.js';

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
 * A private redis-server on a loopback port (a free one unless given), ready
 * to answer. Returns { url, port, close }.
 */
export async function startRedisServer(port = null) {
  const chosen = port ?? (await freePort());
  const child = spawn('redis-server', ['--port', String(chosen), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no'], {
    stdio: 'ignore',
  });
  const url = `redis://127.0.0.1:${chosen}/0`;
  const deadline = Date.now() + 10_000;
  for (;;) {
    const probe = new Redis({ ...parseRedisUrl(url), lazyConnect: true, maxRetriesPerRequest: 0, retryStrategy: () => null });
    probe.on('error', () => {});
    try {
      await probe.connect();
      await probe.ping();
      probe.disconnect();
      break;
    } catch {
      probe.disconnect();
      if (Date.now() > deadline) {
        child.kill('SIGKILL');
        throw new Error('redis-server did not start');
      }
      await sleep(50);
    }
  }
  return {
    url,
    port: chosen,
    close: async () => {
      child.kill('SIGTERM');
      await new Promise((resolve) => {
        if (child.exitCode !== null || child.signalCode !== null) resolve();
        else child.once('exit', resolve);
      });
    },
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
