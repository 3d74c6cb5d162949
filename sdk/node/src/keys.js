// Every Redis key of the protocol (docs/protocol.md section 2).
//
// All keys of one queue carry the Redis Cluster hash tag {<queue>} so the Lua
// scripts, which touch several keys of one queue, stay valid on a cluster.
//
//   <prefix>:{<queue>}:high | normal | low   task streams (priority >= 170 | >= 85 | below)
//   <prefix>:{<queue>}:kombu                 Python kombu traffic (ignored here)
//   <prefix>:{<queue>}:delayed               ZSET task_id -> due time (ms)
//   <prefix>:{<queue>}:delayed:data          HASH task_id -> "<bucket>\n<enc>\n<body>"
//   <prefix>:{<queue>}:dead                  dead-letter stream
//   <prefix>:queues                          SET of queues with delayed tasks
//   <prefix>:dead-queues                     SET of queues with dead-letter entries (DLQ tools)
//   <prefix>:cancelled                       ZSET task_id -> cancel time (ms), every queue's marks
//   <prefix>:{<queue>}:replayed              stream of records of replayed dead-letter entries
//   <prefix>:consumer:<consumer>             liveness of one consumer (PX lease)
//   <prefix>:idem:<task_type>:<key>          idempotency claim / done marker
//   <prefix>:retrying:<task_type>            ZSET of running retries (retry_slot.lua)
//   <prefix>:wakeup                          pub/sub channel of the promoters
//   <prefix>:{<queue>}:task:<task_id>        HASH task record (section 14), with expiry
//   <prefix>:periodic-queues                 SET of queues with periodic entries
//   <prefix>:workers                         ZSET consumer -> when it last announced itself (ms)
//   <prefix>:worker:<consumer>               a worker's announcement (section 15), with expiry
//   <prefix>:schemas                         HASH <task_type>@<payload_version> -> payload schema (section 16)
//   <prefix>:{<queue>}:stats                 HASH "<task_type> <language> <name>" -> count (section 17)
//   <prefix>:{<queue>}:limits                HASH task_type -> limits JSON (section 19)
//   <prefix>:{<queue>}:running:<task_type>   ZSET "<stream> <entry id>" -> slot deadline (ms)
//   <prefix>:{<queue>}:rate:<task_type>      GCRA theoretical arrival time (ms), read.lua's
//   <prefix>:{<queue>}:parked:<task_type>    LIST "<stream> <entry id>" parked, read.lua's
//   <prefix>:{<queue>}:parked-types          SET of task types with parked entries, read.lua's
//   <prefix>:{<queue>}:order:<key>           LIST task_ids of one ordering key, the head's turn (section 20)
//   <prefix>:{<queue>}:order-waiting:<key>   HASH task_id -> "<bucket>\n<enc>\n<body>": keyed tasks waiting for their turn
//   <prefix>:{<queue>}:order-advanced        LIST keys whose head was settled, for promote.lua to release the next
//   <prefix>:{<queue>}:order-held            ZSET "<key>\n<task_id>\n<stream>\n<entry id>" -> deadline (ms)
//   <prefix>:{<queue>}:order-policy          HASH task_type -> advance | halt (a dead-lettered head)
//   <prefix>:{<queue>}:order-halted          HASH key -> task_id of the dead-lettered head it waits for

export const DEFAULT_PREFIX = 'envelope';
export const DEFAULT_GROUP = 'workers';
/** Buckets, most urgent first: the order consumers read them in. */
export const BUCKETS = Object.freeze(['high', 'normal', 'low']);
export const HIGH_PRIORITY_FROM = 170;
export const NORMAL_PRIORITY_FROM = 85;

/** The bucket of a priority (0-255, higher is more urgent). */
export function bucketFor(priority) {
  if (priority >= HIGH_PRIORITY_FROM) return 'high';
  if (priority >= NORMAL_PRIORITY_FROM) return 'normal';
  return 'low';
}

