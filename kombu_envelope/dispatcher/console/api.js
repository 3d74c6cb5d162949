// Calls to the dispatcher's HTTP API with the signed-in bearer token.

const TOKEN_KEY = 'kombu-envelope.token';
// The API is served one level above /console/.
const ROOT = new URL('../', import.meta.url);

/** The bearer token of this tab (sessionStorage), or null. */
export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

/** An answer other than success: its status, the API's message and violations. */
export class ApiError extends Error {
  constructor(status, body) {
    super(body?.message ?? `the dispatcher answered HTTP ${status}`);
    this.status = status;
    this.error = body?.error ?? 'error';
    this.violations = body?.violations ?? [];
  }
}

function url(path, query) {
  const found = new URL(path.replace(/^\//, ''), ROOT);
  for (const [name, value] of Object.entries(query ?? {})) {
    for (const item of [value].flat()) {
      if (item !== undefined && item !== null && item !== '') found.searchParams.append(name, item);
    }
  }
  return found;
}

/**
 * Call the API: resolves to the parsed JSON (or text with `as: 'text'`), rejects
 * with an ApiError for any status other than 2xx.
 */
export async function api(method, path, { query, body, as = 'json' } = {}) {
  const headers = { Accept: as === 'json' ? 'application/json' : 'text/plain' };
  const secret = token.get();
  if (secret) headers.Authorization = `Bearer ${secret}`;
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const answer = await fetch(url(path, query), {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
  });
  if (!answer.ok) throw new ApiError(answer.status, await answer.json().catch(() => null));
  if (answer.status === 204) return null;
  return as === 'text' ? answer.text() : answer.json();
}

/** Encode one path segment. */
export const seg = (value) => encodeURIComponent(value);
