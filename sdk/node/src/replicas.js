// Waiting for replicas after a write (docs/protocol.md section 5, failover):
// Redis replicates asynchronously, so a write a primary acknowledged is lost
// when it dies before a replica copied it. With `replicas` > 0, every publish
// and every settling step is followed by `WAIT <replicas> <timeoutMs>` on the
// connection that took the write (on a Cluster: the node of `key`). A WAIT that
// answers fewer replicas is logged; the write stands.

/** The replica wait of a producer or worker: `replicas` 0 turns it off. */
export class ReplicaWait {
  /**
   * @param {{ replicas?: number, timeoutMs?: number, log?: any }} options
   */
  constructor({ replicas = 0, timeoutMs = 1000, log } = {}) {
    for (const [name, value] of [['waitReplicas', replicas], ['waitTimeoutMs', timeoutMs]]) {
      if (!Number.isSafeInteger(value) || value < 0) throw new RangeError(`${name} must be an integer >= 0, not ${value}`);
    }
    this.replicas = replicas;
    this.timeoutMs = timeoutMs;
    this.log = log;
  }

  /**
   * WAIT after a write to `key` on `client`; answers the replicas that
   * acknowledged it (null when off). A keyed EXISTS goes first in the same
   * pipeline so that a Cluster client sends the WAIT to the node of `key`.
   * @param {any} client
   * @param {string} key
   * @param {string} step what was written (for the log)
   * @param {any} [log]
   */
  async after(client, key, step, log = this.log) {
    if (!this.replicas) return null;
    const replies = await client.pipeline().exists(key).wait(this.replicas, this.timeoutMs).exec();
    for (const [err] of replies) if (err) throw err;
    const acknowledged = Number(replies[1][1]);
    if (acknowledged < this.replicas) {
      log?.warn('fewer replicas than asked acknowledged a write; it stands, but may be lost with its primary', {
        step, key, asked: this.replicas, acknowledged, timeout_ms: this.timeoutMs,
      });
    }
    return acknowledged;
  }
}
