// Envelope <-> stream entry fields (docs/protocol.md section 3).
//
//   v     wire format version, exactly "1"
//   enc   "json" or "json+gzip" (case-sensitive)
//   body  the Envelope as UTF-8 JSON, gzip-compressed (one RFC 1952 member) for json+gzip
//   n     optional redelivery count; every other unknown field is ignored
//
// decodeEntry() turns any input whatsoever into an Envelope or a
// MalformedEntry whose `kind` says why (missing_field, version, encoding,
// gzip, too_large, envelope): a worker dead-letters it, it never drops it.

import zlib from 'node:zlib';
import { DEFAULT_LIMITS, envelopeToJson, formatViolation, validateEnvelope } from './envelope.js';

export const WIRE_VERSION = '1';
export const ENC_JSON = 'json';
export const ENC_JSON_GZIP = 'json+gzip';
export const DEFAULT_GZIP_MIN_BYTES = 8192;
/** Room for the fields other than payload in a body. */
export const BODY_OVERHEAD_BYTES = 256 * 1024;

export class MalformedEntry extends Error {
  constructor(kind, reason, violations = [], partial = null) {
    super(reason);
    this.name = 'MalformedEntry';
    this.kind = kind;
    this.reason = reason;
    this.violations = violations;
    // The decoded JSON object when the body was JSON but not a valid Envelope
    // (lets logs and dead-letter entries carry task_id/trace_id when known).
    this.partial = partial;
  }
}

export function maxBodyBytes(limits = DEFAULT_LIMITS) {
  return (limits.maxPayloadBytes ?? DEFAULT_LIMITS.maxPayloadBytes) + BODY_OVERHEAD_BYTES;
}

/**
 * Entry fields as a Map of name -> Buffer, from an ioredis reply array
 * ([name, value, ...]), a Map or a plain object; values may be Buffers or strings.
 */
export function entryFields(fields) {
  const out = new Map();
  const put = (name, value) => {
    const key = Buffer.isBuffer(name) ? name.toString('latin1') : String(name);
    out.set(key, Buffer.isBuffer(value) ? value : Buffer.from(String(value), 'utf8'));
  };
  if (Array.isArray(fields)) {
    for (let i = 0; i + 1 < fields.length; i += 2) put(fields[i], fields[i + 1]);
  } else if (fields instanceof Map) {
    for (const [name, value] of fields) put(name, value);
  } else if (fields && typeof fields === 'object') {
    for (const [name, value] of Object.entries(fields)) put(name, value);
  } else {
    throw new MalformedEntry('missing_field', 'entry is not a field/value mapping');
  }
  return out;
}

// CRC-32 (IEEE), for the gzip trailer; zlib.crc32 only exists in recent Node releases.
let crcTable = null;
function crc32(buf) {
  if (typeof zlib.crc32 === 'function') return zlib.crc32(buf) >>> 0;
  if (!crcTable) {
    crcTable = new Uint32Array(256);
    for (let n = 0; n < 256; n += 1) {
      let c = n;
      for (let k = 0; k < 8; k += 1) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
      crcTable[n] = c >>> 0;
    }
  }
  let crc = 0xffffffff;
  for (let i = 0; i < buf.length; i += 1) crc = crcTable[(crc ^ buf[i]) & 0xff] ^ (crc >>> 8);
  return (crc ^ 0xffffffff) >>> 0;
}

const gzipError = (detail) => new MalformedEntry('gzip', `body is not valid gzip: ${detail}`);

// Length of the RFC 1952 member header at the start of buf.
function gzipHeaderLength(buf) {
  if (buf.length < 10 || buf[0] !== 0x1f || buf[1] !== 0x8b) throw gzipError('no gzip magic number');
  if (buf[2] !== 8) throw gzipError('compression method is not deflate');
  const flags = buf[3];
  if (flags & 0xe0) throw gzipError('reserved header flags are set');
  let pos = 10;
  if (flags & 0x04) {
    if (pos + 2 > buf.length) throw gzipError('truncated header');
    pos += 2 + buf.readUInt16LE(pos);
  }
  for (const bit of [0x08, 0x10]) {
    if (flags & bit) {
      const end = buf.indexOf(0, pos);
      if (end < 0) throw gzipError('truncated header');
      pos = end + 1;
    }
  }
  if (flags & 0x02) {
    if (pos + 2 > buf.length) throw gzipError('truncated header');
    if ((crc32(buf.subarray(0, pos)) & 0xffff) !== buf.readUInt16LE(pos)) throw gzipError('header CRC mismatch');
    pos += 2;
  }
  if (pos > buf.length) throw gzipError('truncated header');
  return pos;
}

