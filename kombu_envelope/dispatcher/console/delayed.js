// The delayed page: delayed tasks per queue, each queue's tasks by due time, and (write
// scope) cancelling one.

import { api, seg } from './api.js';
import { confirmAction, h, showError, showOk, statusBox, table, when } from './dom.js';

export function render(root, { can }) {
  const mayCancel = can('write');
  const countsBox = h('div');
  const listBox = h('div');
  const error = h('p', { class: 'error', role: 'alert' });
  root.append(h('h2', {}, 'Delayed tasks'), error, countsBox, listBox);

  async function refresh() {
    try {
      const { queues } = await api('GET', '/delayed');
      countsBox.replaceChildren(table('Delayed tasks per queue', ['Queue', 'Delayed', ''],
        Object.entries(queues).sort().map(([queue, count]) => [queue, String(count),
          h('button', { type: 'button', 'aria-label': `Show delayed tasks of ${queue}`,
            onclick: () => show(queue) }, 'Show')])));
    } catch (err) {
      showError(error, err);
    }
  }

  async function show(queue) {
    const outcome = statusBox();
    const heading = h('h3', { tabindex: -1 }, `Queue ${queue}, soonest first`);
    let tasks;
    try {
      tasks = await api('GET', `/delayed/${seg(queue)}`, { query: { limit: 200 } });
    } catch (err) {
      showError(error, err);
      return;
    }
    const cancel = async (task) => {
      const ok = await confirmAction('Cancel a delayed task',
        `Cancel task ${task.task_id} due ${when(task.due)}? It will not run.`, 'Cancel task');
      if (!ok) return;
      try {
        const answer = await api('POST', `/delayed/${seg(queue)}/${seg(task.task_id)}/cancel`);
        await refresh();
        await show(queue);
        showOk(listBox.querySelector('[role=status]'), `Task ${task.task_id}: ${answer.outcome}.`);
      } catch (err) {
        showError(outcome, err);
      }
    };
    const headers = ['Due', 'Task id', 'Task type', 'Payload version'];
    listBox.replaceChildren(heading, table(`${tasks.length} tasks`,
      mayCancel ? [...headers, ''] : headers,
      tasks.map((task) => {
        const cells = [when(task.due), task.task_id, task.envelope?.task_type ?? task.error ?? '?',
          String(task.envelope?.payload_version ?? '')];
        if (mayCancel) {
          cells.push(h('button', { type: 'button', 'aria-label': `Cancel ${task.task_id}`,
            onclick: () => cancel(task) }, 'Cancel…'));
        }
        return cells;
      })), outcome);
    heading.focus();
  }

  refresh();
}
