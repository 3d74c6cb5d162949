"""The store objects one dispatcher works with, all on one Redis client."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from kombu_envelope.dispatcher.routing import Router
from kombu_envelope.settings import Settings
from kombu_envelope.store.dead_letters import DeadLetters
from kombu_envelope.store.delayed import DelayedTasks
from kombu_envelope.store.periodic_entries import PeriodicEntries
from kombu_envelope.store.publisher import Publisher


class Stores:
    """Publisher, delayed tasks, dead letters, periodic entries, task records, worker
    announcements and payload schemas of one key prefix."""

    def __init__(self, client: Any, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.publisher = Publisher(client, settings)
        self.delayed = DelayedTasks(client, settings)
        self.dead_letters = DeadLetters(client, settings)
        self.periodic = PeriodicEntries(client, settings)

    @cached_property
    def records(self) -> Any:
        """Task records (docs/protocol.md, section 14)."""
        from kombu_envelope.store.task_records import TaskRecords

        return TaskRecords(self.client, self.settings)

    @cached_property
    def announcements(self) -> Any:
        """Worker announcements (section 15)."""
        from kombu_envelope.store.announcements import Announcements

        return Announcements(self.client, self.settings)

    @cached_property
    def router(self) -> Router:
        """Where posted tasks go (section 15's served check)."""
        return Router(self.announcements)

    @cached_property
    def schemas(self) -> Any:
        """Payload schemas (section 16), cached ``schema_cache_s``."""
        from kombu_envelope.store.schemas import PayloadSchemas

        return PayloadSchemas(self.client, self.settings)
