// Delayed-task promoter (docs/protocol.md section 6): runs promote.lua for every
// queue of <prefix>:queues with Redis' clock, repeats while a call moved a full
// batch, sleeps until the earliest next due time or a wake-up on
// <prefix>:wakeup, and looks again at least every maxIdleMs. Any number of
// promoters, in any language, may run at once. One promote.lua call touches
// one queue's keys only (one Cluster slot); a failing pass (a failover) is
// tried again a second later, never ending the loop. With waitReplicas, WAIT
// follows every call that moved tasks, so that a failover does not lose the move
// and promote the same tasks again.

import { setTimeout as sleep } from 'node:timers/promises';
import { closeClient, logConnectionErrors, openConnection, roleConnection } from './connection.js';
import { KeySpace } from './keys.js';
import { ReplicaWait } from './replicas.js';
import { Scripts } from './scripts.js';

export async function redisNowMs(client) {
  const [seconds, micros] = await client.time();
  return Number(seconds) * 1000 + Math.floor(Number(micros) / 1000);
}

export class Promoter {
  /**
   * `client` (an ioredis client or Cluster) and an optional `subscriber` for
   * wake-ups; or `connection` (a client, a Redis URL of any form of src/url.js,
   * or ioredis options), from which the promoter opens both and closes them on stop().
   * waitReplicas and waitTimeoutMs: WAIT for that many replicas after each call that moved tasks.
   * @param {{ client?: any, subscriber?: any, connection?: any, prefix?: string, batch?: number,
   *   maxIdleMs?: number, log?: any, scripts?: any, waitReplicas?: number, waitTimeoutMs?: number }} options
   */
  constructor({
    client, subscriber, connection, prefix, batch = 1000, maxIdleMs = 5000, log, scripts, waitReplicas = 0, waitTimeoutMs = 1000,
  }) {
    this.owned = [];
    if (!client) {
      const opened = openConnection(connection, 'envelope-node-promoter', log);
      client = opened.client;
      if (opened.owned) this.owned.push(client);
      if (subscriber === undefined) {
        subscriber = roleConnection(client, 'envelope-node-promoter-wakeup');
        logConnectionErrors(subscriber, log, { connection: 'envelope-node-promoter-wakeup' });
        this.owned.push(subscriber);
      }
    }
    this.client = client;
    this.subscriber = subscriber;
    this.replicas = new ReplicaWait({ replicas: waitReplicas, timeoutMs: waitTimeoutMs, log });
    this.keys = new KeySpace(prefix);
    this.batch = batch;
    this.maxIdleMs = maxIdleMs;
    this.log = log;
    this.scripts = scripts ?? new Scripts(client);
    this.running = false;
    this.wake = null;
    this.wakePending = false;
  }

  /** Promote every due task of one queue; returns { moved, nextDue } (nextDue null when none). */
  async promoteQueue(queue, nowMs) {
    const qk = this.keys.queue(queue);
    let total = 0;
    for (;;) {
      const [moved, nextDue] = await this.scripts.run(
        'promote', [qk.delayed, qk.delayedData, ...qk.taskStreams], [nowMs, this.batch]);
      total += Number(moved);
      if (Number(moved)) await this.replicas.after(this.client, qk.delayed, 'promote');
      if (Number(moved) < this.batch) return { moved: total, nextDue: Number(nextDue) < 0 ? null : Number(nextDue) };
    }
  }

  /** One pass over every registered queue. */
  async runOnce(nowMs) {
    const now = nowMs ?? (await redisNowMs(this.client));
    let moved = 0;
    let earliest = null;
    for (const queue of await this.client.smembers(this.keys.queues)) {
      let result;
      try {
        result = await this.promoteQueue(queue, now);
      } catch (err) {
        if (err && err.name === 'InvalidQueueName') continue;
        throw err;
      }
      moved += result.moved;
      if (result.nextDue !== null && (earliest === null || result.nextDue < earliest)) earliest = result.nextDue;
    }
    return { moved, nextDue: earliest, now };
  }

  async start() {
    if (this.running) return;
    this.running = true;
    if (this.subscriber) {
      this.subscriber.on('message', (channel) => {
        if (channel !== this.keys.wakeup) return;
        if (this.wake) this.wake();
        else this.wakePending = true; // arrived during a pass: look again at once
      });
      await this.subscriber.subscribe(this.keys.wakeup);
    }
    this.done = this.loop();
  }

  async loop() {
    while (this.running) {
      let waitMs = this.maxIdleMs;
      try {
        const { moved, nextDue, now } = await this.runOnce();
        if (moved && this.log) this.log.debug('promoted due tasks', { moved });
        if (nextDue !== null) waitMs = Math.min(waitMs, Math.max(nextDue - now, 0));
      } catch (err) {
        if (!this.running) break;
        this.log?.warn('promoter failed; retrying in 1 s', { err });
        waitMs = 1000;
      }
      if (waitMs > 0 && this.running) await this.pause(waitMs);
    }
  }

  pause(ms) {
    if (this.wakePending) {
      this.wakePending = false;
      return Promise.resolve();
    }
    const ac = new AbortController();
    this.wake = () => ac.abort();
    return sleep(ms, undefined, { signal: ac.signal }).catch(() => {}).finally(() => { this.wake = null; });
  }

  async stop() {
    this.running = false;
    if (this.wake) this.wake();
    await this.done;
    for (const client of this.owned.splice(0)) await closeClient(client);
  }
}
