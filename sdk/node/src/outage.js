// Commands that are safe to repeat are retried while Redis is unreachable or
// loading, for a bounded time (docs/protocol.md section 5, outages).

import { setTimeout as sleep } from 'node:timers/promises';
import { isTransientError } from './retry.js';

/** How long a repeatable command is retried while Redis is away (ms), as Python's outage_tolerance_s. */
export const OUTAGE_TOLERANCE_MS = 30_000;

const AWAY_MESSAGE = /^(LOADING|MASTERDOWN|TRYAGAIN|CLUSTERDOWN|READONLY)\b|Connection is closed|Stream isn't writeable|connect E[A-Z]+/;

/** True when `err` says Redis is unreachable or not ready, not that the command is wrong. */
export function isRedisAway(err) {
  if (!err || typeof err !== 'object') return false;
  if (err.name === 'MaxRetriesPerRequestError') return true;
  return isTransientError(err) || AWAY_MESSAGE.test(String(err.message));
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
