// Publishing (docs/protocol.md section 4): validate (publish rules included),
// encode, then XADD to the priority bucket's stream when due, or store in the
// delayed set with schedule.lua (after SADD <prefix>:queues) when ahead.

import { encodeBody, DEFAULT_GZIP_MIN_BYTES } from './codec.js';
import { DEFAULT_LIMITS, dueMs, isDue, parseEnvelope } from './envelope.js';
import { KeySpace, bucketFor } from './keys.js';
import { Scripts } from './scripts.js';

export class Producer {
  constructor(client, { prefix, limits = DEFAULT_LIMITS, gzipMinBytes = DEFAULT_GZIP_MIN_BYTES, scripts } = {}) {
    this.client = client;
    this.keys = new KeySpace(prefix);
    this.limits = { ...DEFAULT_LIMITS, ...limits };
    this.gzipMinBytes = gzipMinBytes;
    this.scripts = scripts ?? new Scripts(client);
  }

  /**
   * Publish one task. `fields` are Envelope fields (task_type required; times
   * as RFC 3339 strings with offset, or Timestamp objects). Throws
   * InvalidEnvelope before anything reaches Redis when a rule is broken.
   * Returns { taskId, envelope, entryId (null when delayed), delayed, dueMs }.
   */
  async publish(queue, fields, { nowMs = Date.now() } = {}) {
    const envelope = parseEnvelope(fields, { limits: this.limits, publish: true, now: nowMs });
    const qk = this.keys.queue(queue);
    const { enc, body } = encodeBody(envelope, { gzipMinBytes: this.gzipMinBytes, limits: this.limits });
    const bucket = bucketFor(envelope.priority);
    if (isDue(envelope, nowMs)) {
      const entryId = await this.client.xadd(qk.stream(bucket), '*', 'v', '1', 'enc', enc, 'body', body);
      return { taskId: envelope.task_id, envelope, entryId, delayed: false, dueMs: nowMs };
    }
    // Register the queue on every delayed publish, in the same round trip and
    // before schedule.lua wakes the promoters: a registry lost with a Redis
    // restart is rebuilt by the next publish.
    const due = dueMs(envelope, nowMs);
    const pipeline = this.client.pipeline().sadd(this.keys.queues, queue);
    this.scripts.run('schedule', [qk.delayed, qk.delayedData],
      [envelope.task_id, due, bucket, enc, body, this.keys.wakeup], pipeline);
    for (const [err] of await pipeline.exec()) if (err) throw err;
    return { taskId: envelope.task_id, envelope, entryId: null, delayed: true, dueMs: due };
  }
}
