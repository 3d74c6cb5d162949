// The console's entry: sign-in, the caller's scope, and the pages behind #hash links.

import { api, token } from './api.js';
import { showError } from './dom.js';
import * as deadLetters from './dead-letters.js';
import * as delayed from './delayed.js';
import * as overview from './overview.js';

const PAGES = { overview, 'dead-letters': deadLetters, delayed };
const SCOPES = ['read', 'write', 'operator'];

const $ = (id) => document.getElementById(id);
let session = null;
let stopPage = null;

/** True when the signed-in token's scope includes `scope`. */
const can = (scope) => SCOPES.indexOf(session.scope) >= SCOPES.indexOf(scope);

function showPage() {
  stopPage?.();
  stopPage = null;
  const name = Object.hasOwn(PAGES, location.hash.slice(1)) ? location.hash.slice(1) : 'overview';
  for (const link of $('nav').querySelectorAll('a')) {
    if (link.hash === `#${name}`) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
  const root = $('page');
  root.replaceChildren();
  stopPage = PAGES[name].render(root, { can }) ?? null;
}

function signedIn(who) {
  session = who;
  $('sign-in').hidden = true;
  $('nav').hidden = false;
  $('sign-out').hidden = !who.authenticated;
  $('who').textContent = who.authenticated ? `${who.name} (${who.scope})` : 'no tokens configured (loopback only)';
  showPage();
}

function signIn(message) {
  session = null;
  stopPage?.();
  stopPage = null;
  $('page').replaceChildren();
  $('nav').hidden = true;
  $('sign-out').hidden = true;
  $('who').textContent = '';
  $('sign-in').hidden = false;
  $('sign-in-error').textContent = message ?? '';
  $('token').focus();
}

async function start() {
  try {
    signedIn(await api('GET', '/whoami'));
  } catch (err) {
    if (err.status === 401) {
      const expired = token.get() !== null;
      token.clear();
      signIn(expired ? err.message : '');
    } else {
      showError($('sign-in-error'), err);
      $('sign-in').hidden = false;
    }
  }
}

$('sign-in').addEventListener('submit', async (event) => {
  event.preventDefault();
  token.set($('token').value.trim());
  $('token').value = '';
  try {
    signedIn(await api('GET', '/whoami'));
  } catch (err) {
    token.clear();
    signIn();
    showError($('sign-in-error'), err);
  }
});
$('sign-out').addEventListener('click', () => {
  token.clear();
  signIn();
});
window.addEventListener('hashchange', () => {
  if (session) {
    showPage();
    $('main').focus();
  }
});

start();
