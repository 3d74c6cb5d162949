#!/usr/bin/env node
// A Node.js worker of the fault drill (bench/drill, python -m bench drill --languages ...):
//
//   node drill.js --redis URL --prefix P --work Q1,Q2,... --hostname H
//                 [--lease-ms N] [--concurrency N] [--wait-replicas N]
//
// It works the queues of --work with the handler of drill.effect, the task the drill's
// Celery producer publishes, and records in the ledger Redis (DRILL_LEDGER_URL, run
// DRILL_RUN) exactly what bench/drill/app.py records for Celery: under drill:<run>:,
// `deliveries` and `runs` when the handler starts (the SDK's Worker has made the
// idempotency claim by then), `effects` after work_ms (RPUSH with HINCRBY `effect-count`
// in one MULTI), then `outcomes` (`returned`: the Worker writes the done marker and acks
// after the handler returns, where Celery's `success` comes after its done marker);
// `ready` once every worker runs. Every record holds
// pid, t (epoch seconds) and host. SIGTERM stops the workers.

import process from 'node:process';
import { setTimeout as sleep } from 'node:timers/promises';
import Redis from 'ioredis';
import { InvalidPayloadError, TransientError, Worker, createLogger, parseRedisUrl } from 'kombu-envelope';

const TASK = 'drill.effect';

function parseArgs(argv) {
  const args = { 'lease-ms': '3000', concurrency: '2', 'wait-replicas': '0' };
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith('--') || i + 1 >= argv.length) throw new Error(`bad argument ${argv[i]}`);
    args[argv[i].slice(2)] = argv[i + 1];
  }
  for (const name of ['redis', 'prefix', 'work', 'hostname']) {
    if (!args[name]) throw new Error(`--${name} is required`);
  }
  if (!process.env.DRILL_LEDGER_URL || !process.env.DRILL_RUN) throw new Error('DRILL_LEDGER_URL and DRILL_RUN must be set');
  return args;
}

/** The drill's records of one run, in the ledger Redis. */
class Ledger {
  constructor(url, run, host) {
    this.client = new Redis({ ...parseRedisUrl(url), connectionName: 'drill-ledger' });
    this.run = run;
    this.host = host;
  }

  key(name) { return `drill:${this.run}:${name}`; }

  record(fields) { return JSON.stringify({ pid: process.pid, t: Date.now() / 1000, host: this.host, ...fields }); }

  add(kind, fields = {}) { return this.client.rpush(this.key(kind), this.record(fields)); }

  addEffect(task, order) {
    return this.client.multi()
      .hincrby(this.key('effect-count'), order, 1)
      .rpush(this.key('effects'), this.record({ task, order }))
      .exec();
  }
}

/** drill.effect: record the start and the run, work work_ms, record the effect and the outcome. */
function drillHandler(ledger) {
  return async (payload, ctx) => {
    const { order_id: order, work_ms: workMs } = payload;
    if (typeof order !== 'string' || !Number.isSafeInteger(workMs) || workMs < 0) {
      throw new InvalidPayloadError('payload must hold order_id (a string) and work_ms (an integer >= 0)');
    }
    const task = ctx.taskId;
    try {
      await ledger.add('deliveries', { task, order, redelivered: null });
      await ledger.add('runs', { task, order, key: ctx.envelope.idempotency_key ?? null });
      await sleep(workMs, undefined, { signal: ctx.signal });
      await ledger.addEffect(task, order);
    } catch (err) {
      await ledger.add('outcomes', { task, state: 'failure', error: String(err?.message ?? err) }).catch(() => {});
      throw err.name === 'AbortError' ? err : new TransientError(`ledger: ${err.message}`);
    }
    await ledger.add('outcomes', { task, state: 'returned' });
  };
}

async function main() {
  const args = parseArgs(process.argv.slice(2));
  const ledger = new Ledger(process.env.DRILL_LEDGER_URL, process.env.DRILL_RUN, args.hostname);
  const log = createLogger();
  const workers = args.work.split(',').filter(Boolean).map((queue, index) => new Worker({
    redis: args.redis, prefix: args.prefix, queue, leaseMs: Number(args['lease-ms']), blockMs: 500,
    concurrency: Number(args.concurrency), fastRetries: 2, backoffMs: 1000, maxBackoffMs: 4000,
    deferMs: 1000, waitReplicas: Number(args['wait-replicas']), promoter: index === 0, logger: log,
  }).register(TASK, drillHandler(ledger)));
  let closing = null;
  const close = () => {
    closing ??= Promise.allSettled(workers.map((worker) => worker.stop()))
      .then(() => ledger.client.quit()).finally(() => process.exit(0));
    return closing;
  };
  process.once('SIGTERM', close);
  process.once('SIGINT', close);
  await Promise.all(workers.map((worker) => {
    const started = worker.start();
    started.catch((err) => log.error('worker stopped', { queue: worker.opts.queue, err }));
    return started;
  }));
  await ledger.add('ready');
}

main().catch((err) => {
  process.stderr.write(`drill.js: ${err.stack ?? err}\n`);
  process.exit(1);
});
