"""Redis replies as Python values."""

from __future__ import annotations

from typing import Any


def as_text(reply: Any) -> str:
    """A reply as ``str``: bytes decoded as UTF-8, anything else through ``str()``."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)
