// Every conformance vector (conformance/manifest.json), against this implementation.

import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { describe, test } from 'node:test';
import { decodeEntry, MalformedEntry } from '../src/codec.js';
import { envelopeToJson, validateEnvelope } from '../src/envelope.js';
import { stringifyJson } from '../src/json.js';
import { InvalidLimits, limitsToJson, validateLimits } from '../src/limits.js';
import { compileSchema, payloadViolations, schemaDeadLetterReason } from '../src/schemas.js';
import { Timestamp } from '../src/time.js';
import { CONFORMANCE, manifest, readVector } from '../support/helpers.js';

const MANIFEST = manifest();
const README = fs.readFileSync(path.join(CONFORMANCE, 'README.md'), 'utf8');
const ENTRY_ERRORS = ['missing_field', 'version', 'encoding', 'gzip', 'too_large', 'envelope'];
// Every rule this implementation can report.
const RULES = [
  'required', 'unknown_field', 'type', 'json', 'json_value', 'pattern', 'length', 'range', 'rfc3339',
  'timezone_required', 'max_depth', 'max_bytes', 'retry_count_le_max_retries', 'max_delay',
];

/** The JSON text a reader receives for an envelope vector. */
function jsonText(vector) {
  const { input } = vector;
  const isRaw = input !== null && typeof input === 'object' && !Array.isArray(input) &&
    Object.keys(input).length === 1 && typeof input.raw === 'string';
  if (isRaw) return input.raw;
  let value = input;
  if (vector.schedule_offset_s !== undefined) {
    const when = Timestamp.fromEpochMs(Date.now() + vector.schedule_offset_s * 1000);
    value = { ...input, schedule_time: when.toString() };
  }
  return stringifyJson(value);
}

function verdict(vector, input) {
  const result = validateEnvelope(input, { publish: vector.publish === true });
  if (!result.ok) {
    assert.equal(vector.valid, false, `refused: ${JSON.stringify(result.violations)}`);
    assert.deepEqual(result.violations.map((v) => [v.field, v.rule]), [[vector.field, vector.rule]]);
    return;
  }
  assert.equal(vector.valid, true, `accepted, expected ${vector.field}: ${vector.rule}`);
  const written = JSON.parse(envelopeToJson(result.envelope));
  for (const [name, value] of Object.entries(vector.expect ?? {})) {
    assert.deepEqual(written[name], value, name);
  }
  // What this implementation writes, it reads back unchanged.
  const again = validateEnvelope(envelopeToJson(result.envelope));
  assert.equal(again.ok, true);
  assert.deepEqual(again.envelope, result.envelope);
}

function entryFieldsOf(vector) {
  const fields = new Map();
  for (const [name, value] of Object.entries(vector.fields)) {
    if (name === 'body_base64') fields.set('body', Buffer.from(value, 'base64'));
    else fields.set(name, Buffer.from(value, 'utf8'));
  }
  return fields;
}

describe('manifest', () => {
  test('lists every vector file on disk, and only those', () => {
    for (const kind of ['envelopes', 'entries', 'schemas', 'limits']) {
      const onDisk = fs.readdirSync(path.join(CONFORMANCE, kind)).filter((f) => f.endsWith('.json')).map((f) => `${kind}/${f}`).sort();
      assert.deepEqual([...MANIFEST[kind]].sort(), onDisk);
    }
    assert.equal(MANIFEST.format_version, 1);
  });

  test('every rule and entry error is documented in conformance/README.md', () => {
    for (const name of [...RULES, ...ENTRY_ERRORS]) assert.ok(README.includes(`\`${name}\``), name);
  });

  test('vectors only use rules and errors this implementation reports', () => {
    for (const relative of MANIFEST.envelopes) {
      const vector = readVector(relative);
      if (!vector.valid) assert.ok(RULES.includes(vector.rule), `${relative}: ${vector.rule}`);
    }
    for (const relative of MANIFEST.entries) {
      const vector = readVector(relative);
      if (!vector.valid) assert.ok(ENTRY_ERRORS.includes(vector.error), `${relative}: ${vector.error}`);
    }
  });
});

