"""celery-redis-plus (``valkey://``): a Redis transport for Celery with broker-side eta.

Measured next to the others when it is importable. Importing it registers the
``valkey://`` scheme with kombu (on redis-py); its transport connects a
``before_task_publish`` handler that copies a task's eta into the message
properties, where it reads it. That handler changes every Celery message that
carries an eta, whatever the broker, so here it is connected only inside
:func:`eta_property`, around publishing to celery-redis-plus.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib import import_module, metadata

from celery.signals import before_task_publish

#: The transport's URL scheme (an alias registered when the package is imported).
SCHEME = "valkey"
PACKAGE = "celery-redis-plus"


def load() -> tuple[bool, str]:
    """Import celery-redis-plus; return (importable, version or why not)."""
    try:
        import_module("celery_redis_plus")
        signals = import_module("celery_redis_plus.signals")
    except ImportError as exc:
        return False, f"{PACKAGE} is not importable ({exc})"
    before_task_publish.disconnect(signals._convert_eta_to_properties)
    return True, metadata.version(PACKAGE)


@contextmanager
def eta_property() -> Iterator[None]:
    """Connect celery-redis-plus's eta handler for the block (it must be loaded)."""
    handler = import_module("celery_redis_plus.signals")._convert_eta_to_properties
    before_task_publish.connect(handler, weak=False)
    try:
        yield
    finally:
        before_task_publish.disconnect(handler)
