// The package as users get it: the ESM and CommonJS entries of the exports map, the
// type declarations, the Lua scripts in its own lua/, and the files npm publishes.

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { before, describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import * as esm from 'kombu-envelope';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const require = createRequire(import.meta.url);
const pkg = JSON.parse(fs.readFileSync(path.join(ROOT, 'package.json'), 'utf8'));

/** Newest modification time of the files under dir (ms). */
function newest(dir) {
  let latest = 0;
  for (const entry of fs.readdirSync(dir, { withFileTypes: true, recursive: true })) {
    if (entry.isFile()) latest = Math.max(latest, fs.statSync(path.join(entry.parentPath ?? entry.path, entry.name)).mtimeMs);
  }
  return latest;
}

describe('package', () => {
  before(() => {
    // dist/ is built by `npm ci` (prepare); build it again when src/ changed since.
    const cjs = path.join(ROOT, 'dist', 'index.cjs');
    if (!fs.existsSync(cjs) || fs.statSync(cjs).mtimeMs < newest(path.join(ROOT, 'src'))) {
      execFileSync(process.execPath, [path.join(ROOT, 'scripts', 'build.mjs')], { cwd: ROOT, stdio: 'ignore' });
    }
  });

  test('the exports map names an ESM entry, a CommonJS entry and the types', () => {
    assert.equal(pkg.name, 'kombu-envelope');
    assert.equal(pkg.type, 'module');
    const root = pkg.exports['.'];
    assert.deepEqual(Object.keys(root), ['types', 'import', 'require']);
    for (const file of Object.values(root)) assert.ok(fs.existsSync(path.join(ROOT, file)), file);
  });

  test('import and require give the same API', () => {
    const cjs = require('kombu-envelope');
    assert.deepEqual(Object.keys(cjs).sort(), Object.keys(esm).sort());
    for (const name of ['Producer', 'Worker', 'Promoter', 'Timestamp', 'InvalidEnvelope', 'TransientError', 'decodeEntry']) {
      assert.equal(typeof esm[name], 'function', name);
      assert.equal(typeof cjs[name], 'function', name);
    }
    assert.equal(cjs.LUA_DIR, esm.LUA_DIR);
    assert.equal(path.resolve(esm.LUA_DIR), path.join(ROOT, 'lua'));
    assert.deepEqual([...cjs.loadScripts().keys()], [...esm.loadScripts().keys()]);
  });

  test('a CommonJS program requires the package', () => {
    const out = execFileSync(process.execPath, ['-e',
      "const { Producer, Worker, newEnvelope } = require('kombu-envelope');" +
      "console.log(typeof Producer, typeof Worker, newEnvelope({ task_type: 'a.b' }).task_type)"], { cwd: ROOT, encoding: 'utf8' });
    assert.equal(out.trim(), 'function function a.b');
  });

  test('the type declarations describe the API and a TypeScript user compiles against them', () => {
    const index = fs.readFileSync(path.join(ROOT, 'dist', 'types', 'index.d.ts'), 'utf8');
    assert.match(index, /Producer/);
    assert.match(index, /Worker/);
    const dir = fs.mkdtempSync(path.join(ROOT, '.types-check-'));
    try {
      fs.writeFileSync(path.join(dir, 'consumer.ts'), [
        "import { DeadLetters, Producer, Worker, Timestamp, type CancelResult, type PublishOptions, type PublishResult, type WorkerOptions } from 'kombu-envelope';",
        "const producer = new Producer({ connection: 'redis://127.0.0.1:6379/0', prefix: 'envelope' });",
        "const result: Promise<PublishResult> = producer.publish('orders', { task_type: 'a.b' });",
        "const worker = new Worker('orders', { 'a.b': async (payload, ctx) => ctx.taskId }, { connection: 'redis://127.0.0.1:6379/0', autorun: false });",
        "worker.on('completed', (envelope: { task_id: string }, info: { durationMs: number }) => [envelope.task_id, info.durationMs]);",
        "const options: WorkerOptions = { connection: 'redis://127.0.0.1:6379/0', concurrency: 2, leaseMs: 30_000, resultBackend: 'redis://127.0.0.1:6379/1' };",
        "const publishOptions: PublishOptions = { expiresInMs: 60_000 };",
        "const expiring: Promise<PublishResult> = producer.publish('orders', { task_type: 'a.b' }, publishOptions);",
        "const cancelled: Promise<CancelResult> = producer.cancel('some-task-id', { queue: 'orders' });",
        "cancelled.then((c) => (c.outcome === 'removed' ? c.queue : null));",
        "export { options };",
        'const closed: Promise<void> = worker.close();',
        'const when: Timestamp = Timestamp.fromEpochMs(0, 480);',
        "const replayed: Promise<string | null> = new DeadLetters({ connection: 'redis://127.0.0.1:6379/0' }).replay('orders', '1-0', { mergePatch: { a: 1 } });",
        'export { result, closed, when, replayed, expiring };',
        '',
      ].join('\n'));
      execFileSync(process.execPath, [require.resolve('typescript/bin/tsc'), '--noEmit', '--strict', '--skipLibCheck',
        '--module', 'nodenext', '--moduleResolution', 'nodenext', '--target', 'es2022', path.join(dir, 'consumer.ts')],
      { cwd: ROOT, encoding: 'utf8' });
    } catch (err) {
      assert.fail(`tsc: ${err.stdout ?? ''}${err.stderr ?? ''}${err.stdout ? '' : err.message}`);
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });

  test('npm publishes the sources, the build, the Lua scripts and the docs, not the tests', () => {
    const out = execFileSync('npm', ['pack', '--dry-run', '--json', '--ignore-scripts'], { cwd: ROOT, encoding: 'utf8' });
    const files = JSON.parse(out)[0].files.map((f) => f.path);
    for (const name of fs.readdirSync(path.join(ROOT, 'lua'))) assert.ok(files.includes(`lua/${name}`), name);
    for (const name of ['src/index.js', 'src/worker.js', 'dist/index.cjs', 'dist/types/index.d.ts', 'README.md', 'CHANGELOG.md', 'package.json']) {
      assert.ok(files.includes(name), name);
    }
    assert.ok(!files.some((f) => f.startsWith('test/') || f.startsWith('support/') || f.startsWith('node_modules/')), files.join(' '));
  });
});

