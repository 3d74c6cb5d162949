"""Idempotency claims: a task with an ``idempotency_key`` has its effect once.

docs/protocol.md, section 9. Before running, a worker claims
``<prefix>:idem:<task_type>:<key>`` with ``idem_begin.lua`` as holder
``"<consumer> <task_id>"`` (a Celery worker, whose pool processes share a consumer,
adds the entry id):

* ``acquired``: run, then :meth:`Idempotency.finish` with success (a done
  marker kept ``done_ttl_s``) or failure (the claim is released for a retry);
* ``done``: the effect already happened: do not run, count a duplicate;
* ``busy``: another consumer runs it. :meth:`Idempotency.claim` takes the
  claim over when that consumer's liveness key is gone and stays gone for one
  renewal interval; otherwise the caller defers the task.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any

from kombu_envelope.envelope import format_rfc3339, utcnow
from kombu_envelope.settings import Settings
from kombu_envelope.store.outages import AnsweredAtOnce
from kombu_envelope.store.replication import run_script
from kombu_envelope.store.replies import as_text

logger = logging.getLogger(__name__)

#: How long a done marker is kept by default (seconds).
DEFAULT_DONE_TTL_S = 24 * 3600
#: How long a claim lasts for a task without ``timeout_ms`` (ms).
DEFAULT_CLAIM_MS = 3_600_000


class ClaimState(str, Enum):
    """Answer of ``idem_begin.lua``."""

    ACQUIRED = "acquired"
    DONE = "done"
    BUSY = "busy"


@dataclass(frozen=True)
class Claim:
    """One claim attempt: ``other`` is the busy holder or the done marker."""

    state: ClaimState
    key: str
    holder: str
    other: str | None = None
    taken_over: str | None = None



class Idempotency:
    """Claim, finish and take over idempotency keys."""

    def __init__(self, client: Any, settings: Settings | None = None, *,
                 done_ttl_s: float = DEFAULT_DONE_TTL_S) -> None:
        self.client = client
        self.settings = settings or Settings()
        self.done_ttl_s = done_ttl_s

    @staticmethod
    def holder(consumer: str, task_id: str, entry_id: str | None = None) -> str:
        """The holder of a claim: ``"<consumer> <task_id>"``, and `` <entry_id>`` when
        several processes run the attempts of one consumer (docs/protocol.md, section 9)."""
        return f"{consumer} {task_id} {entry_id}" if entry_id else f"{consumer} {task_id}"

    def claim_ms(self, timeout_ms: int | None) -> int:
        """How long a claim lasts: ``timeout_ms + lease_ms``, or one hour."""
        return timeout_ms + self.settings.lease_ms if timeout_ms else DEFAULT_CLAIM_MS

    def begin(self, task_type: str, idempotency_key: str, holder: str, *,
              timeout_ms: int | None = None, replace: str = "") -> Claim:
        """One call of ``idem_begin.lua`` (``replace``: the dead holder to take over)."""
        key = self.settings.keys.idempotency(task_type, idempotency_key)
        reply = run_script(self.client, self.settings, "idem_begin", [key],
                           [holder, self.claim_ms(timeout_ms), replace], "idempotency claim")
        state = ClaimState(as_text(reply[0]))
        other = as_text(reply[1]) if len(reply) > 1 else None
        return Claim(state, key, holder, other, replace or None)

    def holder_gone(self, holder: str) -> bool:
        """True when the consumer of ``holder`` has no liveness key, and still has none
        one renewal interval (``lease_ms / 3``) later, both looks answered at once.

        A live holder whose key expired while Redis was away sets it again within
        that interval (docs/protocol.md, section 9).
        """
        key = self.settings.keys.consumer(holder.split(" ", 1)[0])
        interval_s = self.settings.lease_ms / 3000
        for look in range(2):
            if look:
                time.sleep(interval_s)
            watch = AnsweredAtOnce(interval_s)
            if self.client.exists(key) or watch.waited():
                return False
        return True

    def claim(self, task_type: str, idempotency_key: str, holder: str, *,
              timeout_ms: int | None = None) -> Claim:
        """Claim the key, taking it over from a holder whose consumer died."""
        claim = self.begin(task_type, idempotency_key, holder, timeout_ms=timeout_ms)
        if claim.state is ClaimState.BUSY and claim.other and self.holder_gone(claim.other):
            logger.warning("idempotency key %s: holder %r is dead; taking the claim over",
                           claim.key, claim.other)
            claim = self.begin(task_type, idempotency_key, holder, timeout_ms=timeout_ms,
                               replace=claim.other)
        return claim

    def finish(self, claim: Claim, succeeded: bool, now: datetime | None = None, *,
               may_not_hold: bool = False) -> bool:
        """Mark the key done (success) or release it (failure).

        Returns False when the claim had been taken over meanwhile: the task may
        then have run twice, which is logged, unless ``may_not_hold`` (a release of a
        claim whose ``idem_begin.lua`` reply was lost: it may never have been taken).
        """
        args = [claim.holder, "done" if succeeded else "release",
                int(self.done_ttl_s * 1000), format_rfc3339(now or utcnow())]
        settled = bool(run_script(self.client, self.settings, "idem_finish", [claim.key], args,
                                  "idempotency done marker"))
        if not settled and not may_not_hold:
            logger.warning("idempotency key %s was taken over while %r held it; "
                           "the task may have run twice", claim.key, claim.holder)
        return settled
