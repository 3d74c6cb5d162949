// Redis URLs: one Redis, a Sentinel-managed primary, or a Redis Cluster.
//
//   redis://[[user]:password@]host[:6379][/db]                      (rediss://: TLS)
//   redis-sentinel://[[user]:password@]h1[:26379][,h2[:port]...][/db]#<master_name>
//       ?sentinel_username=...&sentinel_password=...                (rediss-sentinel://: TLS
//                                                                     to the data nodes and the sentinels)
//   redis-cluster://[[user]:password@]h1[:6379][,h2[:port]...]     (rediss-cluster://: TLS)
//
// The user and password are those of the data nodes; a Sentinel's own come from
// the query. A rediss URL of any form also takes the TLS options of src/tls.js
// in its query (ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs); they
// apply to every connection: the data nodes, the sentinels, the cluster nodes.
// Every malformed part fails at once with an error naming it.

import Redis, { Cluster } from 'ioredis';
import { TLS_QUERY, tlsOptionsOf } from './tls.js';

const SCHEMES = {
  'redis:': { kind: 'standalone', tls: false, port: 6379 },
  'rediss:': { kind: 'standalone', tls: true, port: 6379 },
  'redis-sentinel:': { kind: 'sentinel', tls: false, port: 26379 },
  'rediss-sentinel:': { kind: 'sentinel', tls: true, port: 26379 },
  'redis-cluster:': { kind: 'cluster', tls: false, port: 6379 },
  'rediss-cluster:': { kind: 'cluster', tls: true, port: 6379 },
};

const SENTINEL_QUERY = { sentinel_username: 'sentinelUsername', sentinel_password: 'sentinelPassword' };

/** A Redis URL that cannot be used; `part` names what is wrong (scheme, host, port, db, master_name, query). */
export class InvalidRedisUrl extends Error {
  constructor(part, message) {
    super(`invalid Redis URL: ${part}: ${message}`);
    this.name = 'InvalidRedisUrl';
    this.part = part;
  }
}

function decode(part, value) {
  try {
    return decodeURIComponent(value);
  } catch {
    throw new InvalidRedisUrl(part, 'bad percent-encoding');
  }
}

