"""Random ids made on every publish: task, trace and publish-token ids.

They come from OpenSSL's generator (:func:`ssl.RAND_bytes`: seeded by the system, and
reseeded in a forked child), not from :func:`os.urandom`, which lets go of the GIL for
its system call. While another thread of the process is busy (a web server's, the
dispatcher's publishing thread), taking the GIL back cost about 200 µs per call.
"""

from __future__ import annotations

from ssl import RAND_bytes

# The variant nibble of a random UUID (RFC 9562: 10xx) for each random hex digit.
_UUID_VARIANT = {digit: "89ab"[int(digit, 16) & 3] for digit in "0123456789abcdef"}


def random_hex(count: int) -> str:
    """``2 * count`` random hex digits (``count`` random bytes)."""
    return RAND_bytes(count).hex()


def new_ids() -> tuple[str, str]:
    """A new ``task_id`` (a random, version 4, UUID) and ``trace_id`` (32 random hex digits).

    Both come from one :func:`random_hex` call, and the UUID is written from its hex digits
    without building a ``UUID`` object: publishing many tasks at once feels either cost.
    """
    d = random_hex(32)
    return (f"{d[:8]}-{d[8:12]}-4{d[13:16]}-{_UUID_VARIANT[d[16]]}{d[17:20]}-{d[20:32]}",
            d[32:])
