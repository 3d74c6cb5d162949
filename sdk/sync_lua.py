"""Copy the Lua scripts of ``kombu_envelope/lua/`` into every SDK, or check the copies.

The scripts have one source; each SDK ships them inside its package (Go embeds them,
Node ships them as package files, Java as jar resources)::

    python sdk/sync_lua.py           # copy
    python sdk/sync_lua.py --check   # exit 1, naming them, when a copy differs or is missing

Only SDKs that exist are written to; a copy of a script that no longer exists is removed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "kombu_envelope" / "lua"

#: SDK folder -> where its copies live, relative to the SDK folder.
DESTINATIONS = {
    "go": Path("lua"),
    "node": Path("lua"),
    "java": Path("src/main/resources/io/kombuenvelope/lua"),
}


def destinations() -> list[Path]:
    """The copy folders of the SDKs present in the tree."""
    return [ROOT / "sdk" / sdk / folder for sdk, folder in DESTINATIONS.items()
            if (ROOT / "sdk" / sdk).is_dir()]


def differences() -> list[str]:
    """Copies that differ from their source, are missing, or have no source."""
    sources = {path.name: path.read_bytes() for path in sorted(SOURCE.glob("*.lua"))}
    found = []
    for folder in destinations():
        copies = {path.name: path for path in folder.glob("*.lua")} if folder.is_dir() else {}
        for name, text in sources.items():
            if name not in copies:
                found.append(f"{folder / name}: missing")
            elif copies[name].read_bytes() != text:
                found.append(f"{folder / name}: differs from {SOURCE / name}")
        found += [f"{copies[name]}: no such script in {SOURCE}" for name in copies
                  if name not in sources]
    return found


def sync() -> None:
    """Make every SDK's copies equal to the sources."""
    sources = {path.name: path.read_bytes() for path in SOURCE.glob("*.lua")}
    for folder in destinations():
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("*.lua"):
            if stale.name not in sources:
                stale.unlink()
        for name, text in sources.items():
            (folder / name).write_bytes(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check the copies")
    args = parser.parse_args(argv)
    if args.check:
        found = differences()
        for line in found:
            print(line, file=sys.stderr)
        return 1 if found else 0
    sync()
    return 0


if __name__ == "__main__":
    sys.exit(main())
