"""Freeing a concurrency slot (docs/protocol.md, section 19, "Slots").

A slot is a member ``"<stream> <entry id>"`` of its type's running key. The settle that
frees it removes the member and, in the same ``MULTI``, appends to the queue's
``slot-freed`` stream, which ends the blocking wait of every consumer waiting for a slot
(``NOMKSTREAM``: while nobody waits the stream does not exist and the append does
nothing).
"""

from __future__ import annotations

from typing import Any

__all__ = ["free_slot"]


def free_slot(pipe: Any, running_key: str, member: str) -> None:
    """Queue, on ``pipe`` (a pipeline of the queue's slot), the commands that free the
    slot ``member`` of ``running_key`` (``<prefix>:{<queue>}:running:<task_type>``)."""
    base, _, task_type = running_key.partition("}:running:")
    pipe.zrem(running_key, member)
    pipe.xadd(f"{base}}}:slot-freed", {"t": task_type}, maxlen=1, approximate=False,
              nomkstream=True)
