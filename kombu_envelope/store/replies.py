"""Redis replies as Python values."""

from __future__ import annotations

from typing import Any


def as_text(reply: Any) -> str:
    """A reply as ``str``: bytes decoded as UTF-8 (invalid bytes replaced, never an
    error), anything else through ``str()``."""
    return reply.decode("utf-8", "replace") if isinstance(reply, bytes) else str(reply)
