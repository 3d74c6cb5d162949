"""Who may call what: bearer tokens with scopes, and a rate limit per token.

Each route depends on :func:`require` with the scope it needs. Without configured
tokens every request is allowed (the dispatcher then listens on loopback only) and the
rate limit applies per client address.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request

from kombu_envelope.dispatcher.config import DispatcherConfig, Scope, Token
from kombu_envelope.dispatcher.problems import Problem

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="kombu-envelope"'}


@dataclass
class _Bucket:
    tokens: float
    at: float


class RateLimiter:
    """A token bucket per caller: ``rate_per_s`` on average, ``burst`` at once."""

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate = rate_per_s
        self.burst = float(burst)
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def wait_s(self, caller: str) -> float:
        """0 when ``caller`` may go on (and count it), else the seconds until it may."""
        now = time.monotonic()
        with self._lock:
            bucket = self._buckets.setdefault(caller, _Bucket(self.burst, now))
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.at) * self.rate)
            bucket.at = now
            if bucket.tokens >= 1:
                bucket.tokens -= 1
                return 0.0
            return (1 - bucket.tokens) / self.rate


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Problem(401, "unauthorized", "the Authorization header must be "
                      "'Bearer <token>'", headers=_CHALLENGE)
    return secret.strip()


def caller(request: Request, config: DispatcherConfig) -> Token | None:
    """The token of ``request`` (None without configured tokens); raises 401."""
    if not config.tokens:
        return None
    secret = _bearer(request)
    if secret is None:
        raise Problem(401, "unauthorized", "a bearer token is required "
                      "(Authorization: Bearer <token>)", headers=_CHALLENGE)
    token = config.token(secret)
    if token is None:
        raise Problem(401, "unauthorized", "the bearer token is not known", headers=_CHALLENGE)
    return token


def _within_rate(limiter: RateLimiter, who: str) -> None:
    wait = limiter.wait_s(who)
    if wait:
        raise Problem(429, "rate_limited", "too many requests; try again later",
                      headers={"Retry-After": str(max(1, round(wait)))})


def require(scope: Scope) -> Callable[[Request], Awaitable[None]]:
    """A route dependency: the caller's token must allow ``scope``, within its rate.

    A coroutine, though it never waits: FastAPI runs a plain function dependency in its
    thread pool, a thread hop on every request.
    """

    async def check(request: Request) -> None:
        state = request.app.state
        address = request.client.host if request.client else "?"
        try:
            token = caller(request, state.config)
        except Problem:
            _within_rate(state.limiter, f"unauthorized:{address}")  # no guessing at speed
            raise
        who = token.name if token else address
        request.state.caller = who
        request.state.scope = token.scope if token else Scope.OPERATOR
        _within_rate(state.limiter, who)
        if token is not None and not token.scope.allows(scope):
            raise Problem(403, "forbidden", f"this endpoint needs scope {scope.value}; the "
                          f"token has scope {token.scope.value}")

    return check
