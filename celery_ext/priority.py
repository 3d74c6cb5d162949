"""Celery priorities <-> Envelope priorities.

Celery on Redis uses 0..9 with 0 the most urgent; an Envelope uses 0..255
with 255 the most urgent. The maps are linear and exact at both ends:

* Celery ``p`` (clamped to 0..9) -> ``round(255 * (9 - p) / 9)``;
* Envelope ``e`` -> ``round(9 - e * 9 / 255)``;
* no Celery priority <-> the Envelope default, 100.

kombu fills in priority 0 when a task has none, which would make every
ordinary Celery task the most urgent one. :func:`mark_unset_priority`, a
``before_task_publish`` receiver, sets the message property
:data:`UNSET_PRIORITY_PROPERTY` on tasks published without a priority so the
adapter can tell "no priority" from "priority 0".
"""

from __future__ import annotations

from typing import Any

from kombu_envelope.envelope import PRIORITY_DEFAULT, PRIORITY_MAX

#: Least urgent Celery priority on Redis (0 is the most urgent).
CELERY_PRIORITY_MAX = 9

#: Message property set on tasks published without a priority.
UNSET_PRIORITY_PROPERTY = "envelope_priority_unset"


def to_envelope_priority(celery_priority: Any) -> int:
    """The Envelope priority of a Celery priority (None or not a number: the default)."""
    if isinstance(celery_priority, bool) or not isinstance(celery_priority, (int, float)):
        return PRIORITY_DEFAULT
    clamped = min(max(celery_priority, 0), CELERY_PRIORITY_MAX)
    return round(PRIORITY_MAX * (CELERY_PRIORITY_MAX - clamped) / CELERY_PRIORITY_MAX)


def to_celery_priority(priority: int) -> int | None:
    """The Celery priority of an Envelope priority (the default 100 becomes None)."""
    if priority == PRIORITY_DEFAULT:
        return None
    return round(CELERY_PRIORITY_MAX - priority * CELERY_PRIORITY_MAX / PRIORITY_MAX)


def mark_unset_priority(properties: dict[str, Any] | None = None, **_: Any) -> None:
    """``before_task_publish`` receiver: mark tasks published without a priority.

    Celery logs an exception raised by a receiver and publishes anyway; the
    task would then be stored with priority 255, so this receiver never raises.
    """
    if properties is not None and properties.get("priority") is None:
        properties[UNSET_PRIORITY_PROPERTY] = True
