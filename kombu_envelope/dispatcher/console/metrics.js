// Reading the dispatcher's GET /metrics (Prometheus text format) in the browser.

const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;

/** The samples of a scrape: `[{name, labels, value}]`. */
export function parseMetrics(text) {
  const samples = [];
  for (const line of text.split('\n')) {
    const match = SAMPLE.exec(line.trim());
    if (!match || line.startsWith('#')) continue;
    const labels = {};
    for (const [, name, value] of (match[2] ?? '').matchAll(LABEL)) {
      labels[name] = value.replace(/\\n/g, '\n').replace(/\\(.)/g, '$1');
    }
    samples.push({ name: match[1], labels, value: Number(match[3]) });
  }
  return samples;
}

/** Sum of `name`'s samples per value of `label`: a Map. */
export function sumBy(samples, name, label) {
  const sums = new Map();
  for (const sample of samples) {
    if (sample.name !== name) continue;
    const key = sample.labels[label] ?? '';
    sums.set(key, (sums.get(key) ?? 0) + sample.value);
  }
  return sums;
}

/** Per-second increase of counter sums between two scrapes `seconds` apart (a reset counts from 0). */
export function rates(before, after, seconds) {
  const found = new Map();
  for (const [key, value] of after) {
    const old = before.get(key) ?? 0;
    found.set(key, (value >= old ? value - old : value) / seconds);
  }
  return found;
}
