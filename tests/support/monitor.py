"""The commands Redis runs, seen with ``MONITOR``: for tests that must see how a client of
another process waits or settles, which no key shows afterwards."""

from __future__ import annotations

import threading
from collections.abc import Callable

import redis

from . import wait_for


class Commands:
    """The commands Redis runs while this is open that ``wanted`` accepts (each as
    ``MONITOR`` prints it: the arguments joined by spaces), gathered by a thread."""

    def __init__(self, url: str, wanted: Callable[[str], bool]) -> None:
        self._url = url
        self._wanted = wanted
        self._seen: list[str] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._watching = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Commands:
        self._thread.start()
        if not self._watching.wait(10):
            raise RuntimeError("MONITOR did not start")
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stopped.set()
        with redis.Redis.from_url(self._url) as client:
            client.ping()  # the command the monitor sees last
        self._thread.join(10)

    @property
    def seen(self) -> list[str]:
        """What was gathered so far, in the order Redis ran it."""
        with self._lock:
            return list(self._seen)

    def wait(self, predicate: Callable[[str], bool], *, after: int = 0,
             timeout: float = 30.0, message: str | Callable[[], str] = "") -> str:
        """The first command gathered at index ``after`` or later that ``predicate``
        accepts, once one is."""

        def found() -> str | None:
            return next((c for c in self.seen[after:] if predicate(c)), None)

        return wait_for(found, timeout=timeout, message=lambda: (
            message() if callable(message) else message) + f"\nseen: {self.seen[-20:]}")

    def _watch(self) -> None:
        with redis.Redis.from_url(self._url) as client, client.monitor() as monitor:
            self._watching.set()
            while not self._stopped.is_set():
                try:
                    command = monitor.next_command()["command"]
                except redis.ConnectionError:
                    return  # the session's Redis stopped: the test failed already
                if self._wanted(command):
                    with self._lock:
                        self._seen.append(command)
