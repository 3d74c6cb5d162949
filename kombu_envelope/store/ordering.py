"""Ordering keys (docs/protocol.md, section 20): tasks with one key run one at a time.

The scripts keep the order: a keyed task joins its key when it enters its queue and is
added to a stream only as the key's head. What is left to a consumer is to move the key on
when the head is settled for good (:func:`add_advance`, in the settling ``MULTI``), to hold
the key while a run acknowledged early lasts (:class:`OrderingKeys`), and the operators'
view of keys: which are halted or stuck, and skipping a head.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from redis.exceptions import RedisError

from kombu_envelope.errors import InvalidEnvelope, Violation
from kombu_envelope.keys import QueueKeys
from kombu_envelope.settings import Settings
from kombu_envelope.store.replication import execute, write_pipeline
from kombu_envelope.store.replies import as_text

logger = logging.getLogger(__name__)


class OnDeadLetter(str, Enum):
    """What a dead-lettered head does to its key: the policy of its task type."""

    ADVANCE = "advance"  #: the key moves on to its next task (the default)
    HALT = "halt"  #: the key waits until an operator replays or skips the head


def held_member(key: str, task_id: str, stream: str, entry_id: str) -> str:
    """The ``order-held`` member of a run of ``task_id``, read from ``stream``."""
    return f"{key}\n{task_id}\n{stream}\n{entry_id}"


def add_advance(pipe: Any, keys: QueueKeys, key: str, task_id: str) -> None:
    """Queue on ``pipe`` (a ``MULTI`` on the queue's slot) the commands that move ``key``
    on past its head ``task_id``; :func:`wake_promoters` after it ran."""
    pipe.lrem(keys.order(key), 1, task_id)
    pipe.rpush(keys.order_advanced, key)


def wake_promoters(client: Any, settings: Settings) -> None:
    """``PUBLISH <prefix>:wakeup 0``, best effort: the promoters release the next head at
    their next look anyway."""
    try:
        client.publish(settings.keys.wakeup_channel, "0")
    except RedisError as exc:
        logger.debug("waking the promoters failed: %r", exc)


@dataclass(frozen=True)
class KeyState:
    """One ordering key of a queue, as an operator sees it."""

    key: str
    head: str | None  #: the task_id whose turn it is
    waiting: int  #: tasks stored until their turn
    halted_for: str | None  #: the dead-lettered head the key waits for, if halted


class OrderingKeys:
    """The ordering keys of one Redis: holds for runs acknowledged early, policies, views."""

    def __init__(self, client: Any, settings: Settings) -> None:
        self.client = client
        self.settings = settings

    def _keys(self, queue: str) -> QueueKeys:
        return self.settings.keys.queue(queue)

    # ---------------------------------------------------------- runs acknowledged early

    def hold(self, queue: str, member: str) -> None:
        """Hold a key for a run (``member``: :func:`held_member`) for ``lease_ms``; the
        lease keeper renews it while the run lasts."""
        deadline = int(time.time() * 1000) + self.settings.lease_ms
        self.client.zadd(self._keys(queue).order_held, {member: deadline})

    def finish(self, queue: str, member: str, *, advance: bool) -> None:
        """The run of ``member`` ended: drop its hold and, with ``advance``, move its key
        on past its task (it is settled for good), in one ``MULTI``."""
        keys = self._keys(queue)
        key, task_id, stream, _ = member.split("\n")
        pipe = write_pipeline(self.client, self.settings, transaction=True, key=stream)
        pipe.zrem(keys.order_held, member)
        if advance:
            add_advance(pipe, keys, key, task_id)
        execute(pipe, self.settings, "ordering key")
        if advance:
            wake_promoters(self.client, self.settings)

    def dead(self, queue: str, member: str, task_type: str) -> None:
        """The head of a run acknowledged early was dead-lettered by this process: its key
        moves on or halts by its type's policy (``dead_letter.lua`` does this itself for
        an entry still pending)."""
        keys = self._keys(queue)
        key, task_id, _, _ = member.split("\n")
        if self.policy(queue, task_type) is OnDeadLetter.HALT:
            pipe = write_pipeline(self.client, self.settings, transaction=True,
                                  key=keys.order_halted)
            pipe.zrem(keys.order_held, member)
            pipe.hset(keys.order_halted, key, task_id)
            execute(pipe, self.settings, "ordering key")
        else:
            self.finish(queue, member, advance=True)

    # ---------------------------------------------------------- policies

    def policy(self, queue: str, task_type: str) -> OnDeadLetter:
        """What a dead-lettered head of ``task_type`` does to its key on ``queue``."""
        return _stored_policy(self.client.hget(self._keys(queue).order_policy, task_type))

    def set_policy(self, queue: str, task_type: str, policy: OnDeadLetter | str) -> None:
        """Store ``policy`` (``advance`` or ``halt``) for ``task_type`` on ``queue``."""
        try:
            chosen = OnDeadLetter(policy)
        except ValueError:
            raise InvalidEnvelope([Violation(
                field="on_dead_letter", rule="enum",
                message=f"must be 'advance' or 'halt', not {policy!r}")]) from None
        self.client.hset(self._keys(queue).order_policy, task_type, chosen.value)

    def policies(self, queue: str) -> dict[str, OnDeadLetter]:
        """Every task type with a stored policy on ``queue``."""
        stored = self.client.hgetall(self._keys(queue).order_policy)
        return {as_text(t): _stored_policy(v) for t, v in stored.items()}

    # ---------------------------------------------------------- operators

    def state(self, queue: str, key: str) -> KeyState:
        """What ``key`` of ``queue`` holds now."""
        keys = self._keys(queue)
        pipe = self.client.pipeline(transaction=False)
        pipe.lindex(keys.order(key), 0)
        pipe.hlen(keys.order_waiting(key))
        pipe.hget(keys.order_halted, key)
        head, waiting, halted = pipe.execute()
        return KeyState(key, as_text(head) if head is not None else None, int(waiting),
                        as_text(halted) if halted is not None else None)

    def keys(self, queue: str, count: int = 1000) -> list[KeyState]:
        """The keys of ``queue`` that have tasks (at most ``count``), by a ``SCAN``."""
        pattern = self._keys(queue).order("*")
        prefix = len(pattern) - 1
        found = []
        for name in self.client.scan_iter(match=pattern, count=500):
            found.append(self.state(queue, as_text(name)[prefix:]))
            if len(found) >= count:
                break
        return sorted(found, key=lambda state: state.key)

    def skip(self, queue: str, key: str) -> str | None:
        """Move ``key`` on past its head (a halted or lost one); return the head skipped."""
        keys = self._keys(queue)
        head = self.client.lindex(keys.order(key), 0)
        if head is None:
            return None
        pipe = write_pipeline(self.client, self.settings, transaction=True, key=keys.order(key))
        add_advance(pipe, keys, key, as_text(head))
        pipe.hdel(keys.order_halted, key)
        execute(pipe, self.settings, "ordering key")
        wake_promoters(self.client, self.settings)
        return as_text(head)


def _stored_policy(value: Any) -> OnDeadLetter:
    """The policy an ``order-policy`` value names: ``halt``, else the default."""
    return OnDeadLetter.HALT if value is not None and as_text(value) == "halt" \
        else OnDeadLetter.ADVANCE
