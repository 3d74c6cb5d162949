// The dead letters page: counts by task type and failure class, a filtered list, one
// entry's Envelope, error and stack trace, and (operator scope) edit, replay and purge.

import { api, seg } from './api.js';
import { confirmAction, h, showError, showOk, statusBox, table, when } from './dom.js';

const RANGES = [['', 'Any time'], ['3600', 'Last hour'], ['86400', 'Last 24 hours'],
  ['604800', 'Last 7 days']];
const FAILURE_FIELDS = ['task_id', 'task_type', 'failure_class', 'reason', 'exception_type',
  'attempts', 'language', 'host', 'consumer', 'dead_at', 'first_failure_at', 'last_failure_at'];

function field(label, control) {
  return h('div', {}, h('label', { for: control.id }, label), control);
}

/** JSON syntax feedback for a payload textarea: the parsed object, or null. */
function parsePayload(text, feedback, area) {
  let value = null;
  try {
    value = JSON.parse(text);
    if (value === null || typeof value !== 'object' || Array.isArray(value)) {
      throw new Error('the payload must be a JSON object');
    }
    feedback.className = 'ok';
    feedback.textContent = 'Valid JSON.';
  } catch (err) {
    value = null;
    feedback.className = 'error';
    feedback.textContent = `JSON syntax: ${err.message}`;
  }
  area.setAttribute('aria-invalid', String(value === null));
  return value;
}

