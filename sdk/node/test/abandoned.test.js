// The claims of abandoned attempts (docs/protocol.md section 8), as pure logic: renewed every
// third of the claim time until the handler's promise settles, then done or released.

import assert from 'node:assert/strict';
import { setTimeout as sleep } from 'node:timers/promises';
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
  test('renewed every third of the claim time, done when the handler resolves, held until that is written', async () => {
    const { claims, calls, slowFinish } = tracker();
    const late = deferred();
    const written = deferred();
    slowFinish(written.promise);
    claims.keep({ key: 'k1', holder: 'c t', claimMs: 90 }, late.promise, silent);
    assert.ok(claims.holds('k1'));
    await sleep(100);
    assert.ok(calls.filter(([what]) => what === 'renew').length >= 2, JSON.stringify(calls));
    late.resolve('value');
    await sleep(10);
    assert.deepEqual(calls.at(-1), ['done', 'k1']);
    assert.ok(claims.holds('k1'), 'held until done is written');
    written.resolve();
    await claims.all();
    assert.equal(claims.holds('k1'), false);
    const renewals = calls.length;
    await sleep(60);
    assert.equal(calls.length, renewals, 'no renewal after it settled');
  });

  test('released when the handler rejects; a claim given up at shutdown is neither renewed nor settled', async () => {
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
    await sleep(40);
    assert.deepEqual(calls, [['release', 'k2']]);
  });
});
