// Commands that are safe to repeat are retried while Redis is unreachable or
// loading, for a bounded time (docs/protocol.md section 5, outages). Behind
// Sentinel and on a Cluster the errors of a failover are outages too: a node
// that stopped being the primary or is cut off from its replicas (READONLY,
// MASTERDOWN, NOREPLICAS, UNBLOCKED), a slot between nodes (MOVED, ASK,
// TRYAGAIN, CLUSTERDOWN and the ioredis errors of a slot map being refreshed),
// reset connections, and a MULTI that Redis discarded (EXECABORT) because one
// of its commands got such a reply.

import { setTimeout as sleep } from 'node:timers/promises';
import { isTransientError } from './retry.js';

/** How long a repeatable command is retried while Redis is away (ms), as Python's outage_tolerance_s. */
export const OUTAGE_TOLERANCE_MS = 30_000;

const AWAY_MESSAGE = new RegExp([
  '^(LOADING|MASTERDOWN|NOREPLICAS|TRYAGAIN|CLUSTERDOWN|READONLY|UNBLOCKED|MOVED|ASK)\\b',
  'Connection is closed', 'Command aborted due to connection close', "Stream isn't writeable",
  'connect E[A-Z]+', 'read E[A-Z]+', 'write E[A-Z]+',
  'Failed to refresh slots cache', 'None of startup nodes is available', "Cluster isn't ready",
  'Too many Cluster redirections', 'All sentinels are unreachable',
].join('|'));

/** True when `err` says Redis is unreachable or not ready, not that the command is wrong. */
export function isRedisAway(err) {
  if (!err || typeof err !== 'object') return false;
  if (err.name === 'MaxRetriesPerRequestError' || err.name === 'ClusterAllFailedError') return true;
  if (isTransientError(err) || AWAY_MESSAGE.test(String(err.message))) return true;
  // EXECABORT: a command queued in the MULTI was refused (ioredis lists why in previousErrors).
  return /^EXECABORT\b/.test(String(err.message)) && Array.isArray(err.previousErrors) &&
    err.previousErrors.some((previous) => AWAY_MESSAGE.test(String(previous?.message)));
}

/**
 * Run `fn()` and repeat it while it fails with Redis away, until `toleranceMs`
 * has passed (then the last error is thrown); any other error is thrown at
 * once. `onRetry(err, attempt)` is called before each new try.
 * @template T
 * @param {() => Promise<T>} fn
 * @param {{ toleranceMs?: number, onRetry?: (err: unknown, attempt: number) => void }} [options]
 * @returns {Promise<T>}
 */
export async function retryWhileAway(fn, { toleranceMs = OUTAGE_TOLERANCE_MS, onRetry } = {}) {
  const deadline = Date.now() + toleranceMs;
  for (let attempt = 1; ; attempt += 1) {
    try {
      return await fn();
    } catch (err) {
      if (!isRedisAway(err) || Date.now() >= deadline) throw err;
      onRetry?.(err, attempt);
      await sleep(Math.min(100 * 2 ** Math.min(attempt - 1, 4), Math.max(deadline - Date.now(), 0)));
    }
  }
}