export function render(root, { can }) {
  const operator = can('operator');
  const inputs = {
    queue: h('input', { id: 'dl-queue', name: 'queue', size: 14 }),
    task_type: h('input', { id: 'dl-task-type', name: 'task_type', size: 20 }),
    failure_class: h('input', { id: 'dl-failure-class', name: 'failure_class', size: 16 }),
    range: h('select', { id: 'dl-range', name: 'range' },
      RANGES.map(([value, text]) => h('option', { value }, text))),
  };
  const filterError = h('p', { class: 'error', role: 'alert' });
  const form = h('form', { class: 'filters', 'aria-label': 'Filter dead letters' },
    field('Queue', inputs.queue), field('Task type', inputs.task_type),
    field('Failure class', inputs.failure_class), field('Dead since', inputs.range),
    h('button', { type: 'submit', class: 'primary' }, 'Apply'));
  const statsBox = h('div');
  const listBox = h('div');
  const detailBox = h('div');
  root.append(h('h2', {}, 'Dead letters'), form, filterError,
    h('h3', {}, 'By task type and failure class'), statsBox,
    h('h3', {}, 'Entries'), listBox, detailBox);

  const where = () => {
    const seconds = Number(inputs.range.value);
    return {
      queue: inputs.queue.value.trim(), task_type: inputs.task_type.value.trim(),
      failure_class: inputs.failure_class.value.trim(),
      since: seconds ? new Date(Date.now() - seconds * 1000).toISOString() : '',
    };
  };

  // The entries the operator selected, by "<queue> <id>": kept when the list is drawn
  // again (a refresh, a later answer), so that a selection is never lost under them.
  const selected = new Set();
  // Each refresh is numbered: an answer that comes after a later refresh was asked for
  // (the page's first load, overtaken by a filter) is dropped, not shown over it.
  let asked = 0;
  async function refresh() {
    const mine = ++asked;
    filterError.textContent = '';
    const query = where();
    try {
      const [stats, entries] = await Promise.all([
        api('GET', '/dead-letters/stats', { query }),
        api('GET', '/dead-letters', { query: { ...query, limit: 200 } })]);
      if (mine !== asked) return;
      showStats(stats);
      showList(entries, stats);
    } catch (err) {
      if (mine === asked) showError(filterError, err);
    }
  }

  function showStats(stats) {
    statsBox.replaceChildren(table('Dead letters per queue, task type and failure class',
      ['Queue', 'Task type', 'Failure class', 'Count', ''],
      stats.map((s) => [s.queue, s.task_type, s.failure_class, String(s.count),
        h('button', {
          type: 'button', 'aria-label': `List ${s.task_type} ${s.failure_class} in ${s.queue}`,
          onclick: () => {
            inputs.queue.value = s.queue;
            inputs.task_type.value = s.task_type;
            inputs.failure_class.value = s.failure_class;
            refresh();
          },
        }, 'List')])));
  }

  function showList(entries, stats) {
    const boxes = new Map();
    const rows = entries.map((entry) => {
      const cells = [when(entry.dead_at), entry.queue, entry.task_type ?? '?',
        entry.failure_class, entry.reason ?? '',
        h('button', {
          type: 'button', 'aria-label': `Open dead letter ${entry.id}`,
          onclick: () => open(entry.queue, entry.id),
        }, 'Open')];
      if (operator) {
        const key = `${entry.queue} ${entry.id}`;
        const box = h('input', {
          type: 'checkbox', 'aria-label': `Select ${entry.id}`, checked: selected.has(key),
          onchange: () => (box.checked ? selected.add(key) : selected.delete(key)),
        });
        boxes.set(box, entry);
        cells.unshift(box);
      }
      return cells;
    });
    const headers = ['Dead at', 'Queue', 'Task type', 'Failure class', 'Reason', ''];
    listBox.replaceChildren(table(`${entries.length} entries`,
      operator ? ['Select', ...headers] : headers, rows));
    if (!operator) return;
    const outcome = statusBox();
    const replaySelected = async () => {
      const chosen = [...boxes].filter(([box]) => box.checked).map(([, entry]) => entry);
      if (!chosen.length) return showError(outcome, 'Select at least one entry.');
      const failed = [];
      for (const entry of chosen) {
        try {
          await api('POST', `/dead-letters/${seg(entry.queue)}/${seg(entry.id)}/replay`, { body: {} });
          selected.delete(`${entry.queue} ${entry.id}`);
        } catch (err) {
          failed.push(`${entry.id}: ${err.message}`);
        }
      }
      await refresh();
      if (failed.length) showError(listBox.querySelector('[role=status]'), failed.join('\n'));
      else showOk(listBox.querySelector('[role=status]'), `Replayed ${chosen.length} entries.`);
    };
    const purge = async () => {
      const { queue: only, ...filters } = where();
      const queues = only ? [only] : [...new Set(stats.map((s) => s.queue))];
      const count = stats.reduce((sum, s) => sum + s.count, 0);
      if (!queues.length) return showError(outcome, 'Nothing to purge.');
      const ok = await confirmAction('Purge dead letters',
        `Delete ${count} dead letter(s) matching the filters from ${queues.join(', ')}? `
        + 'This cannot be undone.', 'Purge');
      if (!ok) return showOk(outcome, 'Nothing was purged.');
      try {
        let purged = 0;
        for (const queue of queues) {
          purged += (await api('DELETE', `/dead-letters/${seg(queue)}`, { query: filters })).purged;
        }
        await refresh();
        showOk(listBox.querySelector('[role=status]'), `Purged ${purged} entries.`);
      } catch (err) {
        showError(outcome, err);
      }
    };
    listBox.append(h('div', { class: 'actions' },
      h('button', { type: 'button', onclick: replaySelected }, 'Replay selected'),
      h('button', { type: 'button', class: 'danger', onclick: purge }, 'Purge…'), outcome));
  }

  async function open(queue, id) {
    const heading = h('h3', { tabindex: -1 }, `Dead letter ${id} (${queue})`);
    const box = h('section', { class: 'detail', 'aria-label': `Dead letter ${id}` }, heading);
    detailBox.replaceChildren(box);
    let entry;
    try {
      entry = await api('GET', `/dead-letters/${seg(queue)}/${seg(id)}`);
    } catch (err) {
      const message = h('p');
      box.append(message);
      showError(message, err);
      return;
    }
    box.append(
      h('dl', {}, FAILURE_FIELDS.filter((name) => entry[name] !== undefined)
        .map((name) => [h('dt', {}, name), h('dd', {}, String(entry[name]))])),
      h('h4', {}, 'Stack trace'), h('pre', { class: 'trace' }, entry.traceback ?? 'None recorded.'),
      h('h4', {}, 'Envelope'),
      entry.envelope
        ? h('pre', { class: 'envelope' }, JSON.stringify(entry.envelope, null, 2))
        : h('p', { class: 'error' }, `No valid Envelope: ${entry.decode_error}`));
    if (operator && entry.envelope) box.append(editor(entry));
    heading.focus();
  }

  function editor(entry) {
    const envelope = entry.envelope;
    const area = h('textarea', { id: 'dl-payload', 'aria-describedby': 'dl-payload-feedback', spellcheck: 'false' },
      JSON.stringify(envelope.payload, null, 2));
    const feedback = h('p', { id: 'dl-payload-feedback', 'aria-live': 'polite' });
    const version = h('input', { id: 'dl-version', type: 'number', min: 1, value: envelope.payload_version });
    const retries = h('input', { id: 'dl-retries', type: 'number', min: 0, value: 0,
      'aria-describedby': 'dl-retries-hint' });
    const schemaBox = h('div', { 'aria-live': 'polite' });
    const outcome = statusBox();
    area.addEventListener('input', () => parsePayload(area.value, feedback, area));

    async function loadSchema() {
      const v = Number(version.value);
      try {
        const found = await api('GET', `/schemas/${seg(envelope.task_type)}/${v}`);
        schemaBox.replaceChildren(h('details', {},
          h('summary', {}, `Payload schema of ${envelope.task_type} version ${v}`),
          h('pre', {}, JSON.stringify(found.schema, null, 2))));
      } catch (err) {
        if (err.status === 404) {
          schemaBox.replaceChildren(h('p', { class: 'muted' },
            `No payload schema registered for ${envelope.task_type} version ${v}.`));
        } else {
          schemaBox.replaceChildren(h('p', { class: 'error' }, err.message));
        }
      }
    }
    version.addEventListener('change', loadSchema);
    loadSchema();

    const send = async (dryRun) => {
      const payload = parsePayload(area.value, feedback, area);
      if (payload === null) {
        area.focus();
        return;
      }
      const body = { payload, payload_version: Number(version.value), retry_count: Number(retries.value) };
      try {
        const answer = await api('POST', `/dead-letters/${seg(entry.queue)}/${seg(entry.id)}/replay`,
          { body, query: { dry_run: dryRun ? 'true' : undefined } });
        if (dryRun) {
          showOk(outcome, 'The edited task passes every rule and its payload schema.');
        } else {
          await refresh();
          showOk(outcome, `Replayed as stream entry ${answer.new_id}.`);
          for (const button of editorBox.querySelectorAll('button')) button.disabled = true;
        }
      } catch (err) {
        showError(outcome, err);
      }
    };
    const editorBox = h('form', { 'aria-label': 'Edit and replay', onsubmit: (e) => { e.preventDefault(); send(false); } },
      h('h4', {}, 'Edit and replay'),
      h('label', { for: 'dl-payload' }, 'Payload (JSON object)'), area, feedback,
      h('div', { class: 'filters' },
        field('payload_version', version),
        h('div', {}, h('label', { for: 'dl-retries' }, 'retry_count'), retries,
          h('span', { id: 'dl-retries-hint', class: 'muted' }, ' 0 resets the retries'))),
      schemaBox,
      h('div', { class: 'actions' },
        h('button', { type: 'button', onclick: () => send(true) }, 'Check'),
        h('button', { type: 'submit', class: 'primary' }, 'Replay'), outcome));
    return editorBox;
  }

  form.addEventListener('submit', (event) => {
    event.preventDefault();
    refresh();
  });
  refresh();
}
