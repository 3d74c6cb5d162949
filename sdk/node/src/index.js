// Public surface of the kombu-envelope Node.js SDK.
export * from './envelope.js';
export * from './codec.js';
export * from './keys.js';
export * from './retry.js';
export { parseOffset, formatOffset, parseRfc3339 } from './time.js';
export { Scripts, loadScripts, keyCount, LUA_DIR, SCRIPT_NAMES } from './scripts.js';
export { Producer, PUBLISH_DEDUPE_MS, WAITING } from './producer.js';
export { Worker, WORKER_DEFAULTS } from './worker.js';
export { InvalidLimits, PARKED_CONSUMER, TaskLimits, limitsToJson, validateLimits } from './limits.js';
export { InvalidRedisUrl, createRedis, parseRedisLocation, parseRedisUrl } from './url.js';
export { isRedisClient, reconnectOnFailover } from './connection.js';
export { RedisTlsError } from './tls.js';
export { ReplicaWait } from './replicas.js';
export { Promoter, redisNowMs } from './promoter.js';
export { DeadLetters, jsonMergePatch, readDeadLetter } from './deadletters.js';
export { cancelTask, CANCEL_MARK_TTL_MS } from './cancel.js';
export {
  InvalidResultRequest, ResultEncodeError, checkResult, encodeResult, formatDateDone, resultMeta, resultRequestOf,
} from './results.js';
export { OUTAGE_TOLERANCE_MS, isRedisAway } from './outage.js';
export { createLogger } from './log.js';
export { TASK_RECORD_RETENTION_MS, TASK_STATES } from './records.js';
export { ANNOUNCE_KEEP_MS, NotServed, accepts } from './announce.js';
export {
  PayloadSchemas, RULE_SCHEMA, SCHEMA_CACHE_MS, compileSchema, payloadViolations, schemaDeadLetterReason,
} from './schemas.js';
export { parseJson, stringifyJson, JsonSyntaxError } from './json.js';
export {
  HISTOGRAM_BOUNDS, HISTOGRAMS, OUTCOMES, STATS_KEEP_MS, TaskStatistics, UNDECODED_TASK_TYPE, bucketField,
} from './statistics.js';
export { MESSAGING_SYSTEM, TRACEPARENT_HEADER, TRACESTATE_HEADER, parseTraceparent } from './tracing.js';

/** @typedef {import('./producer.js').PublishResult} PublishResult */
/** @typedef {import('./producer.js').PublishOptions} PublishOptions */
/** @typedef {import('./producer.js').ProducerOptions} ProducerOptions */
/** @typedef {import('./cancel.js').CancelResult} CancelResult */
/** @typedef {import('./worker.js').Handler} Handler */
/** @typedef {import('./worker.js').HandlerSpec} HandlerSpec */
/** @typedef {import('./worker.js').TaskContext} TaskContext */
/** @typedef {import('./worker.js').WorkerOptions} WorkerOptions */
/** @typedef {import('./deadletters.js').DeadLetter} DeadLetter */
/** @typedef {import('./deadletters.js').ReplayEdit} ReplayEdit */
/** @typedef {import('./tasks.js').TaskInfo} TaskInfo */
/** @typedef {import('./announce.js').Announcement} Announcement */
/** @typedef {import('./schemas.js').SchemaViolation} SchemaViolation */
/** @typedef {import('./limits.js').Limits} Limits */
/** @typedef {import('./limits.js').Breaker} Breaker */
