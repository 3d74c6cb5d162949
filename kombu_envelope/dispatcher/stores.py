"""The store objects one dispatcher works with, all on one Redis client."""

from __future__ import annotations

from typing import Any

from kombu_envelope.dispatcher.routing import Router
from kombu_envelope.settings import Settings
from kombu_envelope.store.announcements import Announcements
from kombu_envelope.store.dead_letters import DeadLetters
from kombu_envelope.store.delayed import DelayedTasks
from kombu_envelope.store.periodic_entries import PeriodicEntries
from kombu_envelope.store.publisher import Publisher
from kombu_envelope.store.schemas import PayloadSchemas
from kombu_envelope.store.task_limits import TaskLimits
from kombu_envelope.store.task_records import TaskRecords


class Stores:
    """Publisher, delayed tasks, dead letters, periodic entries, task records (section 14),
    worker announcements and the router they feed (section 15), payload schemas
    (section 16) and limits per task type (section 19) of one key prefix."""

    def __init__(self, client: Any, settings: Settings) -> None:
        self.client = client
        self.settings = settings
        self.publisher = Publisher(client, settings)
        self.delayed = DelayedTasks(client, settings)
        self.dead_letters = DeadLetters(client, settings)
        self.periodic = PeriodicEntries(client, settings)
        self.records = TaskRecords(client, settings)
        self.announcements = Announcements(client, settings)
        self.router = Router(self.announcements)
        self.schemas = PayloadSchemas(client, settings)
        self.limits = TaskLimits(client, settings)
