// Payload schemas (docs/protocol.md section 16): JSON Schema draft 2020-12 per
// (task_type, payload_version), in the hash <prefix>:schemas, field
// <task_type>@<payload_version>. Read with HGETALL at most every cacheMs; a
// stored schema that cannot be compiled is logged and ignored. Validated with
// ajv's 2020-12 build in all-errors mode, `format` never asserted, nothing
// ever fetched (a reference that is not inside the schema does not compile).
//
// Violations: field payload<path> (`.name` for a member, `[i]` for an array
// item), rule `schema`, the failed keyword; `required` and
// `additionalProperties` name the member; sorted by path segment by segment
// (an index before a name, indices as numbers, names by code points, a path
// before those it is a prefix of), then keyword, then message.

import Ajv2020 from 'ajv/dist/2020.js';
import { InvalidEnvelope } from './envelope.js';
import { stringifyJson } from './json.js';

/** Default schema_cache_s, in ms: how long the schemas read from Redis are used. */
export const SCHEMA_CACHE_MS = 30_000;

/** The rule of a payload that breaks its schema. */
export const RULE_SCHEMA = 'schema';

/** Longest dead-letter reason of a schema violation, in characters. */
const MAX_SCHEMA_REASON = 1000;

/**
 * One way a payload breaks its schema.
 * @typedef {{ field: string, rule: 'schema', keyword: string, message: string }} SchemaViolation
 */

/** The hash field of a schema: <task_type>@<payload_version>. */
export const schemaField = (taskType, version) => `${taskType}@${version}`;

/** A compiler as section 16 wants it: 2020-12, all errors, formats as annotations, unknown keywords ignored. */
const newAjv = () => new Ajv2020.default({ allErrors: true, validateFormats: false, strict: false });

/**
 * Compile a payload schema (its JSON text): a JSON object referring only to itself.
 * Throws when it cannot be used.
 * @param {string} text
 */
export function compileSchema(text) {
  const schema = JSON.parse(text);
  if (schema === null || typeof schema !== 'object' || Array.isArray(schema)) {
    throw new TypeError('a payload schema must be a JSON object');
  }
  return newAjv().compile(schema);
}

/** JSON pointer segments of an ajv instancePath. */
const pointerParts = (pointer) => (pointer === '' ? [] : pointer.slice(1).split('/').map((p) => p.replace(/~1/g, '/').replace(/~0/g, '~')));

/** Typed segments of a location in `doc`: an index where the value is an array, else a name. */
function segmentsOf(doc, parts) {
  const out = [];
  let at = doc;
  for (const part of parts) {
    if (Array.isArray(at) && /^(0|[1-9][0-9]*)$/.test(part) && Number(part) < at.length) {
      out.push({ index: Number(part) });
      at = at[Number(part)];
    } else {
      out.push({ name: part });
      at = at !== null && typeof at === 'object' && !Array.isArray(at) ? at[part] : undefined;
    }
  }
  return out;
}

const pathText = (segments) => segments.map((s) => ('index' in s ? `[${s.index}]` : `.${s.name}`)).join('');

/** Code point order of two strings (JS compares UTF-16 code units). */
function compareText(a, b) {
  const x = [...a];
  const y = [...b];
  for (let i = 0; i < Math.min(x.length, y.length); i += 1) {
    const d = x[i].codePointAt(0) - y[i].codePointAt(0);
    if (d) return d;
  }
  return x.length - y.length;
}

function comparePaths(a, b) {
  for (let i = 0; i < Math.min(a.length, b.length); i += 1) {
    const x = a[i];
    const y = b[i];
    if ('index' in x !== 'index' in y) return 'index' in x ? -1 : 1;
    const d = 'index' in x ? x.index - y.index : compareText(x.name, y.name);
    if (d) return d;
  }
  return a.length - b.length;
}

/**
 * The violations of `payload` (a decoded JSON value) against a compiled schema, sorted.
 * @param {any} validate a compiled schema (compileSchema)
 * @param {any} payload
 * @returns {SchemaViolation[]}
 */
