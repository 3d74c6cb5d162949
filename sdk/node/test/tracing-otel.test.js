// Trace context with OpenTelemetry (docs/protocol.md section 18), recorded by the
// SDK's in-memory exporter against a real Redis: a send span per published task,
// whose context goes into headers.traceparent; a process span per attempt, child
// of it; a task published from the handler continues the trace.

import assert from 'node:assert/strict';
import { Writable } from 'node:stream';
import { describe, test } from 'node:test';
import { SpanKind, SpanStatusCode, context, trace } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor } from '@opentelemetry/sdk-trace-base';
import { Producer, Worker, createLogger, parseTraceparent } from '../src/index.js';
import { redisSuite, waitFor } from '../support/helpers.js';

const { server, skip, prefixFor, connect } = await redisSuite('to');
const QUEUE = 'traced';
const quiet = () => createLogger({ stream: new Writable({ write: (_c, _e, done) => done() }) });

const exporter = new InMemorySpanExporter();
trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] }));
context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());

describe('trace context with OpenTelemetry', { skip, concurrency: false }, () => {
  connect();

  test('send and process spans chain the publish, the attempt and the tasks it publishes', async () => {
    const prefix = prefixFor();
    const producer = new Producer({ connection: server.url, prefix, logger: quiet() });
    const ran = new Map();
    const worker = new Worker(QUEUE, {
      'trace.parent': async (payload, ctx) => {
        ran.set('parent', ctx.envelope);
        await producer.publish(QUEUE, { task_type: 'trace.child' });
      },
      'trace.child': (payload, ctx) => { ran.set('child', ctx.envelope); },
      'trace.fail': () => { throw new TypeError('no such order'); },
    }, { connection: server.url, prefix, leaseMs: 1500, blockMs: 100, promoterMaxIdleMs: 200, logger: quiet() });
    let request;
    try {
      await worker.waitUntilReady();
      await trace.getTracer('test').startActiveSpan('request', async (span) => {
        request = span.spanContext();
        await producer.publish(QUEUE, { task_type: 'trace.parent' });
        await producer.publish(QUEUE, { task_type: 'trace.fail' });
        span.end();
      });
      const own = await producer.publish(QUEUE, { task_type: 'trace.child', headers: { traceparent: '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01' } });
      assert.equal(own.envelope.headers.traceparent, '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01', 'the caller\'s traceparent is kept');
      await waitFor(() => ran.has('child') && exporter.getFinishedSpans().filter((s) => s.name === `process ${QUEUE}`).length === 4,
        { message: () => JSON.stringify(exporter.getFinishedSpans().map((s) => s.name)) });
    } finally {
      await worker.close();
      await producer.close();
    }

    const spans = exporter.getFinishedSpans();
    const parentOf = (s) => s.parentSpanContext?.spanId;
    const sends = spans.filter((s) => s.name === `send ${QUEUE}`);
    const processes = spans.filter((s) => s.name === `process ${QUEUE}`);
    const byTask = (list, taskId) => list.find((s) => s.attributes['messaging.message.id'] === taskId);

    const parentEnv = ran.get('parent');
    const sendParent = byTask(sends, parentEnv.task_id);
    assert.equal(sendParent.kind, SpanKind.PRODUCER);
    assert.equal(parentOf(sendParent), request.spanId, 'the send span is a child of the current span');
    assert.equal(parentEnv.headers.traceparent, `00-${request.traceId}-${sendParent.spanContext().spanId}-01`);
    assert.equal(parentEnv.trace_id, request.traceId);
    assert.deepEqual(sendParent.attributes, {
      'messaging.system': 'kombu_envelope', 'messaging.operation.type': 'send', 'messaging.destination.name': QUEUE,
      'messaging.message.id': parentEnv.task_id, 'kombu_envelope.task_type': 'trace.parent',
    });

    const processParent = byTask(processes, parentEnv.task_id);
    assert.equal(processParent.kind, SpanKind.CONSUMER);
    assert.equal(processParent.spanContext().traceId, request.traceId);
    assert.equal(parentOf(processParent), sendParent.spanContext().spanId, 'the process span is a child of the traceparent');
    assert.deepEqual(processParent.attributes, {
      'messaging.system': 'kombu_envelope', 'messaging.operation.type': 'process', 'messaging.destination.name': QUEUE,
      'messaging.message.id': parentEnv.task_id, 'kombu_envelope.task_type': 'trace.parent', 'kombu_envelope.retry_count': 0,
    });
    assert.equal(processParent.status.code, SpanStatusCode.UNSET);

    const childEnv = ran.get('child');
    const sendChild = byTask(sends, childEnv.task_id);
    assert.equal(parentOf(sendChild), processParent.spanContext().spanId, 'published from the handler: a child of its process span');
    const childTrace = parseTraceparent(childEnv.headers.traceparent);
    assert.equal(childTrace.traceId, request.traceId);
    assert.equal(childTrace.spanId, sendChild.spanContext().spanId);
    assert.equal(childEnv.trace_id, request.traceId);
    assert.equal(parentOf(byTask(processes, childEnv.task_id)), sendChild.spanContext().spanId);

    const failed = processes.find((s) => s.attributes['kombu_envelope.task_type'] === 'trace.fail');
    assert.equal(failed.spanContext().traceId, request.traceId);
    assert.equal(failed.status.code, SpanStatusCode.ERROR);
    assert.equal(failed.status.message, 'no such order');
    const exception = failed.events.find((e) => e.name === 'exception');
    assert.equal(exception.attributes['exception.type'], 'TypeError');
  });
});
