"""ASGI middleware: security headers on every answer, and the request body size limit."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from kombu_envelope.dispatcher.problems import Problem

Scope_ = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope_, Receive, Send], Awaitable[None]]

#: Sent with every answer: nothing is framed, sniffed, cached or referred.
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
    (b"cross-origin-resource-policy", b"same-origin"),
]
#: The content security policy of the API's answers: nothing may load.
API_POLICY = b"default-src 'none'; frame-ancestors 'none'"
#: The policy of the console (``/console/``): its own scripts, styles and API calls only,
#: never an inline script or style.
CONSOLE_POLICY = (b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                  b"connect-src 'self'; form-action 'self'; base-uri 'none'; "
                  b"frame-ancestors 'none'")


def content_policy(path: str) -> bytes:
    """The ``Content-Security-Policy`` of an answer to ``path``."""
    return CONSOLE_POLICY if path == "/console" or path.startswith("/console/") else API_POLICY


class Guarded:
    """Adds :data:`SECURITY_HEADERS` and answers 413 to a body above ``max_body_bytes``
    (by its ``Content-Length``, or while it is read when it has none).

    A body with a ``Content-Length`` is not counted again as it is read: the HTTP server
    delivers exactly that many bytes (more are the next request). This runs on every
    request, so it does no more than that.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._message = f"the request body is larger than {max_body_bytes} bytes"

    async def __call__(self, scope: Scope_, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = (b"content-security-policy", content_policy(scope.get("path", "")))

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *SECURITY_HEADERS, policy]
            await send(message)

        length = _content_length(scope["headers"])
        if length is None:
            receive = self._counted(receive)
        elif not length.isdigit() or int(length) > self.max_body_bytes:
            await self._too_large(send_secured)
            return
        await self.app(scope, receive, send_secured)

    def _counted(self, receive: Receive) -> Receive:
        """``receive`` that raises 413 once the body read so far is above the limit."""
        seen = 0

        async def receive_limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:  # answered 413 by the app's handler
                    raise Problem(413, "body_too_large", self._message)
            return message

        return receive_limited

    async def _too_large(self, send: Send) -> None:
        body = json.dumps({"error": "body_too_large", "message": self._message}).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _content_length(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The value of the first ``Content-Length`` header, or None."""
    for name, value in headers:
        if name == b"content-length":
            return value
    return None
