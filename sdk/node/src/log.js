// JSON-per-line logs on stderr. Every line carries trace_id and task_id (null
// when the line is not about one task), so one request can be followed
// across languages.

import util from 'node:util';

const LEVELS = { debug: 10, info: 20, warn: 30, error: 40 };

function errorFields(err) {
  if (!(err instanceof Error)) return { error: util.inspect(err) };
  return { error: err.message, error_type: err.name, stack: err.stack };
}

export function createLogger({ stream = process.stderr, level = process.env.ENVELOPE_LOG_LEVEL || 'info', fields = {} } = {}) {
  const min = LEVELS[level] ?? LEVELS.info;
  const write = (lvl, msg, extra = {}) => {
    if (LEVELS[lvl] < min) return;
    const { err, ...rest } = extra;
    const line = {
      ts: new Date().toISOString(), level: lvl, msg, trace_id: null, task_id: null,
      ...fields, ...rest, ...(err === undefined ? {} : errorFields(err)),
    };
    let text;
    try {
      text = JSON.stringify(line, (_, v) => (typeof v === 'bigint' ? v.toString() : v));
    } catch {
      text = JSON.stringify({ ts: line.ts, level: lvl, msg, trace_id: line.trace_id, task_id: line.task_id, note: 'unserializable log fields' });
    }
    stream.write(`${text}\n`);
  };
  return {
    debug: (msg, extra) => write('debug', msg, extra),
    info: (msg, extra) => write('info', msg, extra),
    warn: (msg, extra) => write('warn', msg, extra),
    error: (msg, extra) => write('error', msg, extra),
    child: (more) => createLogger({ stream, level, fields: { ...fields, ...more } }),
  };
}
