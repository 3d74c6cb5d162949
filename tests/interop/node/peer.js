#!/usr/bin/env node
// Command line of the Node.js Envelope peer: the kombu-envelope SDK (sdk/node) used as
// any service would, for the cross-language tests.
//
//   node peer.js produce --redis URL --prefix P --queue Q --task-type T --payload JSON
//        [--delay-ms N | --schedule-time RFC3339] [--tz-offset +08:00] [--idempotency-key K]
//        [--trace-id ID] [--task-id ID] [--max-retries N|null] [--priority N] [--timeout-ms N]
//        [--payload-version N] [--retry-policy tiered] [--json]
//   node peer.js produce-malformed --redis URL --prefix P --queue Q
//        --kind badjson|missingbody|badversion|badgzip|invalid [--priority N]
//   node peer.js worker --redis URL --prefix P --queue Q [--lease-ms N] [--backoff-ms N]
//        [--max-backoff-ms N] [--fast-retries N] [--retry-concurrency N] [--concurrency N] [--prefetch N]
//        [--block-ms N] [--max-redeliveries N] [--defer-ms N] [--shutdown-grace-ms N] [--no-promoter]
//   node peer.js validate [--file PATH]      (Envelope JSON from a file or stdin)
//   node peer.js dead-list --redis URL --prefix P --queue Q [--failure-class C] [--task-type T]
//   node peer.js dead-replay --redis URL --prefix P --queue Q --id ID [--merge-patch JSON]
//        [--payload JSON] [--payload-version N] [--max-retries N|null] [--operator NAME]

import fs from 'node:fs';
import Redis from 'ioredis';
import {
  DeadLetters, InvalidEnvelope, KeySpace, Producer, RETRY_POLICY_HEADER, TimeError, Timestamp, Worker, bucketFor, createLogger,
  parseJson, parseOffset, parseRedisUrl, validateEnvelope,
} from 'kombu-envelope';
// The SDK's own test handlers: the same module instance as the SDK (npm links file: deps).
import { registerBuiltinHandlers } from '../../../sdk/node/support/handlers.js';

class UsageError extends Error {}

const FLAGS = new Set(['json', 'no-promoter', 'publish']);

function parseArgs(argv) {
  const [command, ...rest] = argv;
  const args = {};
  for (let i = 0; i < rest.length; i += 1) {
    const token = rest[i];
    if (!token.startsWith('--')) throw new UsageError(`unexpected argument ${token}`);
    const name = token.slice(2);
    if (FLAGS.has(name)) {
      args[name] = true;
      continue;
    }
    if (i + 1 >= rest.length) throw new UsageError(`${token} needs a value`);
    args[name] = rest[i + 1];
    i += 1;
  }
  return { command, args };
}

function required(args, name) {
  if (args[name] === undefined || args[name] === '') throw new UsageError(`--${name} is required`);
  return args[name];
}

function integer(args, name, { min = 0, fallback } = {}) {
  const raw = args[name];
  if (raw === undefined) return fallback;
  if (!/^-?[0-9]+$/.test(raw) || !Number.isSafeInteger(Number(raw)) || Number(raw) < min) {
    throw new UsageError(`--${name} must be an integer >= ${min}, not ${JSON.stringify(raw)}`);
  }
  return Number(raw);
}

function redisClient(args) {
  return new Redis({ ...parseRedisUrl(required(args, 'redis')), connectionName: 'envelope-node-cli' });
}

