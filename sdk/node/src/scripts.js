// The shared Lua scripts, loaded as they are: the package's own copy in lua/
// (copied from the repository's kombu_envelope/lua/ by sdk/sync_lua.py, never edited).
//
// Each file documents its KEYS and ARGV in its header; the number of keys is
// read from there ("KEYS[1..n]", or a key marked "optional", means the caller
// passes the keys' count).
// ioredis runs them with EVALSHA and falls back to EVAL when the server does
// not know the script yet.

import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

/** The package's lua/ folder (one level above src/ and dist/). */
export const LUA_DIR = fileURLToPath(new URL('../lua/', import.meta.url));

/** The scripts this peer runs; every other *.lua file of the folder is loaded too. */
export const SCRIPT_NAMES = Object.freeze([
  'enqueue', 'schedule', 'promote', 'read', 'requeue', 'dead_letter', 'retry', 'cancel',
  'idem_begin', 'idem_finish', 'retry_slot', 'forget_consumer',
]);

/**
 * Number of KEYS a script takes according to its header, or null when variable
 * ("KEYS[1..n]", or a key documented as optional: the caller passes the count).
 */
export function keyCount(lua) {
  const header = lua.split('\n').filter((line) => line.startsWith('--')).join('\n');
  if (/KEYS\[\d+\.\.\w+\]/.test(header) || /KEYS\[\d+\]\s+optional/.test(header)) return null;
  const indexes = [...header.matchAll(/KEYS\[(\d+)\]/g)].map((m) => Number(m[1]));
  if (!indexes.length) throw new Error('script header documents no KEYS');
  return Math.max(...indexes);
}

/** Map of script name -> { lua, numberOfKeys } of every *.lua file in `dir`. */
export function loadScripts(dir = process.env.ENVELOPE_LUA_DIR || LUA_DIR) {
  const scripts = new Map();
  const names = fs.readdirSync(dir).filter((f) => f.endsWith('.lua')).map((f) => f.slice(0, -4)).sort();
  for (const name of SCRIPT_NAMES) {
    if (!names.includes(name)) throw new Error(`${name}.lua is missing from ${dir}`);
  }
  for (const name of names) {
    const lua = fs.readFileSync(path.join(dir, `${name}.lua`), 'utf8');
    scripts.set(name, { lua, numberOfKeys: keyCount(lua) });
  }
  return scripts;
}

const commandName = (name) => `envelope_${name}`;

/** The scripts defined on one ioredis client (or cluster). */
export class Scripts {
  constructor(client, dir) {
    this.client = client;
    this.defs = loadScripts(dir);
    for (const [name, { lua, numberOfKeys }] of this.defs) {
      const options = numberOfKeys === null ? { lua } : { lua, numberOfKeys };
      client.defineCommand(commandName(name), options);
    }
  }

  args(name, keys, args) {
    const def = this.defs.get(name);
    if (!def) throw new Error(`unknown script ${name}`);
    if (def.numberOfKeys !== null && keys.length !== def.numberOfKeys) {
      throw new Error(`${name}.lua takes ${def.numberOfKeys} keys, got ${keys.length}`);
    }
    const flat = [...keys, ...args.map((a) => (Buffer.isBuffer(a) ? a : String(a)))];
    return def.numberOfKeys === null ? [keys.length, ...flat] : flat;
  }

  /** Run a script; replies as strings. `on` may be a pipeline/multi of the same client. */
  run(name, keys, args, on = this.client) {
    return on[commandName(name)](...this.args(name, keys, args));
  }

  /** Run a script; bulk replies as Buffers (for entries). */
  runBuffer(name, keys, args, on = this.client) {
    return on[`${commandName(name)}Buffer`](...this.args(name, keys, args));
  }
}
