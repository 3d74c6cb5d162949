// The registries of queues (<prefix>:queues, <prefix>:dead-queues): each SADD
// is sent on its own, before the step that stores data in the queue, and never
// in a MULTI or script with the queue's keys, which live in another Cluster
// slot (docs/protocol.md section 2). A crash between the two leaves a listed
// queue with nothing in it, never data nobody lists.

/**
 * SADD `registry` `queue`, then `step()`; answers what `step` answers. On one
 * connection (one Redis, Sentinel) both go out at once, in that order, which
 * Redis keeps; a Cluster client may send them to different nodes, so the
 * step waits for the SADD.
 * @template T
 * @param {any} client
 * @param {string} registry
 * @param {string} queue
 * @param {() => Promise<T>} step
 * @returns {Promise<T>}
 */
export async function registerThen(client, registry, queue, step) {
  if (client.isCluster) {
    await client.sadd(registry, queue);
    return step();
  }
  const [, result] = await Promise.all([client.sadd(registry, queue), step()]);
  return result;
}
