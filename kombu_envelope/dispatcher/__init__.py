"""The dispatcher: one HTTP API through which any service schedules, cancels and inspects
tasks (``pip install 'kombu-envelope[dispatcher]'``; see docs/dispatcher.md).

Start it with ``python -m kombu_envelope.dispatcher --url envelope://...`` or
``celery -A proj envelope dispatcher``. :func:`create_app` builds the ASGI app.
"""

from __future__ import annotations

from kombu_envelope.dispatcher.app import create_app
from kombu_envelope.dispatcher.config import DispatcherConfig, Scope, Token

__all__ = ["DispatcherConfig", "Scope", "Token", "create_app"]
