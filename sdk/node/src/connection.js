// The clients the producer, worker, promoter, canceller and dead-letter tools
// talk through: an ioredis client that was given (a `Redis`, Sentinel-managed
// when it has `sentinels` and `name`, or a `Cluster`), or one opened here from
// a URL (src/url.js) or ioredis options.

import { failFastOnTls } from './tls.js';
import { createRedis } from './url.js';

/** A client opened here: it follows failovers, and its commands fail at once when its TLS
 * handshake fails (src/tls.js). */
const opened = (connection, connectionName, extra = {}) => followingFailovers((reconnectOnError) => {
  const client = createRedis(connection ?? {}, { connectionName, reconnectOnError, ...extra });
  failFastOnTls(client);
  return client;
});

/** An ioredis client or Cluster (anything with defineCommand and duplicate). */
export function isRedisClient(value) {
  return value !== null && typeof value === 'object' && typeof value.defineCommand === 'function' &&
    typeof value.duplicate === 'function';
}

/** The reconnectOnError handlers made by followingFailovers (a duplicate gets one of its own). */
const followers = new WeakSet();

/**
 * A reply error after which a connection must find the primary again: the node
 * became a replica (READONLY, MASTERDOWN, LOADING of a replica's sync), is a
 * primary cut off from its replicas (NOREPLICAS, min-replicas-to-write), or a
 * blocked read was released by a role change (UNBLOCKED ... master -> replica).
 * Answers 1: ioredis drops the connection and connects again (behind Sentinel,
 * asking the sentinels for the primary) and the command fails with that reply,
 * an outage that the SDK retries with a backoff (src/outage.js) on the new
 * connection. Sending it again at once (2) would loop without a bound on a
 * primary that keeps refusing. Any other reply: false.
 */
export function reconnectOnFailover(err) {
  const message = String(err?.message);
  if (/^(READONLY|MASTERDOWN|NOREPLICAS|LOADING)\b/.test(message)) return 1;
  return /^UNBLOCKED\b.*master -> replica/.test(message) ? 1 : false;
}

/**
 * `build(reconnectOnError)`, a new ioredis client or Cluster given that
 * handler: reconnectOnFailover, and on a Cluster also a refresh of the slot map
 * (a node answering so no longer serves its slots; it sends no MOVED).
 * @param {(reconnectOnError: (err: Error) => number | false) => any} build
 */
function followingFailovers(build) {
  let client = null;
  const reconnectOnError = (err) => {
    const how = reconnectOnFailover(err);
    if (how && client?.isCluster) client.refreshSlotsCache();
    return how;
  };
  followers.add(reconnectOnError);
  client = build(reconnectOnError);
  return client;
}

/**
 * Log the connection errors of `client` as JSON lines, at most one each 5 s
 * (ioredis reconnects by itself; without a listener it prints them raw).
 * @param {any} client
 * @param {any} log
 * @param {object} [fields]
 */
export function logConnectionErrors(client, log, fields = {}) {
  let lastLogged = 0;
  client.on('error', (err) => {
    if (Date.now() - lastLogged < 5000) return;
    lastLogged = Date.now();
    log?.warn('redis connection error', { ...fields, err });
  });
}

/**
 * `{ client, owned }`: `connection` itself when it is a client (owned false:
 * the caller closes it and listens to its errors), else a client opened from a
 * URL or ioredis options with the given connection name (owned true), whose
 * connection errors go to `log`.
 * @param {any} connection
 * @param {string} connectionName
 * @param {any} [log]
 */
export function openConnection(connection, connectionName, log) {
  if (isRedisClient(connection)) return { client: connection, owned: false };
  const client = opened(connection, connectionName);
  logConnectionErrors(client, log, { connection: connectionName });
  return { client, owned: true };
}

/**
 * A connection of its own for one role of a worker: a duplicate of a given
 * client (keeping its Sentinel or Cluster setup), else a new client.
 * @param {any} given
 * @param {string} connectionName
 */
export function roleConnection(given, connectionName) {
  if (!isRedisClient(given)) return opened(given, connectionName, { lazyConnect: false });
  const own = (given.isCluster ? given.options?.redisOptions : given.options)?.reconnectOnError;
  if (own && !followers.has(own)) {
    return given.isCluster ? given.duplicate() : given.duplicate({ connectionName, reconnectOnError: own });
  }
  return followingFailovers((reconnectOnError) => (given.isCluster
    ? given.duplicate([], { redisOptions: { ...given.options.redisOptions, reconnectOnError } })
    : given.duplicate({ connectionName, reconnectOnError })));
}

/**
 * ioredis leaves a Cluster closed while it (re)connects with no node in its
 * pool waiting for a 'drain' that never comes: it stays 'disconnecting' and
 * the commands it queued meanwhile never settle. End such a one as ioredis
 * ends a Cluster that never connected, failing those commands.
 * @param {any} client
 */
function endIfStranded(client) {
  if (client.isCluster && client.status === 'disconnecting' && client.nodes().length === 0) {
    client.setStatus('end');
    client.flushQueue(new Error('Connection is closed.'));
  }
}

/**
 * Close `client` at once, failing its pending commands (a blocked read).
 * @param {any} client
 */
export function disconnectClient(client) {
  client.disconnect();
  endIfStranded(client);
}

/**
 * Close `client` after its pending replies (QUIT), at once when that fails.
 * @param {any} client
 * @returns {Promise<void>}
 */
export async function closeClient(client) {
  await client.quit().catch(() => client.disconnect());
  endIfStranded(client);
}