/** Inflate exactly one gzip member; refuse trailing data, bad checksums and bombs. */
export function inflateBody(body, limits = DEFAULT_LIMITS) {
  const max = maxBodyBytes(limits);
  const start = gzipHeaderLength(body);
  let result;
  try {
    result = zlib.inflateRawSync(body.subarray(start), { info: true, maxOutputLength: max + 1 });
  } catch (err) {
    if (err && (err.code === 'ERR_BUFFER_TOO_LARGE' || err instanceof RangeError)) {
      throw new MalformedEntry('too_large', `body too large: gzip body inflates beyond ${max} bytes`);
    }
    throw gzipError(err && err.code === 'Z_BUF_ERROR' ? 'the gzip stream is truncated' : String(err && err.message));
  }
  const data = result.buffer;
  if (data.length > max) throw new MalformedEntry('too_large', `body too large: gzip body inflates beyond ${max} bytes`);
  const trailerAt = start + result.engine.bytesWritten;
  if (body.length < trailerAt + 8) throw gzipError('the gzip stream is truncated');
  if (body.length > trailerAt + 8) throw gzipError('data after the end of the gzip stream');
  if (body.readUInt32LE(trailerAt) !== crc32(data)) throw gzipError('CRC-32 mismatch');
  if (body.readUInt32LE(trailerAt + 4) !== (data.length % 2 ** 32)) throw gzipError('length mismatch');
  return data;
}

/** Decode a body written with encoding `enc`; throws MalformedEntry. */
export function decodeBody(enc, body, limits = DEFAULT_LIMITS) {
  const encText = Buffer.isBuffer(enc) ? enc.toString('utf8') : String(enc);
  let json = body;
  if (encText === ENC_JSON_GZIP) json = inflateBody(body, limits);
  else if (encText !== ENC_JSON) throw new MalformedEntry('encoding', `unknown encoding ${JSON.stringify(encText)}`);
  else if (body.length > maxBodyBytes(limits)) {
    throw new MalformedEntry('too_large', `body too large: ${body.length} bytes, above the limit of ${maxBodyBytes(limits)}`);
  }
  const result = validateEnvelope(json, { limits });
  if (!result.ok) {
    let partial = null;
    try {
      const parsed = JSON.parse(json.toString('utf8'));
      if (parsed && typeof parsed === 'object' && !Array.isArray(parsed)) partial = parsed;
    } catch {
      // not JSON at all: nothing to salvage
    }
    throw new MalformedEntry('envelope', `invalid envelope: ${result.violations.map(formatViolation).join('; ')}`,
      result.violations, partial);
  }
  return result.envelope;
}

/** Decode stream entry fields into an Envelope; throws MalformedEntry for any bad input. */
export function decodeEntry(fields, { limits = DEFAULT_LIMITS } = {}) {
  const map = entryFields(fields);
  const get = (name) => {
    const value = map.get(name);
    if (value === undefined) throw new MalformedEntry('missing_field', `missing field '${name}'`);
    return value;
  };
  const version = get('v');
  if (version.toString('latin1') !== WIRE_VERSION) {
    throw new MalformedEntry('version', `unsupported wire version ${JSON.stringify(version.toString('utf8'))}`);
  }
  const enc = get('enc');
  const body = get('body');
  return decodeBody(enc, body, limits);
}

/**
 * { enc, body } for an Envelope: gzip (level 6, mtime 0) from gzipMinBytes of JSON on,
 * except with an ordering_key, always plain JSON: the scripts read the key from the body
 * (docs/protocol.md section 20).
 */
export function encodeBody(env, { gzipMinBytes = DEFAULT_GZIP_MIN_BYTES, limits = DEFAULT_LIMITS } = {}) {
  const json = Buffer.from(envelopeToJson(env), 'utf8');
  const limit = maxBodyBytes(limits);
  if (json.length > limit) {
    throw new MalformedEntry('too_large', `the Envelope is ${json.length} bytes of JSON, above the limit of ${limit}`);
  }
  const keyed = env.ordering_key !== null && env.ordering_key !== undefined;
  if (gzipMinBytes !== null && json.length >= gzipMinBytes && !keyed) {
    return { enc: ENC_JSON_GZIP, body: zlib.gzipSync(json, { level: 6 }) };
  }
  return { enc: ENC_JSON, body: json };
}

/** The fields of the stream entry that stores `env`. */
export function encodeEntry(env, options = {}) {
  const { enc, body } = encodeBody(env, options);
  return { v: WIRE_VERSION, enc, body };
}
