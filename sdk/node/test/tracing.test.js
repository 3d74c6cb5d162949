// Trace context without OpenTelemetry tracing (docs/protocol.md section 18): the
// API's no-op default (no tracer provider), and no API at all. A task published
// from a handler copies the running task's traceparent and tracestate unchanged.

import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { Writable } from 'node:stream';
import { pathToFileURL } from 'node:url';
import { describe, test } from 'node:test';
import { Producer, Worker, createLogger, parseTraceparent } from '../src/index.js';
import { redisSuite, waitFor } from '../support/helpers.js';

const { server, skip, prefixFor, connect } = await redisSuite('tr');
const QUEUE = 'untraced';
const quiet = () => createLogger({ stream: new Writable({ write: (_c, _e, done) => done() }) });
const TRACE_ID = '0af7651916cd43dd8448eb211c80319c';
const TRACEPARENT = `00-${TRACE_ID}-b7ad6b7169203331-01`;

test('traceparent: the W3C form, and what is not valid', () => {
  assert.deepEqual(parseTraceparent(TRACEPARENT), { version: '00', traceId: TRACE_ID, spanId: 'b7ad6b7169203331', flags: 1 });
  assert.equal(parseTraceparent(`01-${TRACE_ID}-b7ad6b7169203331-00-later`).version, '01', 'a later version may add fields');
  for (const bad of [
    undefined, '', 'garbage', `00-${TRACE_ID}-b7ad6b7169203331-01-more`, `ff-${TRACE_ID}-b7ad6b7169203331-01`,
    `00-${'0'.repeat(32)}-b7ad6b7169203331-01`, `00-${TRACE_ID}-${'0'.repeat(16)}-01`,
    `00-${TRACE_ID.toUpperCase()}-b7ad6b7169203331-01`, `00-${TRACE_ID}-b7ad6b716920333-01`,
  ]) assert.equal(parseTraceparent(bad), null, String(bad));
});

test('without @opentelemetry/api installed, the running task is passed through', async () => {
  // A copy of the module where no node_modules can be found: the API is missing.
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'envelope-tracing-'));
  try {
    const file = path.join(dir, 'tracing.mjs');
    fs.copyFileSync(new URL('../src/tracing.js', import.meta.url), file);
    const { AttemptTrace, PublishTrace } = await import(pathToFileURL(file).href);
    const attempt = new AttemptTrace(QUEUE, {
      task_id: 't1', task_type: 'a.b', trace_id: 'order-1', retry_count: 0, headers: { traceparent: TRACEPARENT, tracestate: 's=1' },
    });
    assert.equal(attempt.span, null, 'no span without the API');
    const fields = await attempt.run(async () => {
      await null;
      return new PublishTrace(QUEUE, { task_type: 'a.c' }).fields;
    });
    assert.deepEqual(fields, { task_type: 'a.c', headers: { traceparent: TRACEPARENT, tracestate: 's=1' }, trace_id: TRACE_ID });
    assert.deepEqual(new PublishTrace(QUEUE, { task_type: 'a.c' }).fields, { task_type: 'a.c' }, 'outside a task: unchanged');
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

describe('trace context without a tracer provider', { skip, concurrency: false }, () => {
  connect();

  test('a task published from a handler passes its trace context through unchanged', async () => {
    const prefix = prefixFor();
    const producer = new Producer({ connection: server.url, prefix, logger: quiet() });
    const children = new Map();
    const worker = new Worker(QUEUE, {
      'trace.parent': async (payload) => {
        await producer.publish(QUEUE, { task_type: 'trace.child', payload: { of: payload.name } });
      },
      'trace.child': (payload, ctx) => { children.set(payload.of, ctx.envelope); },
    }, { connection: server.url, prefix, leaseMs: 1500, blockMs: 100, promoterMaxIdleMs: 200, logger: quiet() });
    try {
      await worker.waitUntilReady();
      const outside = await producer.publish(QUEUE, { task_type: 'trace.child', payload: { of: 'outside' }, headers: { a: 'b' } });
      assert.deepEqual(outside.envelope.headers, { a: 'b' }, 'no trace is current: nothing is added');

      await producer.publish(QUEUE, {
        task_type: 'trace.parent', payload: { name: 'traced' }, trace_id: 'order-17',
        headers: { traceparent: TRACEPARENT, tracestate: 'vendor=opaque' },
      });
      await producer.publish(QUEUE, {
        task_type: 'trace.parent', payload: { name: 'invalid' }, trace_id: 'order-18', headers: { traceparent: 'not-a-traceparent' },
      });
      await waitFor(() => children.has('traced') && children.has('invalid'), { message: () => JSON.stringify([...children.keys()]) });

      const traced = children.get('traced');
      assert.equal(traced.headers.traceparent, TRACEPARENT);
      assert.equal(traced.headers.tracestate, 'vendor=opaque');
      assert.equal(traced.trace_id, TRACE_ID, 'a new task in a trace gets the trace id of its traceparent');

      const invalid = children.get('invalid');
      assert.equal(invalid.headers.traceparent, undefined, 'an invalid traceparent is not passed on');
      assert.equal(invalid.trace_id, 'order-18', 'the running task\'s trace_id');
    } finally {
      await worker.close();
      await producer.close();
    }
  });
});
