// Small DOM helpers shared by the pages: building elements, errors, confirmation.

import { ApiError } from './api.js';

/** An element with attributes (`on*` become listeners) and children (strings are text). */
export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === false || value === null || value === undefined) continue;
    if (name.startsWith('on')) node.addEventListener(name.slice(2), value);
    else if (name === 'class') node.className = value;
    else node.setAttribute(name, value === true ? '' : String(value));
  }
  node.append(...children.flat(Infinity).filter((c) => c !== null && c !== undefined && c !== false));
  return node;
}

/** A table with a header row; `rows` are arrays of cells (nodes or text). */
export function table(caption, headers, rows) {
  return h('table', {},
    h('caption', { class: 'muted' }, caption),
    h('thead', {}, h('tr', {}, headers.map((text) => h('th', { scope: 'col' }, text)))),
    h('tbody', {}, rows.length
      ? rows.map((cells) => h('tr', {}, cells.map((cell) => h('td', {}, cell))))
      : h('tr', {}, h('td', { colspan: headers.length, class: 'muted' }, 'None.'))));
}

/** Show `err` (an ApiError names each violated field and rule) in `box`. */
export function showError(box, err) {
  const lines = err instanceof ApiError
    ? [`${err.status} ${err.error}: ${err.message}`,
      ...err.violations.map((v) => `• ${v.field} (${v.rule}): ${v.message}`)]
    : [String(err?.message ?? err)];
  box.className = 'error';
  box.textContent = lines.join('\n');
}

/** Show a success message in `box`. */
export function showOk(box, text) {
  box.className = 'ok';
  box.textContent = text;
}

/** A status line (`role=status`) where an action's outcome appears. */
export const statusBox = () => h('p', { role: 'status', 'aria-live': 'polite', class: 'ok' });

/** Ask for confirmation in a modal dialog; resolves to true only for Confirm. */
export function confirmAction(title, text, confirmLabel = 'Confirm') {
  const dialog = document.getElementById('confirm');
  dialog.querySelector('#confirm-title').textContent = title;
  dialog.querySelector('#confirm-text').textContent = text;
  dialog.querySelector('#confirm-ok').textContent = confirmLabel;
  const opener = document.activeElement;
  dialog.returnValue = '';
  dialog.showModal();  // modal: the page behind is inert, Escape closes it
  return new Promise((resolve) => {
    dialog.addEventListener('close', () => {
      opener?.focus?.();
      resolve(dialog.returnValue === 'ok');
    }, { once: true });
  });
}

/** A local date and time for an RFC 3339 string. */
export const when = (text) => (text ? new Date(text).toLocaleString() : '—');
