// Strict JSON (RFC 8259) reading and canonical writing.
//
// JSON.parse is not enough for the Envelope rules:
//   - it cannot tell `1`, `1.0` and `1e2` apart, and the integer fields of an
//     Envelope must be written as integer literals;
//   - it silently rounds integers beyond 2**53, which turns one order id into
//     another. Here such integers are read as BigInt and written back exactly.
// The parser also keeps the source text of every top-level member, so the
// validator can check how an integer field was written.

export class JsonSyntaxError extends Error {
  constructor(message, position) {
    super(position === undefined ? message : `${message} at position ${position}`);
    this.name = 'JsonSyntaxError';
    this.position = position;
  }
}

const MAX_NESTING = 512;
const INTEGER_LITERAL = /^-?(?:0|[1-9][0-9]*)$/;
const NUMBER_LITERAL = /-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/y;
const ESCAPES = { '"': '"', '\\': '\\', '/': '/', b: '\b', f: '\f', n: '\n', r: '\r', t: '\t' };

/** True when `text` is written as a JSON integer literal (no fraction, no exponent). */
export function isIntegerLiteral(text) {
  return INTEGER_LITERAL.test(text);
}

function setMember(object, key, value) {
  if (key === '__proto__') {
    Object.defineProperty(object, key, { value, enumerable: true, writable: true, configurable: true });
  } else {
    object[key] = value;
  }
}

class Parser {
  constructor(text) {
    this.text = text;
    this.pos = 0;
    this.depth = 0;
    this.topLevelRaw = null;
  }

  fail(message) {
    throw new JsonSyntaxError(message, this.pos);
  }

  skipWhitespace() {
    const { text } = this;
    let { pos } = this;
    while (pos < text.length) {
      const c = text.charCodeAt(pos);
      if (c !== 0x20 && c !== 0x0a && c !== 0x0d && c !== 0x09) break;
      pos += 1;
    }
    this.pos = pos;
  }

  parseDocument() {
    this.skipWhitespace();
    const value = this.parseValue(true);
    this.skipWhitespace();
    if (this.pos !== this.text.length) this.fail('unexpected data after the JSON value');
    return value;
  }

  parseValue(top = false) {
    const c = this.text[this.pos];
    if (c === '{') return this.parseObject(top);
    if (c === '[') return this.parseArray();
    if (c === '"') return this.parseString();
    if (c === 't') return this.parseWord('true', true);
    if (c === 'f') return this.parseWord('false', false);
    if (c === 'n') return this.parseWord('null', null);
    if (c === '-' || (c >= '0' && c <= '9')) return this.parseNumber();
    if (c === undefined) this.fail('unexpected end of JSON input');
    return this.fail(`unexpected character ${JSON.stringify(c)}`);
  }

  parseWord(word, value) {
    if (this.text.startsWith(word, this.pos)) {
      this.pos += word.length;
      return value;
    }
    return this.fail('invalid literal');
  }

  parseNumber() {
    NUMBER_LITERAL.lastIndex = this.pos;
    const match = NUMBER_LITERAL.exec(this.text);
    if (!match) this.fail('invalid number');
    const literal = match[0];
    const next = this.text[this.pos + literal.length];
    if (next !== undefined && /[0-9.eE+-]/.test(next)) this.fail('invalid number');
    this.pos += literal.length;
    if (isIntegerLiteral(literal)) {
      const value = Number(literal);
      return Number.isSafeInteger(value) ? value : BigInt(literal);
    }
    return Number(literal);
  }

  parseString() {
    const { text } = this;
    let pos = this.pos + 1;
    let out = '';
    let chunkStart = pos;
    for (;;) {
      if (pos >= text.length) {
        this.pos = pos;
        this.fail('unterminated string');
      }
      const c = text.charCodeAt(pos);
      if (c === 0x22) break;
      if (c < 0x20) {
        this.pos = pos;
        this.fail('control character in string');
      }
      if (c === 0x5c) {
        out += text.slice(chunkStart, pos);
        const e = text[pos + 1];
        if (e === 'u') {
          const hex = text.slice(pos + 2, pos + 6);
          if (!/^[0-9a-fA-F]{4}$/.test(hex)) {
            this.pos = pos;
            this.fail('invalid \\u escape');
          }
          out += String.fromCharCode(parseInt(hex, 16));
          pos += 6;
        } else if (e !== undefined && Object.hasOwn(ESCAPES, e)) {
          out += ESCAPES[e];
          pos += 2;
        } else {
          this.pos = pos;
          this.fail('invalid escape');
        }
        chunkStart = pos;
        continue;
      }
      pos += 1;
    }
    out += text.slice(chunkStart, pos);
    if (!out.isWellFormed()) {
      this.pos = pos;
      this.fail('lone surrogate in string (not encodable as UTF-8)');
    }
    this.pos = pos + 1;
    return out;
  }

