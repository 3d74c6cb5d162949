// Redis URLs.

/** ioredis options from a redis:// or rediss:// URL (db in the path). */
export function parseRedisUrl(url) {
  const u = new URL(url);
  if (!['redis:', 'rediss:'].includes(u.protocol)) throw new Error(`not a redis URL: ${url}`);
  const options = {
    host: u.hostname ? u.hostname.replace(/^\[(.*)\]$/, '$1') : '127.0.0.1',
    port: u.port ? Number(u.port) : 6379,
    db: u.pathname && u.pathname !== '/' ? Number(u.pathname.slice(1)) : 0,
  };
  if (u.username) options.username = decodeURIComponent(u.username);
  if (u.password) options.password = decodeURIComponent(u.password);
  if (u.protocol === 'rediss:') options.tls = {};
  return options;
}
