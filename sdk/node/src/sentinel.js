// Finding a Sentinel group's primary: the address a majority of the listed
// sentinels name (docs/protocol.md section 5, failover).
//
// ioredis' SentinelConnector connects to the primary the first sentinel that
// answers names. Just after a failover a sentinel that has not heard of it yet
// still names the old primary, and a node that was SIGKILLed and started again
// answers as an empty primary until the sentinels turn it into a replica:
// writes sent there are lost. MajoritySentinelConnector, given to ioredis as its
// `Connector`, asks every listed sentinel on each connection (so on every
// reconnection too) and connects only to an address more than half of them
// name (a sentinel listed twice counts once); until they agree the connection
// attempt fails with SentinelMajorityError, an outage (src/outage.js), and is
// tried again after ioredis' `sentinelRetryStrategy` delay, unless a sentinel
// refused the password: then the attempt fails for good. Everything else (TLS to the sentinels,
// their credentials, the role check of the node reached, the optional
// `failoverDetector`) is ioredis' own.

import { SentinelConnector } from 'ioredis';

/** No address was named by a majority of the listed sentinels. */
export class SentinelMajorityError extends Error {
  /**
   * @param {string} masterName
   * @param {number} needed how many sentinels must name the same primary
   * @param {{ sentinel: string, primary?: { host: string, port: number }, problem?: string }[]} answers
   *   what each listed sentinel said (`sentinel`: its "host:port")
   */
  constructor(masterName, needed, answers) {
    const said = answers.map((a) => `${a.sentinel} ${a.primary ? `names ${address(a.primary)}` : a.problem}`);
    super(`no primary for master_name ${JSON.stringify(masterName)}: ${needed} of ${answers.length} `
      + `sentinels must name the same primary; ${said.join(', ')}`);
    this.name = 'SentinelMajorityError';
    this.needed = needed;
    this.answers = answers;
    /** A sentinel refused the password: a setting to fix, not an outage (section 5). */
    this.refused = answers.some((a) => REFUSED.test(a.problem ?? ''));
  }
}

/** The replies of a refused password. */
const REFUSED = /\b(WRONGPASS|NOAUTH)\b/;

/** How long asking one sentinel may take (ms) unless `sentinelCommandTimeout` says. */
export const SENTINEL_TIMEOUT_MS = 5_000;

/** "host:port" ("[v6]:port") of `{ host, port }`, with ioredis' defaults for a sentinel's. */
const address = ({ host = '127.0.0.1', port = 26379 }) => (host.includes(':') ? `[${host}]:${port}` : `${host}:${port}`);

/**
 * What one sentinel's `SENTINEL MASTER <name>` reply (field, value, ...) says:
 * `{ primary: { host, port } }` unless it holds that primary down (s_down,
 * o_down, as redis-py's check_master_state), else `{ problem }`.
 * @param {unknown} reply
 * @returns {{ primary?: { host: string, port: number }, problem?: string }}
 */
export function primaryOf(reply) {
  if (!Array.isArray(reply)) return { problem: `answers ${JSON.stringify(reply)}` };
  const state = {};
  for (let i = 0; i + 1 < reply.length; i += 2) state[String(reply[i])] = String(reply[i + 1]);
  const flags = (state.flags ?? '').split(',');
  if (!flags.includes('master') || !state.ip || !state.port) return { problem: `names no primary (flags ${state.flags})` };
  const primary = { host: state.ip, port: Number(state.port) };
  const down = flags.filter((f) => f === 's_down' || f === 'o_down');
  return down.length ? { problem: `names ${address(primary)} ${down.join(',')}` } : { primary };
}

/**
 * The primary named by at least `needed` answers, or null.
 * @param {{ primary?: { host: string, port: number } }[]} answers
 * @param {number} needed
 * @returns {{ host: string, port: number } | null}
 */
export function majorityOf(answers, needed) {
  const votes = new Map();
  for (const { primary } of answers) {
    if (!primary) continue;
    const key = address(primary);
    const count = (votes.get(key) ?? 0) + 1;
    if (count >= needed) return primary;
    votes.set(key, count);
  }
  return null;
}

