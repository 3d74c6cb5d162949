// Idempotency claims of abandoned attempts (docs/protocol.md section 8, "A
// timed-out attempt that cannot be stopped").
//
// A promise cannot be stopped: a handler that ignores its AbortSignal may still
// have its effect after its attempt timed out and was settled. So its claim is
// not given back at the deadline. It is kept, renewed every third of the claim
// time with idem_begin.lua (re-entrant for its holder, so a renewal extends
// it), until the handler's promise settles: then `done` when it resolved,
// `release` when it rejected. Meanwhile the consumer defers its own retries of
// the key, which the re-entrant claim would otherwise let run beside it.

/**
 * A claim taken with idem_begin.lua: the Redis key, the holder and the claim time.
 * @typedef {{ key: string, holder: string, claimMs: number }} Claim
 */

/** The claims of this consumer's abandoned attempts, by Redis key. */
export class AbandonedClaims {
  /**
   * @param {{ renew: (claim: Claim) => Promise<string>, finish: (claim: Claim, how: 'done' | 'release', log: any) => Promise<void> }} actions
   *   renew: idem_begin.lua for the holder, answering its state; finish: idem_finish.lua.
   */
  constructor({ renew, finish }) {
    this.renew = renew;
    this.finish = finish;
    this.kept = new Map(); // key -> { timer, settled }
  }

  /** True while an abandoned attempt of this consumer holds the claim on `key`. */
  holds(key) {
    return this.kept.has(key);
  }

  /** How many abandoned attempts still run. */
  get size() {
    return this.kept.size;
  }

  /**
   * Keep `claim` until `late` (the abandoned handler's promise) settles, then
   * settle the claim as the handler ended.
   * @param {Claim} claim
   * @param {Promise<unknown>} late
   * @param {any} log
   */
  keep(claim, late, log) {
    const timer = setInterval(() => {
      this.renew(claim).then(
        (state) => { if (state !== 'acquired') log.warn('an abandoned attempt lost its idempotency claim', { claim: state }); },
        (err) => log.warn('could not renew the idempotency claim of an abandoned attempt', { err }),
      );
    }, Math.max(1, Math.floor(claim.claimMs / 3)));
    const held = { timer, settled: null };
    held.settled = late.then(() => 'done', () => 'release').then(async (how) => {
      clearInterval(timer);
      if (this.kept.get(claim.key) !== held) return; // given up at shutdown
      log.info('an abandoned attempt settled; settling its idempotency claim', { claim: how });
      try {
        await this.finish(claim, how, log);
      } catch (err) {
        log.error('could not settle the idempotency claim of an abandoned attempt; it expires after its claim time', { err, claim: how });
      } finally {
        // Only now: a retry deferred meanwhile must find the key settled.
        this.kept.delete(claim.key);
      }
    });
    this.kept.set(claim.key, held);
    log.warn('the attempt was abandoned while its handler still runs; its idempotency claim is kept until it settles', {
      claim_ms: claim.claimMs,
    });
  }

  /** Settles when every abandoned attempt kept now has settled its claim. */
  all() {
    return Promise.all([...this.kept.values()].map((held) => held.settled)).then(() => {});
  }

  /**
   * At shutdown: stop renewing the claims of attempts still running; each
   * expires after its claim time, or is taken over once the liveness key is gone.
   * @param {any} log
   */
  giveUp(log) {
    if (this.kept.size) log.warn('abandoned attempts still run at shutdown; their idempotency claims are no longer renewed', { running: this.kept.size });
    for (const { timer } of this.kept.values()) clearInterval(timer);
    this.kept.clear();
  }
}
