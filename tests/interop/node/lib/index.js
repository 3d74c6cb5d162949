// Public surface of the Node.js Envelope peer.
export * from './envelope.js';
export * from './codec.js';
export * from './keys.js';
export * from './retry.js';
export { Scripts, loadScripts, keyCount, LUA_DIR, SCRIPT_NAMES } from './scripts.js';
export { Producer } from './producer.js';
export { Worker, WORKER_DEFAULTS, parseRedisUrl } from './worker.js';
export { Promoter, redisNowMs } from './promoter.js';
export { createLogger } from './log.js';
export { parseJson, stringifyJson, JsonSyntaxError } from './json.js';
