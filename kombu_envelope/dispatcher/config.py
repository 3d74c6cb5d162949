"""What the dispatcher is configured with: where to listen, its tokens and its limits."""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

#: Environment variable holding tokens, ``<scope>:<token>[,<scope>:<token>...]``.
TOKENS_ENV = "KOMBU_ENVELOPE_DISPATCHER_TOKENS"
#: Environment variable naming a token file (see :func:`load_tokens`).
TOKENS_FILE_ENV = "KOMBU_ENVELOPE_DISPATCHER_TOKENS_FILE"


class Scope(str, Enum):
    """What a token may do; each scope includes the ones before it."""

    READ = "read"
    WRITE = "write"
    OPERATOR = "operator"

    def allows(self, needed: Scope) -> bool:
        """True when a token of this scope may call an endpoint that needs ``needed``."""
        order = list(Scope)
        return order.index(self) >= order.index(needed)


@dataclass(frozen=True)
class Token:
    """One bearer token: its secret, its scope, and a name for logs and rate limits."""

    secret: str = field(repr=False)
    scope: Scope
    name: str

    def __post_init__(self) -> None:
        if len(self.secret) < 16 or not self.secret.isprintable() or " " in self.secret:
            raise ValueError(f"token {self.name!r}: a token is at least 16 printable "
                             "characters without spaces")


def _token(scope: str, secret: str, name: str) -> Token:
    try:
        return Token(secret, Scope(scope), name)
    except ValueError as exc:
        if scope not in {s.value for s in Scope}:
            raise ValueError(f"token {name!r}: scope must be one of read, write, operator, "
                             f"not {scope!r}") from exc
        raise


def parse_tokens_env(text: str) -> list[Token]:
    """Tokens from ``<scope>:<token>,...`` (the environment variable form)."""
    found = []
    for number, item in enumerate((part.strip() for part in text.split(",")), 1):
        if not item:
            continue
        scope, sep, secret = item.partition(":")
        if not sep:
            raise ValueError(f"{TOKENS_ENV} item {number}: expected <scope>:<token>")
        found.append(_token(scope, secret, f"env-{number}"))
    return found


def load_token_file(path: Path) -> list[Token]:
    """Tokens from a JSON file: ``[{"name": "billing", "scope": "write", "token": "..."}]``."""
    try:
        items = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"token file {path}: {exc}") from exc
    if not isinstance(items, list):
        raise ValueError(f"token file {path}: must hold a JSON array of objects")
    found = []
    for number, item in enumerate(items, 1):
        if not isinstance(item, dict) or not all(
                isinstance(item.get(k), str) for k in ("scope", "token")):
            raise ValueError(f"token file {path}: item {number} needs string fields "
                             "'scope' and 'token'")
        found.append(_token(item["scope"], item["token"], str(item.get("name", number))))
    return found


def load_tokens(path: Path | None = None, environ: dict[str, str] | None = None) -> list[Token]:
    """Tokens from ``path`` (or ``$KOMBU_ENVELOPE_DISPATCHER_TOKENS_FILE``) and
    ``$KOMBU_ENVELOPE_DISPATCHER_TOKENS``; names and secrets must be unique."""
    environ = dict(os.environ) if environ is None else environ
    tokens: list[Token] = []
    file_name = path or (Path(environ[TOKENS_FILE_ENV]) if environ.get(TOKENS_FILE_ENV) else None)
    if file_name is not None:
        tokens += load_token_file(file_name)
    if environ.get(TOKENS_ENV):
        tokens += parse_tokens_env(environ[TOKENS_ENV])
    if len({t.secret for t in tokens}) != len(tokens) or len({t.name for t in tokens}) != len(
            tokens):
        raise ValueError("tokens: every token and every token name must be unique")
    return tokens


def is_loopback(host: str) -> bool:
    """True when ``host`` is a loopback address or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class DispatcherConfig:
    """The dispatcher's settings (the Redis side is :class:`~kombu_envelope.Settings`)."""

    #: Address to listen on; without tokens only a loopback address is allowed.
    host: str = "127.0.0.1"
    port: int = 8080
    #: Bearer tokens; none means no authentication (loopback only).
    tokens: tuple[Token, ...] = ()
    #: Largest request body (bytes); larger ones are answered 413.
    max_body_bytes: int = 4 * 1024 * 1024
    #: Most tasks in one ``POST /tasks:batch``.
    batch_max: int = 1000
    #: Requests per second allowed per token (per client address without tokens).
    rate_per_s: float = 1000.0
    #: Requests a token may make at once above the rate.
    rate_burst: int = 2000
    #: Most items a list endpoint returns.
    list_max: int = 1000
    #: Processes serving the port (forked after the Redis client is made; each makes its
    #: own connections). Each enforces ``1 / workers`` of the rate and burst.
    workers: int = 1

    def __post_init__(self) -> None:
        if not self.tokens and not is_loopback(self.host):
            raise ValueError(f"host {self.host!r}: without a token configured the dispatcher "
                             "listens on a loopback address only (configure tokens with "
                             f"--tokens-file or ${TOKENS_ENV})")
        for name in ("max_body_bytes", "batch_max", "rate_burst", "list_max", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)!r}")
        if self.rate_per_s <= 0:
            raise ValueError(f"rate_per_s must be above 0, not {self.rate_per_s!r}")

    @property
    def rate_per_process(self) -> tuple[float, int]:
        """(rate per second, burst) one of the ``workers`` processes allows a caller."""
        return self.rate_per_s / self.workers, max(1, self.rate_burst // self.workers)

    def token(self, secret: str) -> Token | None:
        """The token whose secret is ``secret`` (compared in constant time), or None."""
        match = None
        for token in self.tokens:
            if hmac.compare_digest(token.secret.encode(), secret.encode()):
                match = token
        return match
