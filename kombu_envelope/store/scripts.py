"""The Lua scripts behind every multi-key step, loaded once per Redis client.

Each script lives in ``kombu_envelope/lua/<name>.lua`` with a header that
documents its KEYS and ARGV; other languages load the same files.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any
from weakref import WeakKeyDictionary

from redis.commands.core import Script

SCRIPT_NAMES = (
    "enqueue", "schedule", "promote", "read", "requeue", "dead_letter", "retry", "cancel",
    "idem_begin", "idem_finish", "retry_slot", "replay", "periodic", "forget_consumer",
)

_registered: WeakKeyDictionary[Any, dict[str, Script]] = WeakKeyDictionary()


@cache
def script_source(name: str) -> str:
    """Source text of script ``name``."""
    # Traversable.joinpath takes a single segment before Python 3.11.
    return (resources.files("kombu_envelope") / "lua" / f"{name}.lua").read_text("utf-8")


def script(client: Any, name: str) -> Script:
    """Script ``name`` registered on ``client`` (EVALSHA, falling back to EVAL once)."""
    scripts = _registered.get(client)
    if scripts is None:
        scripts = _registered[client] = {}
    found = scripts.get(name)
    if found is None:
        found = scripts[name] = client.register_script(script_source(name))
    return found
