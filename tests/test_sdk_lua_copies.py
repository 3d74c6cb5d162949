"""Every SDK ships the Lua scripts of kombu_envelope/lua/ unchanged (sdk/sync_lua.py)."""

from __future__ import annotations

import re
import subprocess
import sys

from support.workers import PROJECT_ROOT


def test_every_sdk_copy_of_the_lua_scripts_equals_its_source() -> None:
    done = subprocess.run([sys.executable, str(PROJECT_ROOT / "sdk" / "sync_lua.py"), "--check"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"run python sdk/sync_lua.py:\n{done.stderr}"


def test_every_script_that_writes_task_records_has_the_same_write_record() -> None:
    """A script is sent to Redis on its own (no includes), so the scripts that take a task
    record (docs/protocol.md, section 14) each carry ``write_record``: the same text."""
    lua = PROJECT_ROOT / "kombu_envelope" / "lua"
    pattern = re.compile(r"^-- The task record .*?^end\n", re.S | re.M)
    copies = {path.name: pattern.findall(path.read_text()) for path in sorted(lua.glob("*.lua"))}
    found = {name: found[0] for name, found in copies.items() if found}
    assert set(found) == {"cancel.lua", "dead_letter.lua", "enqueue.lua", "periodic.lua",
                          "replay.lua", "requeue.lua", "retry.lua", "schedule.lua"}
    assert len(set(found.values())) == 1, "write_record differs between scripts"
