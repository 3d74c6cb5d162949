// The claims of abandoned attempts (docs/protocol.md section 8), as pure logic: renewed every
// third of the claim time until the handler's promise settles, then done or released.
// setInterval is mocked (the clock only moves by tick()), so the renewals counted do not
// depend on the machine's load; a settlement is a chain of promises, drained by one
// macrotask turn.

import assert from 'node:assert/strict';
import { setImmediate as settle } from 'node:timers/promises';
import { describe, test } from 'node:test';
import { AbandonedClaims } from '../src/abandoned.js';

const silent = { info() {}, warn() {}, error() {} };

function tracker() {
  const calls = [];
  let finishing = Promise.resolve();
  const claims = new AbandonedClaims({
    renew: async (claim) => { calls.push(['renew', claim.key]); return 'acquired'; },
    finish: async (claim, how) => { calls.push([how, claim.key]); await finishing; },
  });
  return { claims, calls, slowFinish: (promise) => { finishing = promise; } };
}

/** A promise with its resolve and reject. */
function deferred() {
  let resolve;
  let reject;
  const promise = new Promise((res, rej) => { resolve = res; reject = rej; });
  return { promise, resolve, reject };
}

describe('abandoned claims', () => {
  test('renewed every third of the claim time, done when the handler resolves, held until that is written', async (t) => {
    t.mock.timers.enable({ apis: ['setInterval'] });
    const { claims, calls, slowFinish } = tracker();
    const renewals = () => calls.filter(([what]) => what === 'renew').length;
    const late = deferred();
    const written = deferred();
    slowFinish(written.promise);
    claims.keep({ key: 'k1', holder: 'c t', claimMs: 90 }, late.promise, silent);
    assert.ok(claims.holds('k1'));
    t.mock.timers.tick(29);
    assert.equal(renewals(), 0, 'not renewed before a third of the claim time');
    t.mock.timers.tick(1);
    assert.equal(renewals(), 1, 'renewed at a third of the claim time');
    t.mock.timers.tick(60);
    assert.equal(renewals(), 3, 'renewed at every third');
    late.resolve('value');
    await settle();
    assert.deepEqual(calls.at(-1), ['done', 'k1']);
    assert.ok(claims.holds('k1'), 'held until done is written');
    written.resolve();
    await claims.all();
    assert.equal(claims.holds('k1'), false);
    const settled = calls.length;
    t.mock.timers.tick(300);
    assert.equal(calls.length, settled, 'no renewal after it settled');
  });

  test('released when the handler rejects; a claim given up at shutdown is neither renewed nor settled', async (t) => {
    t.mock.timers.enable({ apis: ['setInterval'] });
    const { claims, calls } = tracker();
    const failing = deferred();
    claims.keep({ key: 'k2', holder: 'c t', claimMs: 30_000 }, failing.promise, silent);
    failing.reject(new Error('late failure'));
    await claims.all();
    assert.deepEqual(calls, [['release', 'k2']]);

    const running = deferred();
    claims.keep({ key: 'k3', holder: 'c t', claimMs: 30 }, running.promise, silent);
    claims.giveUp(silent);
    assert.equal(claims.holds('k3'), false);
    running.resolve();
    t.mock.timers.tick(300);
    await settle();
    assert.deepEqual(calls, [['release', 'k2']]);
  });
});