/**
 * An ioredis `Connector` (option `Connector`, with `sentinels` and `name`)
 * that connects to the primary a majority of the listed sentinels name,
 * asking them all again on every connection. With `role: 'slave'` it is
 * ioredis' SentinelConnector.
 */
export class MajoritySentinelConnector extends SentinelConnector {
  /**
   * Find the primary, again after `sentinelRetryStrategy(attempt)` ms while
   * the sentinels do not agree (each failure emitted as the client's
   * 'error'; without a delay the attempt fails with it), then let ioredis
   * open the connection to it.
   * @param {(type: string, err: Error) => void} eventEmitter
   * @returns {Promise<any>}
   */
  async connect(eventEmitter) {
    if (this.options.role === 'slave') return super.connect(eventEmitter);
    this.connecting = true;
    /** @type {{ host: string, port: number } | undefined} the primary of this connection */
    this.primary = undefined;
    for (let attempt = 1; ; attempt += 1) {
      let failure;
      try {
        this.primary = await this.findPrimary();
      } catch (err) {
        failure = err;
      }
      if (!this.connecting) throw new Error('Connection is closed.');
      if (!failure) return super.connect(eventEmitter);
      if (failure.refused) throw failure;
      const delay = this.options.sentinelRetryStrategy?.(attempt);
      if (typeof delay !== 'number') throw failure;
      eventEmitter('error', failure);
      await new Promise((resolve) => { setTimeout(resolve, delay); });
      if (!this.connecting) throw new Error('Connection is closed.');
    }
  }

  /**
   * The address found by connect() (ioredis asks here for the node to connect to).
   * @param {{ host?: string, port?: number }} endpoint the sentinel ioredis would have asked
   * @returns {Promise<{ host: string, port: number }>}
   */
  async resolve(endpoint) {
    if (this.options.role === 'slave') return super.resolve(endpoint);
    return { ...this.primary };
  }

  /**
   * `{ host, port }` of the primary a majority of the listed sentinels name;
   * throws SentinelMajorityError when there is none. Resolves as soon as a
   * majority agrees, so a stalled minority does not hold the connection up.
   * @returns {Promise<{ host: string, port: number }>}
   */
  findPrimary() {
    const { name } = this.options;
    const sentinels = [...new Map(this.options.sentinels.map((e) => [address(e), e])).values()];
    const needed = Math.floor(sentinels.length / 2) + 1;
    const answers = []; // in the order of the list, for the error message
    let answered = 0;
    return new Promise((resolve, reject) => {
      sentinels.forEach((endpoint, i) => {
        this.ask(endpoint).then((said) => {
          answers[i] = { sentinel: address(endpoint), ...said };
          answered += 1;
          const primary = majorityOf(answers.filter(Boolean), needed);
          if (primary) resolve(this.sentinelNatResolve(primary));
          else if (answered === sentinels.length) reject(new SentinelMajorityError(name, needed, answers));
        });
      });
    });
  }

  /**
   * What the sentinel at `endpoint` says of the primary (primaryOf); never rejects.
   * @param {{ host?: string, port?: number }} endpoint
   */
  async ask(endpoint) {
    const { sentinelCommandTimeout = SENTINEL_TIMEOUT_MS } = this.options;
    const client = this.connectToSentinel(endpoint, { commandTimeout: sentinelCommandTimeout });
    client.on('error', () => {}); // its failure is the answer
    try {
      return primaryOf(await client.sentinel('master', this.options.name));
    } catch (err) {
      return { problem: `fails: ${err.message}` };
    } finally {
      client.disconnect();
    }
  }
}

/**
 * `options` (ioredis') with MajoritySentinelConnector as `Connector` when they
 * describe a Sentinel-managed primary and bring no Connector of their own.
 * @param {object} options
 * @returns {object}
 */
export function withMajorityDiscovery(options) {
  if (!options.sentinels || options.Connector || options.role === 'slave') return options;
  return { ...options, Connector: MajoritySentinelConnector };
}