describe('envelope vectors (JSON text)', () => {
  for (const relative of MANIFEST.envelopes) {
    test(relative, () => {
      const vector = readVector(relative);
      verdict(vector, jsonText(vector));
    });
  }
});

describe('envelope vectors (decoded objects)', () => {
  for (const relative of MANIFEST.envelopes) {
    const vector = readVector(relative);
    const { input } = vector;
    // Like the Python suite: only object inputs (a JS string is read as JSON text).
    if (!input || typeof input !== 'object' || Array.isArray(input)) continue;
    if (Object.keys(input).length === 1 && 'raw' in input) continue;
    test(relative, () => verdict(vector, JSON.parse(jsonText(vector))));
  }
});

describe('entry vectors', () => {
  for (const relative of MANIFEST.entries) {
    test(relative, () => {
      const vector = readVector(relative);
      const fields = entryFieldsOf(vector);
      // As a Map, and as the flat array an ioredis *Buffer reply gives.
      const flat = [...fields].flatMap(([name, value]) => [Buffer.from(name), value]);
      for (const form of [fields, flat]) {
        let env;
        try {
          env = decodeEntry(form);
        } catch (err) {
          if (!(err instanceof MalformedEntry)) throw err;
          assert.equal(vector.valid, false, `refused: ${err.reason}`);
          assert.equal(err.kind, vector.error, err.reason);
          if (vector.field !== undefined) {
            assert.deepEqual(err.violations.map((v) => [v.field, v.rule]), [[vector.field, vector.rule]]);
          }
          continue;
        }
        assert.equal(vector.valid, true, `accepted, expected ${vector.error}`);
        assert.deepEqual(JSON.parse(envelopeToJson(env)), vector.envelope);
      }
    });
  }
});

describe('payload schema vectors', () => {
  for (const relative of MANIFEST.schemas) {
    test(relative, () => {
      const vector = readVector(relative);
      const found = payloadViolations(compileSchema(JSON.stringify(vector.schema)), vector.payload);
      // Fields, rules and keywords in order; messages are each validator's own.
      assert.deepEqual(found.map(({ field, rule, keyword }) => ({ field, rule, keyword })), vector.violations);
      for (const v of found) assert.ok(v.message, `${v.field} has a message`);
    });
  }

  test('a dead-letter reason joins the violations and is cut to 1,000 characters', () => {
    const one = { field: 'payload.a', rule: 'schema', keyword: 'type', message: 'must be integer' };
    assert.equal(schemaDeadLetterReason([one, { ...one, field: 'payload.b' }]),
      'schema: payload.a: must be integer; payload.b: must be integer');
    const long = schemaDeadLetterReason(Array.from({ length: 100 }, () => one));
    assert.equal([...long].length, 1000);
  });

  test('a schema that is not an object, or refers outside itself, does not compile', () => {
    assert.throws(() => compileSchema('true'), /must be a JSON object/);
    assert.throws(() => compileSchema('{"$ref": "https://example.com/other.json"}'));
    assert.throws(() => compileSchema('{"$ref": "#/$defs/missing"}'));
  });
});

describe('limit vectors', () => {
  for (const relative of MANIFEST.limits) {
    test(relative, () => {
      const vector = readVector(relative);
      let written;
      try {
        written = limitsToJson(vector.input);
      } catch (err) {
        if (!(err instanceof InvalidLimits)) throw err;
        assert.equal(vector.valid, false, `refused: ${err.message}`);
        assert.deepEqual([err.field, err.rule], [vector.field, vector.rule], err.message);
        assert.ok(err.message.includes(vector.rule), err.message);
        return;
      }
      assert.equal(vector.valid, true, `accepted, expected ${vector.field}: ${vector.rule}`);
      // Only the members given, each unchanged, in name order.
      assert.deepEqual(JSON.parse(written), vector.input);
      assert.deepEqual(Object.keys(JSON.parse(written)), Object.keys(vector.input).sort());
      assert.deepEqual(validateLimits(JSON.parse(written)), JSON.parse(written));
    });
  }
});
