// Stream entries, strict JSON, key layout and the shared Lua scripts.

import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import zlib from 'node:zlib';
import { describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import {
  ENC_JSON, ENC_JSON_GZIP, MalformedEntry, decodeEntry, encodeEntry, inflateBody, maxBodyBytes,
} from '../src/codec.js';
import { envelopeToJson, newEnvelope, validateEnvelope } from '../src/envelope.js';
import { JsonSyntaxError, parseJson, stringifyJson } from '../src/json.js';
import { BUCKETS, KeySpace, bucketFor } from '../src/keys.js';
import { LUA_DIR, SCRIPT_NAMES, keyCount, loadScripts } from '../src/scripts.js';
import { REPO_ROOT } from '../support/helpers.js';

const env = (fields = {}) => newEnvelope({ task_type: 'reports.render', ...fields });
// The identity every Envelope carries on the wire.
const ID = '"task_id":"t-1","trace_id":"tr-1","created_at":"2025-09-11T04:40:00Z"';
const kindOf = (fields) => {
  try {
    decodeEntry(fields);
  } catch (err) {
    assert.ok(err instanceof MalformedEntry, String(err));
    return err.kind;
  }
  return 'ok';
};

describe('entries', () => {
  test('small bodies are plain JSON, large ones gzip, and both decode', () => {
    const small = env({ payload: { a: 1 } });
    const plain = encodeEntry(small);
    assert.equal(plain.v, '1');
    assert.equal(plain.enc, ENC_JSON);
    assert.deepEqual(decodeEntry(plain), small);
    const big = env({ payload: { blob: 'x'.repeat(10_000) } });
    const packed = encodeEntry(big);
    assert.equal(packed.enc, ENC_JSON_GZIP);
    assert.deepEqual([...packed.body.subarray(0, 2)], [0x1f, 0x8b]);
    assert.deepEqual(decodeEntry(packed), big);
    assert.equal(encodeEntry(big, { gzipMinBytes: null }).enc, ENC_JSON);
  });

  test('an Envelope with an ordering_key is plain JSON whatever its size (the scripts read the key)', () => {
    const keyed = env({ payload: { blob: 'x'.repeat(10_000) }, ordering_key: 'order:42' });
    const entry = encodeEntry(keyed);
    assert.equal(entry.enc, ENC_JSON);
    assert.match(entry.body.toString('utf8'), /"ordering_key":"order:42"/);
    assert.deepEqual(decodeEntry(entry), keyed);
  });

  test('gzip from other writers: header fields, any level, but exactly one member', () => {
    const json = Buffer.from(envelopeToJson(env()));
    const withName = Buffer.concat([
      Buffer.from([0x1f, 0x8b, 8, 0x08, 0, 0, 0, 0, 0, 3]), Buffer.from('body.json\0'),
      zlib.deflateRawSync(json, { level: 9 }), Buffer.alloc(8),
    ]);
    withName.writeUInt32LE(zlib.crc32(json) >>> 0, withName.length - 8);
    withName.writeUInt32LE(json.length, withName.length - 4);
    assert.deepEqual(inflateBody(withName), json);
    const gz = zlib.gzipSync(json);
    assert.equal(kindOf({ v: '1', enc: 'json+gzip', body: Buffer.concat([gz, gz]) }), 'gzip');
    assert.equal(kindOf({ v: '1', enc: 'json+gzip', body: Buffer.concat([gz, Buffer.from([0])]) }), 'gzip');
    assert.equal(kindOf({ v: '1', enc: 'json+gzip', body: gz.subarray(0, gz.length - 1) }), 'gzip');
    assert.equal(kindOf({ v: '1', enc: 'json+gzip', body: Buffer.alloc(0) }), 'gzip');
  });

  test('bombs are refused with a bound, plain bodies too', () => {
    const bomb = zlib.gzipSync(Buffer.alloc(maxBodyBytes() + 1, 0x20));
    assert.ok(bomb.length < 4096);
    assert.equal(kindOf({ v: '1', enc: 'json+gzip', body: bomb }), 'too_large');
    assert.equal(kindOf({ v: '1', enc: 'json', body: Buffer.alloc(maxBodyBytes() + 1, 0x20) }), 'too_large');
  });

  test('every kind of broken entry is a MalformedEntry, never a crash', () => {
    const body = Buffer.from(envelopeToJson(env()));
    assert.equal(kindOf({ enc: 'json', body }), 'missing_field');
    assert.equal(kindOf({ v: '1', body }), 'missing_field');
    assert.equal(kindOf({ v: '1', enc: 'json' }), 'missing_field');
    assert.equal(kindOf({ v: '1 ', enc: 'json', body }), 'version');
    assert.equal(kindOf({ v: '1', enc: 'gzip', body }), 'encoding');
    assert.equal(kindOf({ v: '1', enc: 'json', body: Buffer.from([0xef, 0xbb, 0xbf, ...body]) }), 'envelope'); // BOM
    assert.equal(kindOf({ v: '1', enc: 'json', body: Buffer.from(`{${ID},"task_type":"a","payload":{"s":"\\ud800"}}`) }), 'envelope');
    assert.equal(kindOf(null), 'missing_field');
    assert.equal(kindOf('not fields'), 'missing_field');
    assert.equal(kindOf({ v: '1', enc: 'json', body: Buffer.from('['.repeat(100_000)) }), 'envelope');
    assert.equal(kindOf(['v', '1', 'enc', 'json', 'body', body, 'n', '3']), 'ok');
  });

  test('a reader never invents the identity: task_id, trace_id and created_at are required', () => {
    for (const missing of ['task_id', 'trace_id', 'created_at']) {
      const fields = { task_type: 'a', task_id: 't-1', trace_id: 'tr-1', created_at: '2025-09-11T04:40:00Z' };
      delete fields[missing];
      try {
        decodeEntry({ v: '1', enc: 'json', body: JSON.stringify(fields) });
        assert.fail(`decoded without ${missing}`);
      } catch (err) {
        assert.ok(err instanceof MalformedEntry, String(err));
        assert.equal(err.kind, 'envelope');
        assert.deepEqual(err.violations.map((v) => [v.field, v.rule]), [[missing, 'required']]);
      }
    }
    // A producer fills them in; what it keeps, it keeps.
    const built = newEnvelope({ task_type: 'a', trace_id: 'from-the-request' });
    assert.match(built.task_id, /^[0-9a-f-]{36}$/);
    assert.equal(built.trace_id, 'from-the-request');
    assert.equal(validateEnvelope(envelopeToJson(built)).ok, true);
  });

  test('the partial object of an invalid body is kept for logs', () => {
    try {
      decodeEntry({ v: '1', enc: 'json', body: `{${ID},"task_type":"a","priority":900}` });
      assert.fail('should not decode');
    } catch (err) {
      assert.equal(err.kind, 'envelope');
      assert.equal(err.partial.task_id, 't-1');
      assert.deepEqual(err.violations.map((v) => [v.field, v.rule]), [['priority', 'range']]);
    }
  });
});

describe('strict JSON', () => {
  test('integers beyond 2**53 keep every digit', () => {
    const { value } = parseJson('{"id": 12345678901234567890, "n": -9007199254740993, "ok": 9007199254740991}');
    assert.equal(value.id, 12345678901234567890n);
    assert.equal(value.n, -9007199254740993n);
    assert.equal(value.ok, 9007199254740991);
    assert.equal(stringifyJson(value), '{"id":12345678901234567890,"n":-9007199254740993,"ok":9007199254740991}');
    const e = env({ payload: value });
    assert.deepEqual(validateEnvelope(envelopeToJson(e)).envelope.payload, value);
  });

  test('source text of top-level members is kept', () => {
    const { raw } = parseJson('{"a": 1.0, "b": 1e2, "c": [1]}');
    assert.equal(raw.get('a'), '1.0');
    assert.equal(raw.get('b'), '1e2');
    assert.equal(raw.get('c'), '[1]');
  });

  test('refuses what RFC 8259 refuses', () => {
    for (const text of ['', '{', '{"a":1,}', '[1,]', '01', '1.', '.5', '+1', 'NaN', 'Infinity', '"a\tb"', "{'a':1}",
      '{"a":1} x', '"\\x"', '"\\u12"', '"\\ud800"', '"\\udc00x"', '\ufeff{}', 'tru', '{"a" 1}']) {
      assert.throws(() => parseJson(text), JsonSyntaxError, JSON.stringify(text));
    }
    assert.equal(parseJson('"\\ud83d\\ude80"').value, '🚀');
    assert.equal(parseJson(' \n\t{"__proto__": {"x": 1}} ').value.__proto__.x, 1);
    assert.equal(Object.getPrototypeOf(parseJson('{"__proto__": {"x": 1}}').value), Object.prototype);
  });

  test('writes only JSON', () => {
    assert.throws(() => stringifyJson({ a: NaN }), TypeError);
    assert.throws(() => stringifyJson({ a: new Date() }), TypeError);
    assert.equal(stringifyJson({ a: undefined, b: [null, true, 'é'] }), '{"b":[null,true,"é"]}');
  });
});

describe('keys', () => {
  test('prefix and {queue} hash tag on every key of a queue', () => {
    const ks = new KeySpace('envelope');
    const q = ks.queue('celery');
    assert.deepEqual(q.taskStreams, ['envelope:{celery}:high', 'envelope:{celery}:normal', 'envelope:{celery}:low']);
    assert.equal(q.delayed, 'envelope:{celery}:delayed');
    assert.equal(q.delayedData, 'envelope:{celery}:delayed:data');
    assert.equal(q.dead, 'envelope:{celery}:dead');
    assert.equal(q.cancelled, undefined, 'cancel marks are not per queue (revision 2)');
    assert.equal(q.kombu, 'envelope:{celery}:kombu');
    assert.equal(q.order('order:42'), 'envelope:{celery}:order:order:42');
    assert.equal(q.orderWaiting('order:42'), 'envelope:{celery}:order-waiting:order:42');
    assert.equal(q.orderAdvanced, 'envelope:{celery}:order-advanced');
    assert.equal(q.orderHeld, 'envelope:{celery}:order-held');
    assert.equal(q.orderPolicy, 'envelope:{celery}:order-policy');
    assert.equal(q.orderHalted, 'envelope:{celery}:order-halted');
    assert.equal(ks.queues, 'envelope:queues');
    assert.equal(ks.deadQueues, 'envelope:dead-queues');
    assert.equal(ks.cancelled, 'envelope:cancelled');
    assert.equal(ks.wakeup, 'envelope:wakeup');
    assert.equal(ks.consumer('h-1-ab'), 'envelope:consumer:h-1-ab');
    assert.equal(ks.idempotency('order.close_timeout', '202509110001'), 'envelope:idem:order.close_timeout:202509110001');
    assert.equal(ks.retrying('a.b'), 'envelope:retrying:a.b');
    assert.equal(q.bucketOf('envelope:{celery}:low'), 'low');
    assert.throws(() => ks.queue('a{b'));
    assert.throws(() => ks.queue('a}b'));
    assert.throws(() => ks.queue(''));
  });

  test('buckets: higher priority is more urgent', () => {
    assert.deepEqual(BUCKETS, ['high', 'normal', 'low']);
    assert.deepEqual([0, 84, 85, 100, 169, 170, 255].map(bucketFor), ['low', 'low', 'normal', 'normal', 'normal', 'high', 'high']);
  });
});

describe('shared Lua scripts', () => {
  test("every script is loaded from the package's lua/ with the key count of its header", () => {
    assert.equal(path.resolve(LUA_DIR), fileURLToPath(new URL('../lua', import.meta.url)));
    const scripts = loadScripts();
    for (const name of SCRIPT_NAMES) assert.ok(scripts.has(name), name);
    const expected = {
      // null: the caller passes the count (a variable or optional key, such as a task record)
      enqueue: null, schedule: null, promote: 5, read: null, requeue: null, dead_letter: null, retry: null,
      cancel: null,
      idem_begin: 1, idem_finish: 1, retry_slot: 1,
    };
    for (const [name, { lua, numberOfKeys }] of scripts) {
      if (name in expected) assert.equal(numberOfKeys, expected[name], name);
      else assert.ok(numberOfKeys === null || numberOfKeys >= 1, `${name}: its header documents its KEYS`);
      assert.equal(lua, fs.readFileSync(path.join(LUA_DIR, `${name}.lua`), 'utf8'));
    }
    const onDisk = fs.readdirSync(LUA_DIR).filter((f) => f.endsWith('.lua')).map((f) => f.slice(0, -4)).sort();
    assert.deepEqual([...scripts.keys()], onDisk);
  });

  test('the copies in lua/ equal kombu_envelope/lua/ of the repository (python sdk/sync_lua.py)', (t) => {
    const source = path.join(REPO_ROOT, 'kombu_envelope', 'lua');
    if (!fs.existsSync(source)) return t.skip('not inside the repository');
    const names = (dir) => fs.readdirSync(dir).filter((f) => f.endsWith('.lua')).sort();
    assert.deepEqual(names(LUA_DIR), names(source), 'run python sdk/sync_lua.py');
    for (const name of names(source)) {
      assert.ok(fs.readFileSync(path.join(LUA_DIR, name)).equals(fs.readFileSync(path.join(source, name))),
        `${name} differs from its source: run python sdk/sync_lua.py`);
    }
  });

  test('key counts come from the header only', () => {
    assert.equal(keyCount('-- KEYS[1] a\n-- KEYS[2] b\nreturn KEYS[3]'), 2);
    assert.equal(keyCount('-- KEYS[1..n] streams\n'), null);
    assert.equal(keyCount('-- KEYS[1] a\n-- KEYS[2]  optional: a record\n'), null);
    assert.throws(() => keyCount('return 1'));
  });
});