export function payloadViolations(validate, payload) {
  const doc = JSON.parse(stringifyJson(payload)); // BigInt members become numbers, as every validator sees them
  if (validate(doc)) return [];
  const found = validate.errors.map((e) => {
    const at = segmentsOf(doc, pointerParts(e.instancePath));
    if (e.keyword === 'required') {
      const name = e.params.missingProperty;
      return { path: [...at, { name }], keyword: e.keyword, message: `missing property '${name}'` };
    }
    if (e.keyword === 'additionalProperties') {
      const name = e.params.additionalProperty;
      return { path: [...at, { name }], keyword: e.keyword, message: `additional property '${name}' is not allowed` };
    }
    return { path: at, keyword: e.keyword, message: e.message ?? e.keyword };
  });
  found.sort((a, b) => comparePaths(a.path, b.path) || compareText(a.keyword, b.keyword) || compareText(a.message, b.message));
  return found.map((v) => ({ field: `payload${pathText(v.path)}`, rule: RULE_SCHEMA, keyword: v.keyword, message: v.message }));
}

/** The dead-letter reason of a payload that breaks its schema: "schema: <path>: <message>; ...", at most 1,000 characters. */
export function schemaDeadLetterReason(violations) {
  const reason = `schema: ${violations.map((v) => `${v.field}: ${v.message}`).join('; ')}`;
  const chars = [...reason];
  return chars.length <= MAX_SCHEMA_REASON ? reason : `${chars.slice(0, MAX_SCHEMA_REASON - 1).join('')}…`;
}

/** The payload schemas of one prefix, read from Redis at most every `cacheMs`. */
export class PayloadSchemas {
  /**
   * @param {{ client: any, keys: import('./keys.js').KeySpace, cacheMs?: number, log: any }} options
   */
  constructor({ client, keys, cacheMs = SCHEMA_CACHE_MS, log }) {
    if (!Number.isSafeInteger(cacheMs) || cacheMs < 0) throw new RangeError(`schemaCacheMs must be an integer >= 0, not ${cacheMs}`);
    Object.assign(this, { client, keys, cacheMs, log });
    this.readAt = null;
    this.compiled = new Map(); // field -> { text, validate (null: ignored) }
    this.reading = null;
  }

  /**
   * The violations of `env`'s payload against the schema of its type and
   * version, sorted ([] without a schema). Throws Redis's error when the hash cannot be read.
   * @returns {Promise<SchemaViolation[]>}
   */
  async violations(env) {
    const entry = (await this.current()).get(schemaField(env.task_type, env.payload_version));
    return entry?.validate ? payloadViolations(entry.validate, env.payload) : [];
  }

  /** Throws InvalidEnvelope (rule schema, field payload<path>) when `env`'s payload breaks its schema. */
  async check(env) {
    const found = await this.violations(env);
    if (found.length) throw new InvalidEnvelope(found.map(({ field, rule, message }) => ({ field, rule, message })));
  }

  /** The compiled schemas, read again once cacheMs passed (one read at a time). */
  async current() {
    if (this.readAt !== null && Date.now() - this.readAt < this.cacheMs) return this.compiled;
    this.reading ??= this.read().finally(() => { this.reading = null; });
    return this.reading;
  }

  async read() {
    const stored = await this.client.hgetall(this.keys.schemas);
    const compiled = new Map();
    for (const [field, text] of Object.entries(stored)) {
      const had = this.compiled.get(field);
      compiled.set(field, had?.text === text ? had : { text, validate: this.usable(field, text) });
    }
    this.compiled = compiled;
    this.readAt = Date.now();
    return compiled;
  }

  /** A compiled schema, or null (logged) when it cannot be used. */
  usable(field, text) {
    try {
      return compileSchema(text);
    } catch (err) {
      this.log.warn('payload schema is ignored: it cannot be compiled', { err, schema: field });
      return null;
    }
  }
}
