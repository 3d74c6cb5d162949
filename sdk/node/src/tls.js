// TLS of the connections to Redis: the TLS options of a rediss URL's query
// (spelt as redis-py's), and failing fast when a TLS handshake fails, since a
// certificate that does not check out is a setup error, not an outage.
//
//   ssl_ca_certs=<PEM file>    the CAs to trust instead of Node's bundled ones
//   ssl_certfile=<PEM file>    a client certificate, with
//   ssl_keyfile=<PEM file>     its (unencrypted) key
//   ssl_cert_reqs=required     the default: the server's certificate must chain to a
//                              trusted CA and name the host connected to; `none`: not checked

import fs from 'node:fs';

/** The query parameters read here. */
export const TLS_QUERY = ['ssl_ca_certs', 'ssl_certfile', 'ssl_keyfile', 'ssl_cert_reqs'];

const FILES = { ssl_ca_certs: 'ca', ssl_certfile: 'cert', ssl_keyfile: 'key' };

/**
 * Node `tls.connect` options (ioredis `tls`) from the TLS parameters of a query
 * (`given`: name -> value, names from TLS_QUERY only); the files are read now.
 * `fail(message)` returns the error to throw for a wrong parameter.
 * @param {Record<string, string>} given
 * @param {(message: string) => Error} fail
 * @returns {{ ca?: Buffer, cert?: Buffer, key?: Buffer, rejectUnauthorized?: false }}
 */
export function tlsOptionsOf(given, fail) {
  const options = {};
  for (const [name, option] of Object.entries(FILES)) {
    if (given[name] === undefined) continue;
    try {
      options[option] = fs.readFileSync(given[name]);
    } catch (err) {
      throw fail(`${name}: cannot read ${JSON.stringify(given[name])} (${err.code ?? err.message})`);
    }
  }
  if ((options.cert === undefined) !== (options.key === undefined)) {
    throw fail('ssl_certfile and ssl_keyfile go together (a client certificate and its key)');
  }
  const reqs = given.ssl_cert_reqs ?? 'required';
  if (reqs !== 'required' && reqs !== 'none') throw fail(`ssl_cert_reqs ${JSON.stringify(reqs)} is not required or none`);
  if (reqs === 'none') options.rejectUnauthorized = false;
  return options;
}

/** Node's codes of a TLS handshake that failed: the certificate checks (OpenSSL's X509 names) and the protocol. */
const TLS_CODE = /^(ERR_TLS_|ERR_SSL_)|CERT|SELF_SIGNED|^UNABLE_TO_|^INVALID_CA$|^PATH_LENGTH_EXCEEDED$|^INVALID_PURPOSE$|^HOSTNAME_MISMATCH$/;

/**
 * The TLS handshake failure behind `err`, or null: `err` itself or its cause.
 * @param {any} err
 * @returns {Error | null}
 */
export function tlsFailureOf(err) {
  for (let e = err, depth = 0; e && typeof e === 'object' && depth < 5; depth += 1) {
    if (typeof e.code === 'string' && TLS_CODE.test(e.code)) return e;
    e = e.cause;
  }
  return null;
}

/** A TLS handshake with Redis failed: `code` is Node's (UNABLE_TO_VERIFY_LEAF_SIGNATURE...), `cause` its error. */
export class RedisTlsError extends Error {
  constructor(cause) {
    super(`TLS connection to Redis failed: ${cause.message} (${cause.code}); check the server's certificate, `
      + 'ssl_ca_certs (the CA that signed it) and ssl_cert_reqs', { cause });
    this.name = 'RedisTlsError';
    this.code = cause.code;
  }
}

/**
 * Make the commands of `client` (a Redis, Sentinel-managed or not, or a
 * Cluster) fail at once with a RedisTlsError when a TLS handshake fails,
 * instead of waiting for a connection that cannot come: its queued commands
 * are rejected on each failure. The client keeps reconnecting as usual, so a
 * certificate fixed on the server is picked up.
 * @param {any} client
 */
export function failFastOnTls(client) {
  reportInnerTlsFailures(client);
  client.on('error', (err) => {
    const failure = tlsFailureOf(err);
    if (failure) client.flushQueue(new RedisTlsError(failure));
  });
  ignoreLateSocketErrors(client);
}

/**
 * A socket whose TLS handshake failed may report a second error (the peer's
 * alert) after ioredis, which listens with `once`, stopped listening to it:
 * give `connection`'s sockets a listener of their own, so that such an error is
 * dropped rather than an uncaught exception (ioredis still hears the first one).
 * Sockets opened from now on get it when they are opened; the one open already
 * (a client connects as it is made) when it reports a TLS failure.
 */
function ignoreLateSocketErrors(connection) {
  const connector = connection.connector;
  if (typeof connector?.connect === 'function' && !quieted.has(connector)) {
    quieted.add(connector);
    const connect = connector.connect.bind(connector);
    connector.connect = (...args) => Promise.resolve(connect(...args)).then((stream) => {
      quiet(stream);
      return stream;
    });
  }
  connection.on('error', (err) => {
    if (tlsFailureOf(err)) quiet(connection.stream);
  });
}

/** Connectors and sockets ignoreLateSocketErrors() already looks after. */
const quieted = new WeakSet();

function quiet(stream) {
  if (!stream || typeof stream.on !== 'function' || quieted.has(stream)) return;
  quieted.add(stream);
  stream.on('error', () => {});
}

/**
 * ioredis asks the sentinels, and a Cluster node for its slots, through
 * connections of its own that swallow their errors, and reports them only as
 * "Connection is closed.": a certificate refused there would only show as "All
 * sentinels are unreachable" or "Failed to refresh slots cache", retried for
 * ever. Report their TLS failures as errors of `client`.
 * @param {any} client
 */
function reportInnerTlsFailures(client) {
  const report = (inner) => {
    ignoreLateSocketErrors(inner);
    inner.on('error', (err) => {
      if (tlsFailureOf(err)) client.emit('error', err);
    });
    return inner;
  };
  const connector = client.connector;
  if (typeof connector?.connectToSentinel === 'function') {
    const connectToSentinel = connector.connectToSentinel.bind(connector);
    connector.connectToSentinel = (...args) => report(connectToSentinel(...args));
  }
  if (client.isCluster) {
    client.on('+node', (node) => {
      // A Cluster has no socket of its own: each node's connection has.
      ignoreLateSocketErrors(node);
      const duplicate = node.duplicate.bind(node);
      node.duplicate = (...args) => report(duplicate(...args));
    });
  }
}