  enter() {
    this.depth += 1;
    if (this.depth > MAX_NESTING) this.fail(`nested deeper than ${MAX_NESTING} levels`);
  }

  parseArray() {
    this.enter();
    this.pos += 1;
    const out = [];
    this.skipWhitespace();
    if (this.text[this.pos] === ']') {
      this.pos += 1;
      this.depth -= 1;
      return out;
    }
    for (;;) {
      this.skipWhitespace();
      out.push(this.parseValue());
      this.skipWhitespace();
      const c = this.text[this.pos];
      this.pos += 1;
      if (c === ']') break;
      if (c !== ',') {
        this.pos -= 1;
        this.fail("expected ',' or ']'");
      }
    }
    this.depth -= 1;
    return out;
  }

  parseObject(top) {
    this.enter();
    this.pos += 1;
    const out = {};
    const raw = top ? new Map() : null;
    this.skipWhitespace();
    if (this.text[this.pos] === '}') {
      this.pos += 1;
      this.depth -= 1;
      if (top) this.topLevelRaw = raw;
      return out;
    }
    for (;;) {
      this.skipWhitespace();
      if (this.text[this.pos] !== '"') this.fail('expected a string key');
      const key = this.parseString();
      this.skipWhitespace();
      if (this.text[this.pos] !== ':') this.fail("expected ':'");
      this.pos += 1;
      this.skipWhitespace();
      const start = this.pos;
      setMember(out, key, this.parseValue());
      if (raw) raw.set(key, this.text.slice(start, this.pos));
      this.skipWhitespace();
      const c = this.text[this.pos];
      this.pos += 1;
      if (c === '}') break;
      if (c !== ',') {
        this.pos -= 1;
        this.fail("expected ',' or '}'");
      }
    }
    this.depth -= 1;
    if (top) this.topLevelRaw = raw;
    return out;
  }
}

/**
 * Parse JSON text strictly. Returns `{ value, raw }` where `raw` maps each
 * member of a top-level object to its source text (null for other documents).
 * Integers beyond Number.MAX_SAFE_INTEGER come back as BigInt. Throws
 * JsonSyntaxError.
 */
export function parseJson(text) {
  if (typeof text !== 'string') throw new TypeError('parseJson expects a string');
  const parser = new Parser(text);
  const value = parser.parseDocument();
  return { value, raw: parser.topLevelRaw };
}

/**
 * Compact JSON of a JSON value (what JSON.stringify writes, plus BigInt as
 * exact digits). Throws TypeError for anything JSON cannot hold (NaN,
 * Infinity, undefined, functions, symbols, class instances).
 */
export function stringifyJson(value) {
  switch (typeof value) {
    case 'string':
      return JSON.stringify(value);
    case 'boolean':
      return value ? 'true' : 'false';
    case 'bigint':
      return value.toString();
    case 'number':
      if (!Number.isFinite(value)) throw new TypeError(`${value} is not a JSON number`);
      return JSON.stringify(value);
    case 'object': {
      if (value === null) return 'null';
      if (Array.isArray(value)) return `[${value.map((item) => stringifyJson(item)).join(',')}]`;
      const proto = Object.getPrototypeOf(value);
      if (proto !== Object.prototype && proto !== null) {
        throw new TypeError(`${proto?.constructor?.name ?? 'object'} is not a JSON value`);
      }
      const parts = [];
      for (const key of Object.keys(value)) {
        if (value[key] === undefined) continue;
        parts.push(`${JSON.stringify(key)}:${stringifyJson(value[key])}`);
      }
      return `{${parts.join(',')}}`;
    }
    default:
      throw new TypeError(`${typeof value} is not a JSON value`);
  }
}
