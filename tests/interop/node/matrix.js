#!/usr/bin/env node
// The Node.js process of the cross-language matrix (tests/test_matrix.py), over the SDK
// as any service uses it:
//
//   node matrix.js --redis URL --prefix P [--work Q1,Q2,...] [--results URL] [--concurrency N]
//
// It works the queues of --work with the matrix handlers (matrix.task: matrix-handler.js;
// limits.task: limits-handler.js), each worker running up to --concurrency tasks at once
// (default 1), and answers
// JSON-line commands on stdin with one JSON line each on stdout:
//
//   {"id": 1, "op": "publish", "queue": Q, "tasks": [TASK, ...]}      -> {"id": 1, "ok": true, "task_ids": [...]}
//   {"id": 2, "op": "replay", "queue": Q, "entry_id": E, "payload": {...}} -> {"id": 2, "ok": true, "entry_id": NEW}
//   {"id": 3, "op": "consume", "queue": Q}                             -> {"id": 3, "ok": true}
//   {"id": 4, "op": "cancel", "task_ids": [...]}                      -> {"id": 4, "ok": true, "outcomes": [{outcome, queue}, ...]}
//
// TASK is {task_id, task_type, payload, schedule_time, expires, max_retries (absent: 3,
// null: unlimited), retry_policy, idempotency_key, ordering_key, headers (string values,
// e.g. traceparent and tracestate)}: every Envelope field it has is passed through, with
// retry_policy added to the headers. A failed command answers
// {"id": N, "ok": false, "error": "..."}. The process ends when stdin closes or on SIGTERM.
// Workers write the results Celery callers ask for to the Redis of --results (default --redis).

import readline from 'node:readline';
import Redis from 'ioredis';
import {
  DeadLetters, FIELDS, Producer, RETRY_POLICY_HEADER, Worker, createLogger, parseRedisUrl,
} from 'kombu-envelope';
import { registerLimitsHandler } from './limits-handler.js';
import { registerMatrixHandler } from './matrix-handler.js';

function parseArgs(argv) {
  const args = {};
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith('--') || i + 1 >= argv.length) throw new Error(`bad argument ${argv[i]}`);
    args[argv[i].slice(2)] = argv[i + 1];
  }
  if (!args.redis || !args.prefix) throw new Error('--redis and --prefix are required');
  const concurrency = Number(args.concurrency ?? 1);
  if (!Number.isSafeInteger(concurrency) || concurrency < 1) throw new Error(`--concurrency must be an integer >= 1, not ${args.concurrency}`);
  return { ...args, concurrency };
}

/** The Envelope fields a TASK of a publish command describes: each Envelope field it has, retry_policy in the headers. */
function fieldsOf(task) {
  const fields = Object.fromEntries(FIELDS.filter((name) => task[name] !== undefined).map((name) => [name, task[name]]));
  fields.payload ??= {};
  if (task.retry_policy !== undefined) fields.headers = { ...task.headers, [RETRY_POLICY_HEADER]: task.retry_policy };
  return fields;
}

class MatrixPeer {
  constructor(args) {
    this.args = args;
    this.client = new Redis({ ...parseRedisUrl(args.redis), connectionName: 'envelope-node-matrix' });
    this.producer = new Producer(this.client, { prefix: args.prefix });
    this.dead = new DeadLetters(this.client, { prefix: args.prefix });
    this.log = createLogger();
    this.workers = [];
  }

  /** Start a worker on `queue`; the first one also runs this process's promoter. */
  async consume(queue) {
    const worker = new Worker({
      redis: this.args.redis, prefix: this.args.prefix, queue, leaseMs: 3000, blockMs: 200, concurrency: this.args.concurrency,
      backoffMs: 200, maxBackoffMs: 1000, deferMs: 300, promoter: this.workers.length === 0,
      resultBackend: this.args.results ?? this.args.redis, logger: this.log,
    });
    registerMatrixHandler(worker, this.producer);
    registerLimitsHandler(worker);
    this.workers.push(worker);
    worker.start().catch((err) => this.log.error('worker stopped', { queue, err }));
  }

  async answer(line) {
    let command;
    try {
      command = JSON.parse(line);
    } catch (err) {
      return { ok: false, error: `command is not JSON: ${err.message}` };
    }
    const { id, op, queue } = command;
    try {
      switch (op) {
        case 'publish': {
          const taskIds = [];
          for (const task of command.tasks) taskIds.push((await this.producer.publish(queue, fieldsOf(task))).taskId);
          return { id, ok: true, task_ids: taskIds };
        }
        case 'replay': {
          const edit = { operator: 'matrix' };
          if (command.payload !== undefined) edit.payload = command.payload;
          return { id, ok: true, entry_id: await this.dead.replay(queue, command.entry_id, edit) };
        }
        case 'consume':
          await this.consume(queue);
          return { id, ok: true };
        case 'cancel': {
          const outcomes = [];
          for (const taskId of command.task_ids) outcomes.push(await this.producer.cancel(taskId));
          return { id, ok: true, outcomes };
        }
        default:
          throw new Error(`unknown op ${JSON.stringify(op)}`);
      }
    } catch (err) {
      return { id, ok: false, error: String(err?.message ?? err) };
    }
  }

  async close() {
    await Promise.allSettled(this.workers.map((worker) => worker.stop()));
    this.client.disconnect();
  }
}

async function main() {
  const peer = new MatrixPeer(parseArgs(process.argv.slice(2)));
  for (const queue of (peer.args.work ?? '').split(',').filter(Boolean)) await peer.consume(queue);
  let closing = null;
  const close = () => {
    closing ??= peer.close().then(() => process.exit(0));
    return closing;
  };
  process.once('SIGTERM', close);
  process.once('SIGINT', close);
  process.stdout.write(`${JSON.stringify({ ready: true, language: 'node' })}\n`);
  const lines = readline.createInterface({ input: process.stdin, crlfDelay: Infinity });
  // Commands are answered in order, one at a time.
  let queue = Promise.resolve();
  lines.on('line', (line) => {
    queue = queue.then(async () => process.stdout.write(`${JSON.stringify(await peer.answer(line))}\n`));
  });
  lines.on('close', () => queue.then(close));
}

main().catch((err) => {
  process.stderr.write(`matrix.js: ${err.stack ?? err}\n`);
  process.exit(1);
});
