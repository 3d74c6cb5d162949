"""The ids of new Envelopes: random, unique across threads and forked processes."""

from __future__ import annotations

import os
import re
import threading
import uuid

from kombu_envelope.random_ids import new_ids

UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def test_a_task_id_is_a_version_4_uuid_and_a_trace_id_32_hex_digits() -> None:
    for _ in range(1000):
        task_id, trace_id = new_ids()
        assert UUID4.fullmatch(task_id) and uuid.UUID(task_id).version == 4
        assert re.fullmatch(r"[0-9a-f]{32}", trace_id)


def test_ids_are_unique_across_threads() -> None:
    made: list[list[str]] = [[] for _ in range(4)]

    def make(into: list[str]) -> None:
        for _ in range(2000):
            into.extend(new_ids())

    threads = [threading.Thread(target=make, args=(into,)) for into in made]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    everything = [one for into in made for one in into]
    assert len(set(everything)) == len(everything) == 4 * 2000 * 2


def test_a_forked_child_does_not_make_its_parents_ids() -> None:
    """The ids a forked child makes next differ from its parent's next ones."""
    new_ids()  # the generator has run in the parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.write(write, " ".join(new_ids() + new_ids()).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        childs = pipe.read().split()
    os.waitpid(pid, 0)
    parents = [*new_ids(), *new_ids()]
    assert len(childs) == 4 and UUID4.fullmatch(childs[0])
    assert not set(childs) & set(parents)
