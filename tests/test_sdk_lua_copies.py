"""Every SDK ships the Lua scripts of kombu_envelope/lua/ unchanged (sdk/sync_lua.py)."""

from __future__ import annotations

import subprocess
import sys

from support.workers import PROJECT_ROOT


def test_every_sdk_copy_of_the_lua_scripts_equals_its_source() -> None:
    done = subprocess.run([sys.executable, str(PROJECT_ROOT / "sdk" / "sync_lua.py"), "--check"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"run python sdk/sync_lua.py:\n{done.stderr}"
