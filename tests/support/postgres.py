"""A private PostgreSQL server from Debian's binaries, on a free loopback port.

Its data directory and socket live in a temporary directory; ``initdb`` refuses to
run as root, so as root the server runs as the ``postgres`` user (``runuser``).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

_BIN_GLOB = "/usr/lib/postgresql/*/bin"
_USER = "postgres"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PrivatePostgres:
    """``initdb`` + ``pg_ctl start`` in a temporary directory; :meth:`close` removes it."""

    def __init__(self) -> None:
        found = sorted(glob.glob(_BIN_GLOB))
        if not found:
            raise RuntimeError("PostgreSQL is not installed: apt-get install postgresql")
        self.bin = Path(found[-1])
        self.root = Path(tempfile.mkdtemp(prefix="envelope-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self._as_user = os.geteuid() == 0
        if self._as_user:
            shutil.chown(self.root, _USER)
        self._run("initdb", "-D", str(self.data), "-U", "test", "--auth=trust", "-E", "UTF8",
                  "--no-sync")
        self.start()

    @property
    def url(self) -> str:
        """SQLAlchemy URL (psycopg 3) of the server's ``postgres`` database."""
        return f"postgresql+psycopg://test@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        command = [str(self.bin / tool), *args]
        if self._as_user:
            command = ["runuser", "-u", _USER, "--", *command]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       timeout=60)

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   "-c fsync=off -c full_page_writes=off")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-o", options,
                  "-w", "start")
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server, ending every connection (``-m fast``)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def close(self) -> None:
        """Stop the server if it runs and remove its files."""
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass  # not running
        shutil.rmtree(self.root, ignore_errors=True)
