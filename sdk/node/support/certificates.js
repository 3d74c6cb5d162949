// Throw-away TLS material for the tests: a CA and a server certificate for
// 127.0.0.1 it signed, made with the openssl command, plus the redis-server
// arguments that make a server speak TLS only with them.

import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const OPENSSL_CONFIG = `[req]
distinguished_name = dn
prompt = no

[dn]
CN = placeholder

[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash

[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
`;

const NEW_KEY = ['-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:prime256v1', '-nodes'];

/**
 * A new CA (`ca`) and a certificate (`cert`, `key`) for IP 127.0.0.1 signed by
 * it, as PEM file paths in a fresh temporary directory; `remove()` deletes them.
 * `name` tells two CAs apart in their subject.
 * @returns {{ dir: string, ca: string, cert: string, key: string, remove: () => void }}
 */
export function makeCertificates(name = 'test') {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), `envelope-tls-${name}-`));
  fs.writeFileSync(path.join(dir, 'openssl.cnf'), OPENSSL_CONFIG);
  const openssl = (...args) => execFileSync('openssl', args, { cwd: dir, stdio: 'pipe', timeout: 30_000 });
  openssl('req', '-x509', '-new', ...NEW_KEY, '-config', 'openssl.cnf', '-extensions', 'ca',
    '-subj', `/CN=kombu-envelope ${name} CA`, '-days', '2', '-keyout', 'ca.key', '-out', 'ca.crt');
  openssl('req', '-new', ...NEW_KEY, '-config', 'openssl.cnf', '-subj', '/CN=127.0.0.1',
    '-keyout', 'server.key', '-out', 'server.csr');
  openssl('x509', '-req', '-in', 'server.csr', '-CA', 'ca.crt', '-CAkey', 'ca.key', '-set_serial', String(Date.now()),
    '-days', '2', '-extfile', 'openssl.cnf', '-extensions', 'server', '-out', 'server.crt');
  return {
    dir,
    ca: path.join(dir, 'ca.crt'),
    cert: path.join(dir, 'server.crt'),
    key: path.join(dir, 'server.key'),
    remove: () => fs.rmSync(dir, { recursive: true, force: true }),
  };
}

/**
 * redis.conf directives (name, value pairs) of a server that speaks TLS only on
 * `port` with `certs`, without asking clients for a certificate; its replication
 * and cluster bus links use TLS too.
 */
export function tlsDirectives(certs, port) {
  return [
    ['port', '0'], ['tls-port', String(port)],
    ['tls-cert-file', certs.cert], ['tls-key-file', certs.key], ['tls-ca-cert-file', certs.ca],
    ['tls-auth-clients', 'no'], ['tls-replication', 'yes'],
  ];
}
