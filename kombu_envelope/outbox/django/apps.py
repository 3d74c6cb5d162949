"""The Django app of the outbox."""

from __future__ import annotations

from django.apps import AppConfig


class OutboxConfig(AppConfig):
    """``kombu_envelope.outbox.django``, labelled ``envelope_outbox``."""

    name = "kombu_envelope.outbox.django"
    label = "envelope_outbox"
    verbose_name = "Envelope outbox"
    default_auto_field = "django.db.models.BigAutoField"
