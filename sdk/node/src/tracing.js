// Trace context (docs/protocol.md section 18): W3C Trace Context in the Envelope's
// headers.traceparent and headers.tracestate, so one trace crosses every language.
//
//   - The task a handler runs is kept in an AsyncLocalStorage while it runs, with
//     its traceparent when valid (an invalid one is ignored).
//   - A publish writes traceparent/tracestate, unless the caller set them: from its
//     PRODUCER span `send <queue>` when OpenTelemetry traces (the span is a child
//     of the current span, else of the running task's traceparent), else copied
//     unchanged from the running task. A new task in a trace gets by default the
//     traceparent's trace id as trace_id (else the running task's trace_id).
//   - An attempt runs in a CONSUMER span `process <queue>`, child of the task's
//     traceparent, current while the handler runs; a failure sets status ERROR
//     and records the exception.
// @opentelemetry/api is an optional peer dependency: without it (or without a
// registered tracer provider, the API's no-op default) only the pass-through works.

import { AsyncLocalStorage } from 'node:async_hooks';
import { createRequire } from 'node:module';

/** The header holding the W3C traceparent. */
export const TRACEPARENT_HEADER = 'traceparent';
/** The header holding the W3C tracestate. */
export const TRACESTATE_HEADER = 'tracestate';

/** The name of the tracer of the SDK's spans, and messaging.system. */
export const MESSAGING_SYSTEM = 'kombu_envelope';

/** @opentelemetry/api when installed, else null. */
function loadOpenTelemetry() {
  try {
    return createRequire(import.meta.url)('@opentelemetry/api');
  } catch (err) {
    if (err?.code === 'MODULE_NOT_FOUND') return null;
    throw err;
  }
}

const otel = loadOpenTelemetry();
const tracer = () => otel.trace.getTracer(MESSAGING_SYSTEM);

/** The task whose handler runs: { traceId, traceparent?, tracestate?, spanId? }. */
const runningTask = new AsyncLocalStorage();

const TRACEPARENT = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$/;

/**
 * The parts of a W3C traceparent, or null when it is not a valid one (version
 * ff, an all-zero id, version 00 with trailing data, anything but lower-case hex).
 * @param {unknown} value
 * @returns {{ version: string, traceId: string, spanId: string, flags: number } | null}
 */
export function parseTraceparent(value) {
  if (typeof value !== 'string') return null;
  const m = TRACEPARENT.exec(value);
  if (!m || m[1] === 'ff' || (m[1] === '00' && m[5] !== undefined)) return null;
  if (/^0+$/.test(m[2]) || /^0+$/.test(m[3])) return null;
  return { version: m[1], traceId: m[2], spanId: m[3], flags: Number.parseInt(m[4], 16) };
}

/** The traceparent of an OpenTelemetry span context. */
const formatTraceparent = (sc) => `00-${sc.traceId}-${sc.spanId}-${(sc.traceFlags & 0xff).toString(16).padStart(2, '0')}`;

/** An OpenTelemetry context whose span is the remote one of `traceparent` (parsed). */
function remoteContext(parsed, tracestate) {
  return otel.trace.setSpanContext(otel.ROOT_CONTEXT, {
    traceId: parsed.traceId, spanId: parsed.spanId, traceFlags: parsed.flags, isRemote: true,
    ...(typeof tracestate === 'string' && tracestate ? { traceState: otel.createTraceState(tracestate) } : {}),
  });
}

const attributes = (operation, queue) => ({
  'messaging.system': MESSAGING_SYSTEM, 'messaging.operation.type': operation, 'messaging.destination.name': queue,
});

/** Mark `span` failed: status ERROR, the exception recorded. */
function failSpan(span, error) {
  span.recordException(error instanceof Error ? error : String(error));
  span.setStatus({ code: otel.SpanStatusCode.ERROR, message: error instanceof Error ? error.message : String(error) });
}

/** What PublishTrace and AttemptTrace share: a span (null without OpenTelemetry), failed and ended once. */
class Traced {
  constructor() {
    this.span = null;
    this.failed = false;
  }

  /** Set status ERROR and record `error` on the span (the first failure only). */
  fail(error) {
    if (this.span && !this.failed) failSpan(this.span, error);
    this.failed = true;
    return this;
  }

  /** End the span; later calls do nothing. */
  end() {
    this.span?.end();
    this.span = null;
  }
}

