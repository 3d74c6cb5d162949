// Worker announcements (docs/protocol.md section 15): each consumer writes what
// it serves to <prefix>:worker:<consumer> (SET PX announceKeepMs) with every
// liveness renewal, after ZADD <prefix>:workers <now> <consumer>, awaited first.
// Readers drop members older than a day, then read every announcement.

/** How long an announcement is kept after it was written (announce_keep_ms). */
export const ANNOUNCE_KEEP_MS = 3_600_000;

/** Members of <prefix>:workers older than this are dropped by readers (ms). */
const ANNOUNCED_FOR_MS = 86_400_000;

/**
 * What a consumer says about itself; `heartbeat_ms` is how often it is written
 * again (the liveness renewal period; a reader takes 10,000 when it is absent).
 * @typedef {{ consumer: string, language: string, host: string, pid: number, queues: string[],
 *   serves: Record<string, number[]>, concurrency: number, started_at: string, seen_at: string,
 *   stopped_at?: string, heartbeat_ms?: number }} Announcement
 */

/**
 * Whether `announcement` serves `taskType` at `version` on `queue` (an empty
 * version list: every version).
 * @param {Announcement} announcement
 */
export function accepts(announcement, queue, taskType, version) {
  const versions = announcement.serves?.[taskType];
  return Array.isArray(versions) && (announcement.queues ?? []).includes(queue) &&
    (versions.length === 0 || versions.includes(version));
}

/**
 * Write `announcement`: ZADD <prefix>:workers first and awaited, then SET PX.
 * @param {any} client
 * @param {import('./keys.js').KeySpace} keys
 * @param {Announcement} announcement
 */
export async function announce(client, keys, announcement, keepMs = ANNOUNCE_KEEP_MS) {
  await client.zadd(keys.workers, Date.now(), announcement.consumer);
  await client.set(keys.worker(announcement.consumer), JSON.stringify(announcement), 'PX', keepMs);
}

/**
 * The announcements of the workers live or recently seen, after dropping
 * registry members older than a day. An unreadable announcement is logged and skipped.
 * @param {any} client
 * @param {import('./keys.js').KeySpace} keys
 * @returns {Promise<Announcement[]>}
 */
export async function readAnnouncements(client, keys, log) {
  await client.zremrangebyscore(keys.workers, '-inf', Date.now() - ANNOUNCED_FOR_MS);
  const consumers = await client.zrange(keys.workers, 0, -1);
  // One GET each: the keys have no hash tag, so they may live on different cluster nodes.
  const values = await Promise.all(consumers.map((c) => client.get(keys.worker(c))));
  const out = [];
  values.forEach((value, i) => {
    if (value === null) return;
    try {
      const parsed = JSON.parse(value);
      if (parsed === null || typeof parsed !== 'object' || Array.isArray(parsed)) throw new TypeError('not an object');
      out.push(parsed);
    } catch (err) {
      log.warn('unreadable worker announcement ignored', { err, worker: consumers[i] });
    }
  });
  return out;
}

/** A task no live or recently seen worker of its queue serves; `serves` is what they serve. */
export class NotServed extends Error {
  constructor(queue, taskType, payloadVersion, serves) {
    const what = Object.keys(serves).length ? JSON.stringify(serves) : 'nothing: no worker of this queue was seen';
    super(`task_type ${JSON.stringify(taskType)} payload_version ${payloadVersion} is not served on queue ${JSON.stringify(queue)}; its workers serve ${what}`);
    this.name = 'NotServed';
    this.queue = queue;
    this.taskType = taskType;
    this.payloadVersion = payloadVersion;
    this.serves = serves;
  }
}

/**
 * Null when one of `announced` serves `env` on `queue`, else a NotServed
 * naming what the queue's workers serve (an empty list: every version).
 * @param {Announcement[]} announced
 */
export function notServed(announced, queue, env) {
  const serves = {};
  for (const a of announced) {
    if (accepts(a, queue, env.task_type, env.payload_version)) return null;
    if (!(a.queues ?? []).includes(queue)) continue;
    for (const [taskType, versions] of Object.entries(a.serves ?? {})) {
      const have = serves[taskType];
      serves[taskType] = (have && have.length === 0) || versions.length === 0
        ? [] : [...new Set([...(have ?? []), ...versions])].sort((x, y) => x - y);
    }
  }
  return new NotServed(queue, env.task_type, env.payload_version, serves);
}
