// The README's example, exactly as printed (its first ```js block), as a program against
// a real Redis: the task is published, run by the worker, and the program exits by itself.

import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { after, describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import Redis from 'ioredis';
import { parseRedisUrl } from '../src/index.js';
import { testRedis } from '../support/helpers.js';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const README = fs.readFileSync(path.join(ROOT, 'README.md'), 'utf8');
const server = await testRedis();
const skip = server ? false : 'no Redis: set ENVELOPE_TEST_REDIS_URL or put redis-server on PATH';

describe('README', () => {
  after(async () => server?.close());

  test('opens with the install line, then a producer and worker example of about ten lines', () => {
    assert.match(README, /^# [^\n]+\n\n```sh\nnpm install kombu-envelope\n```\n\n```js\n/);
    const code = README.match(/```js\n([\s\S]*?)```/)[1];
    const lines = code.trim().split('\n').filter((line) => line.trim());
    assert.ok(lines.length <= 11, `${lines.length} lines`);
    assert.match(code, /new Producer\(/);
    assert.match(code, /new Worker\(/);
  });

  test('the example runs against Redis and exits once its task has run', { skip, timeout: 30_000 }, async () => {
    const code = README.match(/```js\n([\s\S]*?)```/)[1];
    // Inside the package folder, so `import ... from 'kombu-envelope'` resolves to this package.
    const file = path.join(ROOT, `.readme-example-${process.pid}.mjs`);
    fs.writeFileSync(file, code);
    const redis = new Redis(parseRedisUrl(server.url));
    try {
      const { stderr } = await promisify(execFile)(process.execPath, [file], {
        cwd: ROOT, env: { ...process.env, REDIS_URL: server.url }, timeout: 25_000,
      });
      const lines = stderr.split('\n').filter(Boolean).map((line) => JSON.parse(line));
      const closing = lines.find((line) => line.msg === 'closing');
      assert.ok(closing, stderr);
      assert.equal(closing.order_id, '202509110001');
      assert.ok(closing.trace_id && closing.task_id, 'the handler log line carries trace_id and task_id');
      assert.ok(lines.some((line) => line.msg === 'task succeeded' && line.task_id === closing.task_id));
      assert.ok(lines.some((line) => line.msg === 'worker stopped'));
      const consumer = lines.find((line) => line.msg === 'worker ready').consumer;
      assert.equal(await redis.exists(`envelope:consumer:${consumer}`), 0, 'the worker left cleanly');
    } finally {
      fs.rmSync(file, { force: true });
      redis.disconnect();
    }
  });
});
