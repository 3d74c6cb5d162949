"""Which Celery tasks retry automatically under the tiered policy.

A Celery task on ``envelope://`` retries as Celery documents: through
``self.retry()`` or ``autoretry_for``, with their countdown and
``max_retries``; a plain raise fails at once. The tiered policy
(docs/protocol.md, section 8: fast tier, backoff, retry-slot cap) also retries
plain raises, up to the task's ``max_retries``. A task gets it when

* the setting ``envelope_retry_policy`` asks: ``True`` (the defaults) or a dict
  of :class:`~kombu_envelope.retrying.RetryPolicy` fields;
* or its task option ``envelope_retry_policy`` does: ``True``, or a dict merged
  key by key over the setting's (``False`` keeps the setting's policy off that
  task);
* or its Envelope carries the header ``x-retry-policy: tiered`` (a producer in
  another language asked for it).

:func:`mark_tiered_tasks`, a ``before_task_publish`` receiver, writes that
header for the tasks that ask, so workers in every language retry them alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery import current_app

from celery_ext.registry import published_task
from kombu_envelope.retrying import RETRY_POLICY_HEADER, TIERED, RetryPolicy

#: Celery setting, and task option, asking for the tiered policy.
RETRY_POLICY_SETTING = "envelope_retry_policy"


@dataclass(frozen=True)
class TaskRetries:
    """How one task retries: ``tiered`` when it asks for automatic retries."""

    tiered: bool
    #: The policy's parameters (used when the task or its Envelope asks for it).
    policy: RetryPolicy


def _parse(value: Any, what: str) -> tuple[bool | None, Mapping[str, Any]]:
    """``(asks, config)`` of a setting or option value; ``asks`` None: not said."""
    if value is None:
        return None, {}
    if isinstance(value, bool):
        return value, {}
    if isinstance(value, Mapping):
        return True, value
    raise TypeError(f"{what} {RETRY_POLICY_SETTING} must be True, False, None or a dict, "
                    f"not {value!r}")


def asks_for_tiered_retries(setting: Any, option: Any) -> bool:
    """True when the setting, or the task option over it, asks for the tiered policy."""
    setting_asks, _ = _parse(setting, "setting")
    option_asks, _ = _parse(option, "task option")
    return bool(setting_asks if option_asks is None else option_asks)


def task_retries(setting: Any, option: Any) -> TaskRetries:
    """The retries of a task with ``option`` in an app with ``setting``.

    Raises TypeError or ValueError on a bad value, ImportError on a
    ``transient_exceptions`` class that cannot be imported.
    """
    _, base = _parse(setting, "setting")
    _, own = _parse(option, "task option")
    policy = RetryPolicy.from_config(own, base=RetryPolicy.from_config(base))
    return TaskRetries(asks_for_tiered_retries(setting, option), policy)


def mark_tiered_tasks(sender: Any = None, headers: dict[str, Any] | None = None,
                      **_: Any) -> None:
    """``before_task_publish`` receiver: ``x-retry-policy: tiered`` for tasks that ask.

    A header the caller set wins. A bad setting is reported at worker start
    (:func:`celery_ext.execution.install_execution_shell`), not here.
    """
    if headers is None or RETRY_POLICY_HEADER in headers or not isinstance(sender, str):
        return
    if sender.startswith("celery."):
        return  # canvas helpers: the execution shell leaves them alone
    app = current_app._get_current_object()
    task = published_task(sender)
    try:
        asks = asks_for_tiered_retries(app.conf.get(RETRY_POLICY_SETTING),
                                       getattr(task, RETRY_POLICY_SETTING, None))
    except TypeError:
        return
    if asks:
        headers[RETRY_POLICY_HEADER] = TIERED