export class InvalidQueueName extends Error {
  constructor(queue) {
    super(`queue name ${JSON.stringify(queue)} must be non-empty and contain no '{' or '}' (it becomes a Redis Cluster hash tag)`);
    this.name = 'InvalidQueueName';
  }
}

export class QueueKeys {
  constructor(prefix, queue) {
    if (typeof queue !== 'string' || !queue || queue.includes('{') || queue.includes('}')) {
      throw new InvalidQueueName(queue);
    }
    this.prefix = prefix;
    this.queue = queue;
    this.base = `${prefix}:{${queue}}`;
    this.taskStreams = BUCKETS.map((bucket) => this.stream(bucket));
    this.kombu = `${this.base}:kombu`;
    this.delayed = `${this.base}:delayed`;
    this.delayedData = `${this.base}:delayed:data`;
    this.dead = `${this.base}:dead`;
    this.replayed = `${this.base}:replayed`;
    /** The worker statistics hash (section 17). */
    this.stats = `${this.base}:stats`;
    /** The limits per task type (section 19). */
    this.limits = `${this.base}:limits`;
    /** Ordering keys whose head was settled, for promote.lua to release the next (section 20). */
    this.orderAdvanced = `${this.base}:order-advanced`;
    /** Keys held by runs acknowledged early, scored by deadline (section 20). */
    this.orderHeld = `${this.base}:order-held`;
    /** What a dead-lettered head does to its key, per task type: advance or halt (section 20). */
    this.orderPolicy = `${this.base}:order-policy`;
    /** Halted ordering keys -> the task_id of the dead-lettered head they wait for (section 20). */
    this.orderHalted = `${this.base}:order-halted`;
    Object.freeze(this);
  }

  /** The marker of the last publish of `taskId` (absorbs a publish retried after a lost reply). */
  published(taskId) {
    return `${this.base}:published:${taskId}`;
  }

  /** The task record of `taskId` (section 14). */
  task(taskId) {
    return `${this.base}:task:${taskId}`;
  }

  /** The concurrency slots of `taskType` (section 19). */
  running(taskType) {
    return `${this.base}:running:${taskType}`;
  }

  /** The stream a settle that frees a slot appends to, while entries wait for one (section 19). */
  get slotFreed() {
    return `${this.base}:slot-freed`;
  }

  /** The task_ids of ordering key `key` in the order they joined; the head's turn (section 20). */
  order(key) {
    return `${this.base}:order:${key}`;
  }

  /** The keyed tasks of `key` waiting for their turn (section 20). */
  orderWaiting(key) {
    return `${this.base}:order-waiting:${key}`;
  }

  stream(bucket) {
    if (!BUCKETS.includes(bucket)) throw new Error(`unknown bucket ${bucket}`);
    return `${this.base}:${bucket}`;
  }

  /** The bucket name of one of this queue's task streams, or null. */
  bucketOf(stream) {
    return BUCKETS.find((bucket) => this.stream(bucket) === stream) ?? null;
  }
}

export class KeySpace {
  constructor(prefix = DEFAULT_PREFIX) {
    if (typeof prefix !== 'string' || !prefix) throw new Error('the key prefix must be a non-empty string');
    this.prefix = prefix;
    this.queues = `${prefix}:queues`;
    this.deadQueues = `${prefix}:dead-queues`;
    this.cancelled = `${prefix}:cancelled`;
    this.wakeup = `${prefix}:wakeup`;
    this.periodicQueues = `${prefix}:periodic-queues`;
    this.workers = `${prefix}:workers`;
    this.schemas = `${prefix}:schemas`;
    Object.freeze(this);
  }

  queue(name) {
    return new QueueKeys(this.prefix, name);
  }

  consumer(name) {
    return `${this.prefix}:consumer:${name}`;
  }

  /** The announcement of one consumer (section 15). */
  worker(name) {
    return `${this.prefix}:worker:${name}`;
  }

  idempotency(taskType, key) {
    return `${this.prefix}:idem:${taskType}:${key}`;
  }

  retrying(taskType) {
    return `${this.prefix}:retrying:${taskType}`;
  }
}
