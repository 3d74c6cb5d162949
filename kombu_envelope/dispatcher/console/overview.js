// The overview page: queues (backlog, pending, delayed, dead letters, throughput, failure
// rate) and workers by language, polled every few seconds. Queue figures come from
// GET /metrics; rates from two successive scrapes.

import { api } from './api.js';
import { h, showError, table, when } from './dom.js';
import { parseMetrics, rates, sumBy } from './metrics.js';

/** How often the page polls (ms). */
export const POLL_MS = 5000;

const M = 'kombu_envelope_';

function queueRows(samples, previous, seconds) {
  const sums = (name) => sumBy(samples, M + name, 'queue');
  const backlog = sums('queue_backlog_entries');
  const pending = sums('queue_pending_entries');
  const delayed = sums('queue_delayed_tasks');
  const dead = sums('queue_dead_letters');
  const succeeded = sums('tasks_succeeded_total');
  const failed = sums('tasks_failed_total');
  const done = previous && rates(previous.succeeded, succeeded, seconds);
  const bad = previous && rates(previous.failed, failed, seconds);
  const names = [...new Set([backlog, pending, delayed, dead].flatMap((m) => [...m.keys()]))].sort();
  const rows = names.map((queue) => {
    const ok = done?.get(queue) ?? 0;
    const ko = bad?.get(queue) ?? 0;
    return [queue, ...[backlog, pending, delayed, dead].map((m) => String(m.get(queue) ?? 0)),
      previous ? `${ok.toFixed(2)}/s` : '…',
      previous ? (ok + ko ? `${((100 * ko) / (ok + ko)).toFixed(1)} %` : '0 %') : '…'];
  });
  return { rows, counters: { succeeded, failed } };
}

function workerRows(workers) {
  return workers.slice().sort((a, b) => a.language.localeCompare(b.language)
    || a.consumer.localeCompare(b.consumer)).map((w) => [
    w.language, w.consumer, w.queues.join(', '),
    Object.entries(w.serves).map(([type, versions]) =>
      `${type} (${versions.length ? `v${versions.join(', v')}` : 'every version'})`).join('; '),
    w.live ? 'live' : `seen ${when(w.seen_at)}`]);
}

export function render(root) {
  const queuesBox = h('div');
  const workersBox = h('div');
  const error = h('p', { class: 'error', role: 'alert' });
  const updated = h('p', { class: 'muted' });
  root.append(h('h2', {}, 'Overview'), updated, error, h('h3', {}, 'Queues'), queuesBox,
    h('h3', {}, 'Workers'), workersBox);
  let previous = null;
  let stopped = false;
  let timer = null;

  async function poll() {
    try {
      const [text, workers] = await Promise.all([
        api('GET', '/metrics', { as: 'text' }), api('GET', '/workers')]);
      const now = performance.now();
      const { rows, counters } = queueRows(parseMetrics(text), previous,
        previous ? (now - previous.at) / 1000 : 0);
      previous = { ...counters, at: now };
      queuesBox.replaceChildren(table('Queues', ['Queue', 'Backlog', 'Pending', 'Delayed',
        'Dead letters', 'Throughput', 'Failure rate'], rows));
      workersBox.replaceChildren(table('Workers by language',
        ['Language', 'Consumer', 'Queues', 'Task types and versions', 'State'],
        workerRows(workers)));
      error.textContent = '';
      updated.textContent = `Updated ${new Date().toLocaleTimeString()}; refreshes every ${POLL_MS / 1000} s.`;
    } catch (err) {
      showError(error, err);
    }
    if (!stopped) timer = setTimeout(poll, POLL_MS);
  }

  poll();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}
