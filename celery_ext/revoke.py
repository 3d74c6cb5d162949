"""Celery's revoke also cancels tasks in Redis, for every worker of every language.

``AsyncResult.revoke()``, ``GroupResult.revoke()``, ``app.control.revoke()``
and ``celery control revoke`` all broadcast a remote-control message: method
``revoke`` on the fanout exchange ``<control_exchange>.pidbox``. Workers keep
the ids in memory and skip those tasks when they receive them; a worker
started (or restarted) later never heard of the revoke, a worker of another
language never hears of it, and a task whose ``countdown`` or ``eta`` is ahead
waits in Redis where no worker sees it.

:class:`RevokingChannel` is the ``envelope://`` channel that recognises that
broadcast as it is published and cancels each revoked id with
:meth:`~kombu_envelope.delayed.DelayedTasks.cancel_everywhere`
(docs/protocol.md, section 10): the id is marked in ``<prefix>:cancelled``,
which every consumer looks up before running a task whatever its queue, and
removed from the delayed set it waits in. A Celery worker that receives a
marked task records it ``REVOKED``; other consumers acknowledge it without
running it. The mark is kept 7 days, so the same id published again meanwhile
does not run either, as with Celery's own revoke.

Why the channel: Celery sends no signal for remote-control messages, and the
channel is the one place every revoke passes through exactly once, whichever
API sent it and whether or not any worker is listening, using the app's own
broker connection and key prefix. The cancellation happens before the
broadcast is sent, in the caller's thread, so once ``revoke()`` returns the
task is marked and out of the delayed set. Only revokes addressed to every worker (no
``destination``, which is what ``AsyncResult.revoke()`` sends) cancel in
Redis; a revoke sent to chosen workers stays a message to those workers.
Broadcasts are read only when JSON (Celery's default ``task_serializer``,
which ``envelope://`` requires for tasks).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from kombu.compression import decompress

from kombu_envelope.channel import Channel
from kombu_envelope.delayed import Cancellation, CancelOutcome, DelayedTasks

__all__ = ["RevokingChannel", "cancel_revoked", "revoked_task_ids"]

logger = logging.getLogger(__name__)

#: kombu names the exchange of a remote-control mailbox ``<namespace>.pidbox``.
PIDBOX_SUFFIX = ".pidbox"
#: The remote-control method Celery's revoke sends.
REVOKE_METHOD = "revoke"
JSON_CONTENT_TYPE = "application/json"


def revoked_task_ids(exchange: Any, message: Mapping[str, Any]) -> list[str]:
    """The task ids a message revokes on every worker; [] for any other message.

    ``message`` is kombu's message dict as a channel receives it for publishing.
    """
    if not isinstance(exchange, str) or not exchange.endswith(PIDBOX_SUFFIX):
        return []
    if message.get("content-type") != JSON_CONTENT_TYPE:
        return []
    body = message.get("body")
    if not isinstance(body, (str, bytes)):
        return []
    try:
        if isinstance(body, str):
            body = body.encode(message.get("content-encoding") or "utf-8")
        compression = (message.get("headers") or {}).get("compression")
        if compression:
            body = decompress(body, compression)
        command = json.loads(body)
    except (TypeError, ValueError, LookupError):
        return []
    if not isinstance(command, dict) or command.get("method") != REVOKE_METHOD:
        return []
    if command.get("destination"):
        return []
    arguments = command.get("arguments")
    task_ids = arguments.get("task_id") if isinstance(arguments, dict) else None
    if isinstance(task_ids, str):
        task_ids = [task_ids]
    if not isinstance(task_ids, list):
        return []
    return [task_id for task_id in task_ids if isinstance(task_id, str) and task_id]


def cancel_revoked(delayed: DelayedTasks, task_ids: Iterable[str]) -> dict[str, Cancellation]:
    """Cancel each revoked id, whatever its queue; return the outcome per id."""
    outcomes: dict[str, Cancellation] = {}
    for task_id in task_ids:
        outcome = outcomes[task_id] = delayed.cancel_everywhere(task_id)
        if outcome.outcome is CancelOutcome.REMOVED:
            logger.info("revoked task %s removed from the delayed set of %s", task_id,
                        outcome.queue)
    return outcomes


class RevokingChannel(Channel):
    """The ``envelope://`` channel; a revoke broadcast also cancels delayed tasks."""

    def basic_publish(self, message: dict[str, Any], exchange: str, routing_key: str,
                      **kwargs: Any) -> Any:
        task_ids = revoked_task_ids(exchange, message)
        if task_ids:
            cancel_revoked(DelayedTasks(self.client, self.settings), task_ids)
        return super().basic_publish(message, exchange, routing_key, **kwargs)
