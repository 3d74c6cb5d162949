// What each sentinel's SENTINEL MASTER reply counts for, and the majority rule
// (the connector itself runs against real sentinels in test/ha.test.js).

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { SentinelMajorityError, majorityOf, primaryOf } from '../src/sentinel.js';
import { isRedisAway } from '../src/outage.js';

const reply = (fields) => Object.entries({ name: 'm', ip: '10.0.0.1', port: '6379', ...fields }).flat();

describe('Sentinel majority', () => {
  test('a sentinel votes only for a primary it does not hold down', () => {
    assert.deepEqual(primaryOf(reply({ flags: 'master' })), { primary: { host: '10.0.0.1', port: 6379 } });
    assert.deepEqual(primaryOf(reply({ flags: 'master,s_down' })), { problem: 'names 10.0.0.1:6379 s_down' });
    assert.deepEqual(primaryOf(reply({ flags: 'master,s_down,o_down,disconnected' })),
      { problem: 'names 10.0.0.1:6379 s_down,o_down' });
    assert.deepEqual(primaryOf(reply({ flags: 'master,disconnected' })), { primary: { host: '10.0.0.1', port: 6379 } },
      'a link being re-established is not a primary down');
    assert.deepEqual(primaryOf(reply({ flags: 'slave' })), { problem: 'names no primary (flags slave)' });
    assert.deepEqual(primaryOf(reply({ ip: '::1', flags: 'master,s_down' })), { problem: 'names [::1]:6379 s_down' });
    assert.deepEqual(primaryOf('OK'), { problem: 'answers "OK"' });
  });

  test('more than half of the listed sentinels must name the same address', () => {
    const at = (port) => ({ primary: { host: '10.0.0.1', port } });
    assert.deepEqual(majorityOf([at(1), at(2), at(2)], 2), { host: '10.0.0.1', port: 2 });
    assert.equal(majorityOf([at(1), at(2), { problem: 'fails: connect ECONNREFUSED' }], 2), null);
    assert.equal(majorityOf([at(1), at(1)], 3), null);
    assert.deepEqual(majorityOf([at(1), at(1)], 2), { host: '10.0.0.1', port: 1 }, 'a majority before the last answer');
  });

  test('no majority is an outage whose message names the rule and each answer', () => {
    const err = new SentinelMajorityError('m', 2, [
      { sentinel: 's1:26379', primary: { host: '10.0.0.1', port: 1 } },
      { sentinel: 's2:26379', problem: 'fails: connect ECONNREFUSED' },
      { sentinel: 's3:26379', primary: { host: '10.0.0.2', port: 1 } },
    ]);
    assert.equal(err.message, 'no primary for master_name "m": 2 of 3 sentinels must name the same primary; '
      + 's1:26379 names 10.0.0.1:1, s2:26379 fails: connect ECONNREFUSED, s3:26379 names 10.0.0.2:1');
    assert.equal(isRedisAway(err), true);
    assert.equal(err.refused, false);
  });

  test('no majority because a sentinel refused the password is not an outage', () => {
    const err = new SentinelMajorityError('m', 1, [
      { sentinel: 's1:26379', problem: 'fails: WRONGPASS invalid username-password pair or user is disabled.' },
    ]);
    assert.equal(err.refused, true);
    assert.equal(isRedisAway(err), false);
  });
});