/** One `host[:port]` or `[ipv6][:port]` of a host list. */
function parseHost(text, defaultPort) {
  const m = /^(?:\[([0-9A-Fa-f:.]+)\]|([^\s:[\]/?#@,]+))(?::(\d*))?$/.exec(text);
  if (!m) throw new InvalidRedisUrl('host', `${JSON.stringify(text)} is not host[:port]`);
  const host = m[1] ?? decode('host', m[2]);
  if (m[3] === undefined || m[3] === '') {
    if (m[3] === '') throw new InvalidRedisUrl('port', `empty port after ${JSON.stringify(host)}`);
    return { host, port: defaultPort };
  }
  const port = Number(m[3]);
  if (!Number.isInteger(port) || port < 1 || port > 65535) throw new InvalidRedisUrl('port', `${m[3]} is not a port (1-65535)`);
  return { host, port };
}

/**
 * The parts of any of the URL forms above:
 * { kind: 'standalone' | 'sentinel' | 'cluster', tls, hosts: [{ host, port }], db,
 *   username?, password?, masterName?, sentinelUsername?, sentinelPassword?,
 *   tlsOptions? (with tls: Node `tls.connect` options, the files read) }.
 * Throws InvalidRedisUrl naming the wrong part.
 * @param {string} url
 */
export function parseRedisLocation(url) {
  if (typeof url !== 'string') throw new InvalidRedisUrl('scheme', 'the URL must be a string');
  const m = /^([A-Za-z][A-Za-z0-9+.-]*:)\/\/([^/?#]*)(\/[^?#]*)?(\?[^#]*)?(#.*)?$/.exec(url);
  if (!m) throw new InvalidRedisUrl('scheme', `${JSON.stringify(url)} is not <scheme>://<hosts>`);
  const [, rawScheme, authority, path = '', query = '', fragment = ''] = m;
  const scheme = SCHEMES[rawScheme.toLowerCase()];
  if (!scheme) {
    throw new InvalidRedisUrl('scheme', `${JSON.stringify(rawScheme.slice(0, -1))} is not one of ${Object.keys(SCHEMES).map((s) => s.slice(0, -1)).join(', ')}`);
  }
  const out = { kind: scheme.kind, tls: scheme.tls, db: 0 };
  const at = authority.lastIndexOf('@');
  const hostList = at < 0 ? authority : authority.slice(at + 1);
  if (at >= 0) {
    const userinfo = authority.slice(0, at);
    const colon = userinfo.indexOf(':');
    const user = colon < 0 ? userinfo : userinfo.slice(0, colon);
    if (user) out.username = decode('username', user);
    if (colon >= 0 && colon < userinfo.length - 1) out.password = decode('password', userinfo.slice(colon + 1));
  }
  if (!hostList) {
    if (scheme.kind !== 'standalone') throw new InvalidRedisUrl('host', `a ${rawScheme.slice(0, -1)} URL needs at least one host`);
    out.hosts = [{ host: '127.0.0.1', port: scheme.port }];
  } else {
    out.hosts = hostList.split(',').map((h) => parseHost(h, scheme.port));
    if (scheme.kind === 'standalone' && out.hosts.length > 1) {
      throw new InvalidRedisUrl('host', `${rawScheme}// names one host; use redis-sentinel:// or redis-cluster:// for several`);
    }
  }
  if (path && path !== '/') {
    if (!/^\/\d+$/.test(path)) throw new InvalidRedisUrl('db', `${JSON.stringify(path.slice(1))} is not a database number`);
    if (scheme.kind === 'cluster') throw new InvalidRedisUrl('db', 'Redis Cluster has only database 0');
    out.db = Number(path.slice(1));
  }
  const master = fragment.slice(1);
  if (scheme.kind === 'sentinel') {
    if (!master) throw new InvalidRedisUrl('master_name', 'a Sentinel URL ends with #<master_name>');
    out.masterName = decode('master_name', master);
  } else if (fragment) {
    throw new InvalidRedisUrl('master_name', `only Sentinel URLs name a master (#${master})`);
  }
  const known = [...(scheme.kind === 'sentinel' ? Object.keys(SENTINEL_QUERY) : []), ...TLS_QUERY];
  const tls = {};
  for (const [name, value] of new URLSearchParams(query.slice(1))) {
    if (!known.includes(name)) {
      throw new InvalidRedisUrl('query', `unknown parameter ${JSON.stringify(name)} (known: ${known.join(', ')})`);
    }
    if (!TLS_QUERY.includes(name)) out[SENTINEL_QUERY[name]] = value;
    else if (!scheme.tls) throw new InvalidRedisUrl('query', `${name} needs TLS: use rediss://, rediss-sentinel:// or rediss-cluster://`);
    else tls[name] = value;
  }
  if (scheme.tls) out.tlsOptions = tlsOptionsOf(tls, (message) => new InvalidRedisUrl('query', message));
  return out;
}

function auth({ username, password }) {
  const out = {};
  if (username !== undefined) out.username = username;
  if (password !== undefined) out.password = password;
  return out;
}

/**
 * ioredis options from a redis://, rediss://, redis-sentinel:// or
 * rediss-sentinel:// URL (a Sentinel URL gives `sentinels` and `name`).
 * Cluster URLs have no single-client options: use createRedis().
 * @param {string} url
 */
export function parseRedisUrl(url) {
  const loc = parseRedisLocation(url);
  if (loc.kind === 'cluster') throw new InvalidRedisUrl('scheme', 'a Cluster URL makes a Cluster client: use createRedis()');
  const options = { ...auth(loc), db: loc.db };
  if (loc.kind === 'standalone') {
    Object.assign(options, loc.hosts[0]);
    if (loc.tls) options.tls = loc.tlsOptions;
    return options;
  }
  options.sentinels = loc.hosts;
  options.name = loc.masterName;
  if (loc.sentinelUsername !== undefined) options.sentinelUsername = loc.sentinelUsername;
  if (loc.sentinelPassword !== undefined) options.sentinelPassword = loc.sentinelPassword;
  if (loc.tls) Object.assign(options, { tls: loc.tlsOptions, sentinelTLS: loc.tlsOptions, enableTLSForSentinelMode: true });
  return options;
}

/**
 * A new ioredis client from a URL of any form above, or from ioredis options
 * (a `Redis`; with `sentinels` and `name` a Sentinel-managed one). A Cluster
 * URL gives a `Cluster` seeded with its hosts. `extra` are ioredis options
 * added to each connection (for a Cluster: to every node's).
 * @param {string | object} urlOrOptions
 * @param {object} [extra]
 * @returns {import('ioredis').Redis | import('ioredis').Cluster}
 */
export function createRedis(urlOrOptions, extra = {}) {
  if (typeof urlOrOptions !== 'string') return new Redis({ ...(urlOrOptions ?? {}), ...extra });
  const loc = parseRedisLocation(urlOrOptions);
  if (loc.kind !== 'cluster') return new Redis({ ...parseRedisUrl(urlOrOptions), ...extra });
  return new Cluster(loc.hosts, {
    redisOptions: { ...auth(loc), ...(loc.tls ? { tls: loc.tlsOptions } : {}), ...extra },
  });
}
