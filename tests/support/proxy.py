"""A loopback TCP proxy in front of Redis that can lose a reply on purpose.

``drop_next_reply()`` makes the proxy discard the next bytes Redis sends and
close both sides: the command was applied, but its client never hears so, as
when a connection breaks or a server fails over at the wrong moment.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class LossyProxy:
    """Forwards ``127.0.0.1:<port>`` to a Redis server, one thread pair per connection."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._drop = threading.Event()
        self.dropped = 0
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        """``redis://`` URL of the proxy."""
        return f"redis://127.0.0.1:{self.port}/0"

    def drop_next_reply(self) -> None:
        """Lose whatever Redis answers next, and break that connection."""
        self._drop.set()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if replies and self._drop.is_set():
                    self._drop.clear()
                    self.dropped += 1
                    break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        """Stop accepting and break every proxied connection."""
        self._closed = True
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> LossyProxy:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