const isObject = (value) => value !== null && typeof value === 'object' && !Array.isArray(value);

/** The trace of one publish: the Envelope fields with the trace headers, and its send span. */
export class PublishTrace extends Traced {
  /**
   * @param {string} queue
   * @param {object} fields the caller's Envelope fields
   */
  constructor(queue, fields) {
    super();
    /** The fields to publish: `fields` with traceparent/tracestate and the default trace_id. */
    this.fields = fields;
    // Not an object, or headers that are not one: left as they are for validation to name.
    if (!isObject(fields) || (fields.headers !== undefined && fields.headers !== null && !isObject(fields.headers))) return;
    const given = fields.headers ?? {};
    const callerSet = typeof given[TRACEPARENT_HEADER] === 'string';
    const task = runningTask.getStore();
    let traceparent = given[TRACEPARENT_HEADER];
    let tracestate;
    if (otel) {
      const active = otel.context.active();
      const current = otel.trace.getSpanContext(active);
      const inSpan = current !== undefined && otel.isSpanContextValid(current);
      const callerParent = callerSet ? parseTraceparent(traceparent) : null;
      let parent = active;
      if (callerParent) parent = remoteContext(callerParent, given[TRACESTATE_HEADER]);
      else if (!inSpan && task?.traceparent) parent = remoteContext(parseTraceparent(task.traceparent), task.tracestate);
      this.span = tracer().startSpan(`send ${queue}`, { kind: otel.SpanKind.PRODUCER, attributes: attributes('send', queue) }, parent);
      const sc = this.span.spanContext();
      // Without a tracer provider the span is the parent's context: the running task's is then copied unchanged.
      const passThrough = !inSpan && task?.spanId === sc.spanId;
      if (!callerSet && !passThrough && otel.isSpanContextValid(sc)) {
        traceparent = formatTraceparent(sc);
        tracestate = sc.traceState?.serialize() || undefined;
      }
    }
    if (traceparent === undefined && task?.traceparent) {
      traceparent = task.traceparent;
      tracestate = task.tracestate;
    }
    if (traceparent === undefined) {
      if (task && fields.trace_id === undefined) this.fields = { ...fields, trace_id: task.traceId };
      return;
    }
    const headers = { ...given, [TRACEPARENT_HEADER]: traceparent };
    if (given[TRACESTATE_HEADER] === undefined && tracestate !== undefined) headers[TRACESTATE_HEADER] = tracestate;
    const traceId = parseTraceparent(traceparent)?.traceId ?? task?.traceId;
    this.fields = { ...fields, headers, ...(fields.trace_id === undefined && traceId ? { trace_id: traceId } : {}) };
  }

  /** Name the published task on the span, once its Envelope is built. */
  identify(env) {
    this.span?.setAttributes({ 'messaging.message.id': env.task_id, 'kombu_envelope.task_type': env.task_type });
  }

}

/** The trace of one attempt: the running task and its process span. */
export class AttemptTrace extends Traced {
  /**
   * @param {string} queue
   * @param {any} env the Envelope being run
   */
  constructor(queue, env) {
    const traceparent = env.headers?.[TRACEPARENT_HEADER];
    const parsed = parseTraceparent(traceparent);
    const tracestate = parsed && typeof env.headers[TRACESTATE_HEADER] === 'string' ? env.headers[TRACESTATE_HEADER] : undefined;
    super();
    this.task = parsed ? { traceId: env.trace_id, traceparent, tracestate, spanId: parsed.spanId } : { traceId: env.trace_id };
    this.context = null;
    if (!otel) return;
    const parent = parsed ? remoteContext(parsed, tracestate) : otel.ROOT_CONTEXT;
    this.span = tracer().startSpan(`process ${queue}`, {
      kind: otel.SpanKind.CONSUMER,
      attributes: {
        ...attributes('process', queue), 'messaging.message.id': env.task_id,
        'kombu_envelope.task_type': env.task_type, 'kombu_envelope.retry_count': env.retry_count,
      },
    }, parent);
    this.context = otel.trace.setSpan(parent, this.span);
  }

  /**
   * Run `fn` with this task current: publishes made from it continue its trace.
   * @template T
   * @param {() => T} fn
   * @returns {T}
   */
  run(fn) {
    return runningTask.run(this.task, () => (this.context ? otel.context.with(this.context, fn) : fn()));
  }

}
