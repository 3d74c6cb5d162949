// Which renewals of the liveness key count toward a takeover (docs/protocol.md
// section 5, "Never take over entries right after Redis was unreachable").
//
// A consumer takes over dead consumers' entries only after two renewals in a
// row that were answered at once. ioredis hides an outage from the commands it
// holds: one sent while it reconnects waits in its offline queue, one in flight
// is sent again after the reconnection, and either may then succeed seconds
// late, when every liveness key may have expired meanwhile (Redis counts expiry
// in wall-clock time) and live consumers have not renewed theirs yet. So a
// command "waited" when its client was not ready as it was sent, when a watched
// client lost, regained or changed a connection before the answer came, or when
// the answer came later than one renewal interval after it was sent. A renewal
// that waited starts the count again from zero, and so does a takeover check
// that waited (its round stops: what it saw is not trusted).

/** Connection events of an ioredis client or Cluster after which commands in flight or queued may have waited. */
const OUTAGE_EVENTS = ['close', 'reconnecting', 'end', 'ready', 'node error', '-node'];

/** Thrown by Renewals.check: a takeover command waited for Redis, so the round stops. */
export class WaitedForRedis extends Error {
  constructor(what) {
    super(`${what} waited for Redis; its answer is not trusted for a takeover`);
    this.name = 'WaitedForRedis';
  }
}

/** The renewals in a row answered at once, and how long commands of the watched clients waited. */
export class Renewals {
  /** @param {number} intervalMs the renewal interval, lease_ms / 3 */
  constructor(intervalMs) {
    this.intervalMs = intervalMs;
    this.inARow = 0;
    this.epoch = 0; // bumped by every outage event of a watched client
  }

  /**
   * Follow the connection events of `client`: each starts the count again.
   * @param {import('node:events').EventEmitter} client
   */
  watch(client) {
    for (const event of OUTAGE_EVENTS) {
      client.on(event, () => {
        this.epoch += 1;
        this.inARow = 0;
      });
    }
  }

  /** True once two renewals in a row were answered at once: takeovers may look at liveness keys. */
  get trusted() {
    return this.inARow >= 2;
  }

  /**
   * Run `command()` on `client` (a watched one); answers its value and whether it waited.
   * @template T
   * @param {any} client
   * @param {() => Promise<T>} command
   * @returns {Promise<{ value: T, waited: boolean }>}
   */
  async time(client, command) {
    const epoch = this.epoch;
    const ready = client.status === 'ready';
    const sent = Date.now();
    const value = await command();
    return { value, waited: !ready || epoch !== this.epoch || Date.now() - sent > this.intervalMs };
  }

  /**
   * A renewal: counts when answered at once, starts the count again when it
   * waited or failed (then its error is thrown). Answers whether it counted.
   * @param {any} client
   * @param {() => Promise<unknown>} command
   */
  async renew(client, command) {
    try {
      const { waited } = await this.time(client, command);
      this.inARow = waited ? 0 : this.inARow + 1;
      return !waited;
    } catch (err) {
      this.inARow = 0;
      throw err;
    }
  }

  /**
   * A command of a takeover round: its value, or WaitedForRedis (the count
   * starts again) when it waited.
   * @template T
   * @param {string} what
   * @param {any} client
   * @param {() => Promise<T>} command
   * @returns {Promise<T>}
   */
  async check(what, client, command) {
    const { value, waited } = await this.time(client, command);
    if (waited) {
      this.inARow = 0;
      throw new WaitedForRedis(what);
    }
    return value;
  }
}