async function produce(args) {
  const offsetMinutes = args['tz-offset'] === undefined ? 0 : parseOffset(args['tz-offset']);
  if (args['delay-ms'] !== undefined && args['schedule-time'] !== undefined) {
    throw new UsageError('give --delay-ms or --schedule-time, not both');
  }
  let payload = {};
  if (args.payload !== undefined) {
    try {
      payload = parseJson(args.payload).value;
    } catch (err) {
      throw new UsageError(`--payload is not JSON: ${err.message}`);
    }
  }
  const nowMs = Date.now();
  const fields = {
    task_type: required(args, 'task-type'),
    payload,
    created_at: Timestamp.fromEpochMs(nowMs, offsetMinutes).toString(),
  };
  if (args['delay-ms'] !== undefined) {
    fields.schedule_time = Timestamp.fromEpochMs(nowMs + integer(args, 'delay-ms'), offsetMinutes).toString();
  } else if (args['schedule-time'] !== undefined) {
    const when = Timestamp.parse(args['schedule-time']);
    fields.schedule_time = (args['tz-offset'] === undefined ? when : when.withOffset(offsetMinutes)).toString();
  }
  const optional = {
    'idempotency-key': 'idempotency_key', 'trace-id': 'trace_id', 'task-id': 'task_id',
  };
  for (const [flag, field] of Object.entries(optional)) if (args[flag] !== undefined) fields[field] = args[flag];
  if (args['max-retries'] !== undefined) fields.max_retries = args['max-retries'] === 'null' ? null : integer(args, 'max-retries');
  if (args.priority !== undefined) fields.priority = integer(args, 'priority');
  if (args['timeout-ms'] !== undefined) fields.timeout_ms = integer(args, 'timeout-ms', { min: 1 });
  if (args['payload-version'] !== undefined) fields.payload_version = integer(args, 'payload-version', { min: 1 });
  if (args['retry-policy'] !== undefined) fields.headers = { [RETRY_POLICY_HEADER]: args['retry-policy'] };

  const client = redisClient(args);
  try {
    const producer = new Producer(client, { prefix: args.prefix ?? 'envelope' });
    const result = await producer.publish(required(args, 'queue'), fields, { nowMs });
    if (args.json) {
      process.stdout.write(`${JSON.stringify({
        task_id: result.taskId, trace_id: result.envelope.trace_id, entry_id: result.entryId,
        delayed: result.delayed, due_ms: result.dueMs, schedule_time: result.envelope.schedule_time,
        created_at: result.envelope.created_at,
      })}\n`);
    } else {
      process.stdout.write(`${result.taskId}\n`);
    }
  } finally {
    client.disconnect();
  }
}

// Entries no reader may accept; each must end in the dead-letter stream, bytes intact.
const MALFORMED = {
  badjson: () => ({ v: '1', enc: 'json', body: Buffer.from('{"task_type": "order.close_timeout", "payload": {', 'utf8') }),
  missingbody: () => ({ v: '1', enc: 'json' }),
  badversion: () => ({ v: '2', enc: 'json', body: Buffer.from('{"task_type":"order.close_timeout","payload":{"order_id":"v2"}}', 'utf8') }),
  // A gzip header followed by bytes that are neither deflate data nor UTF-8.
  badgzip: () => ({ v: '1', enc: 'json+gzip', body: Buffer.from([0x1f, 0x8b, 0x08, 0x00, 0, 0, 0, 0, 0x00, 0x03, 0xff, 0xfe, 0x00, 0x80, 0xc3, 0x28, 0x0a]) }),
  // Valid JSON, invalid Envelope: an epoch in milliseconds as schedule_time.
  invalid: () => ({ v: '1', enc: 'json', body: Buffer.from('{"task_id":"malformed-invalid","trace_id":"trace-malformed","created_at":"2025-09-11T12:45:00+08:00","task_type":"order.close_timeout","payload":{"order_id":"x"},"schedule_time":1757565900000}', 'utf8') }),
};

async function produceMalformed(args) {
  const kind = required(args, 'kind');
  if (!Object.hasOwn(MALFORMED, kind)) throw new UsageError(`--kind must be one of ${Object.keys(MALFORMED).join(', ')}`);
  const fields = MALFORMED[kind]();
  const qk = new KeySpace(args.prefix ?? 'envelope').queue(required(args, 'queue'));
  const stream = qk.stream(bucketFor(integer(args, 'priority', { fallback: 100 })));
  const client = redisClient(args);
  try {
    const flat = Object.entries(fields).flat();
    const entryId = await client.xadd(stream, '*', ...flat);
    const encoded = Object.fromEntries(Object.entries(fields).map(([k, v]) => [k, Buffer.from(v).toString('base64')]));
    process.stdout.write(`${JSON.stringify({ kind, stream, entry_id: entryId, fields_base64: encoded })}\n`);
  } finally {
    client.disconnect();
  }
}

