"""The cap on retries of one task type running at once (docs/protocol.md, section 8).

Before a retry (an attempt with ``retry_count > 0``) runs, it takes a slot with
``retry_slot.lua``; when every slot is taken, it is rescheduled on the backoff
tier instead of running. Slots are released when the attempt ends and expire
on their own when their worker dies.
"""

from __future__ import annotations

from typing import Any

from kombu_envelope.settings import Settings
from kombu_envelope.store.scripts import script

#: How long a slot is held by an attempt without ``timeout_ms`` (ms).
DEFAULT_SLOT_MS = 15 * 60 * 1000


class RetrySlots:
    """Take and release retry slots of task types."""

    def __init__(self, client: Any, settings: Settings | None = None) -> None:
        self.client = client
        self.settings = settings or Settings()

    def take(self, task_type: str, task_id: str, limit: int,
             timeout_ms: int | None = None) -> bool:
        """Take a slot for ``task_id`` (at most ``limit`` per task type); False when full."""
        reply = script(self.client, "retry_slot")(
            keys=[self.settings.keys.retrying(task_type)],
            args=[task_id, limit, timeout_ms or DEFAULT_SLOT_MS],
        )
        return bool(reply)

    def release(self, task_type: str, task_id: str) -> None:
        """Give back the slot of ``task_id``."""
        self.client.zrem(self.settings.keys.retrying(task_type), task_id)

    def held(self, task_type: str) -> int:
        """Slots of ``task_type`` held now (expired ones included until the next take)."""
        return int(self.client.zcard(self.settings.keys.retrying(task_type)))