async function runWorker(args) {
  const log = createLogger();
  const worker = new Worker({
    redis: required(args, 'redis'),
    prefix: args.prefix ?? 'envelope',
    queue: required(args, 'queue'),
    group: args.group,
    leaseMs: integer(args, 'lease-ms', { min: 3 }),
    blockMs: integer(args, 'block-ms', { min: 1 }),
    backoffMs: integer(args, 'backoff-ms', { min: 1 }),
    maxBackoffMs: integer(args, 'max-backoff-ms', { min: 1 }),
    fastRetries: integer(args, 'fast-retries'),
    retryConcurrency: integer(args, 'retry-concurrency', { min: 1 }),
    concurrency: integer(args, 'concurrency', { min: 1 }),
    prefetch: integer(args, 'prefetch', { min: 1 }),
    maxRedeliveries: integer(args, 'max-redeliveries'),
    deferMs: integer(args, 'defer-ms', { min: 1 }),
    shutdownGraceMs: integer(args, 'shutdown-grace-ms'),
    promoter: !args['no-promoter'],
    logger: log,
  });
  registerBuiltinHandlers(worker);
  let exitCode = 0;
  const stop = (why) => {
    worker.log.info('stop requested', { why });
    worker.stop().then(() => process.exit(exitCode), (err) => {
      worker.log.error('unclean stop', { err });
      process.exit(1);
    });
  };
  process.once('SIGTERM', () => stop('SIGTERM'));
  process.once('SIGINT', () => stop('SIGINT'));
  process.on('unhandledRejection', (err) => worker.log.error('unhandled promise rejection', { err }));
  process.on('uncaughtException', (err) => {
    // A handler threw outside its promise (e.g. in a timer): stop cleanly and exit 1.
    worker.log.error('uncaught exception; stopping', { err });
    exitCode = 1;
    stop('uncaughtException');
  });
  await worker.start();
}

async function validate(args) {
  const input = fs.readFileSync(args.file ?? 0);
  const result = validateEnvelope(input, { publish: Boolean(args.publish) });
  process.stdout.write(`${JSON.stringify(result.ok ? { valid: true, envelope: result.envelope } : { valid: false, violations: result.violations }, (_, v) => (typeof v === 'bigint' ? v.toString() : v))}\n`);
  if (!result.ok) process.exitCode = 1;
}

function jsonArg(args, name) {
  if (args[name] === undefined) return undefined;
  try {
    return parseJson(args[name]).value;
  } catch (err) {
    throw new UsageError(`--${name} is not JSON: ${err.message}`);
  }
}

const bigintSafe = (_, v) => (typeof v === 'bigint' ? v.toString() : v);

/** One JSON line per dead-letter entry of the queue (the SDK's DeadLetters). */
async function deadList(args) {
  const client = redisClient(args);
  try {
    const tools = new DeadLetters(client, { prefix: args.prefix ?? 'envelope' });
    const where = { failureClass: args['failure-class'], taskType: args['task-type'], limit: integer(args, 'limit', { min: 1, fallback: 1000 }) };
    for (const entry of await tools.list(required(args, 'queue'), where)) {
      process.stdout.write(`${JSON.stringify({
        id: entry.id, task_id: entry.taskId, task_type: entry.taskType, failure_class: entry.failureClass,
        fields: entry.fields, envelope: entry.envelope, decode_error: entry.decodeError,
      }, bigintSafe)}\n`);
    }
  } finally {
    client.disconnect();
  }
}

/** Replay one dead-letter entry, edited; prints the new entry id (exit 3 when it is gone). */
async function deadReplay(args) {
  const client = redisClient(args);
  try {
    const tools = new DeadLetters(client, { prefix: args.prefix ?? 'envelope' });
    const edit = { payload: jsonArg(args, 'payload'), mergePatch: jsonArg(args, 'merge-patch'), operator: args.operator };
    if (args['payload-version'] !== undefined) edit.payloadVersion = integer(args, 'payload-version', { min: 1 });
    if (args['max-retries'] !== undefined) edit.maxRetries = args['max-retries'] === 'null' ? null : integer(args, 'max-retries');
    const newId = await tools.replay(required(args, 'queue'), required(args, 'id'), edit);
    if (newId === null) {
      process.stderr.write('peer.js: the dead-letter entry is gone (replayed or purged)\n');
      process.exitCode = 3;
      return;
    }
    process.stdout.write(`${newId}\n`);
  } finally {
    client.disconnect();
  }
}

const COMMANDS = {
  produce, 'produce-malformed': produceMalformed, worker: runWorker, validate,
  'dead-list': deadList, 'dead-replay': deadReplay,
};

async function main() {
  const { command, args } = parseArgs(process.argv.slice(2));
  const run = COMMANDS[command];
  if (!run) throw new UsageError(`usage: peer.js ${Object.keys(COMMANDS).join('|')} [--option value ...]`);
  await run(args);
}

main().catch((err) => {
  if (err instanceof UsageError || err instanceof TimeError) {
    process.stderr.write(`peer.js: ${err.message}\n`);
    process.exit(64);
  }
  if (err instanceof InvalidEnvelope) {
    process.stderr.write(`${JSON.stringify({ error: 'invalid envelope', violations: err.violations })}\n`);
    process.exit(65);
  }
  process.stderr.write(`peer.js: ${err.stack ?? err}\n`);
  process.exit(1);
});
