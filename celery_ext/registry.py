"""The task a message being published names, with the options it was defined with.

A producer that publishes by name (``send_task``), or before anything touched its
app's tasks, has not finalized the app yet: its ``@app.task`` definitions are still
pending, and options such as ``envelope_retry_policy``, ``idempotency_fields`` or the
argument names would be missed (the app-wide setting would then decide alone).
:func:`published_task` finalizes such an app first, as reading ``app.tasks`` or
calling ``task.delay()`` does, unless the app turned that off (``autofinalize=False``).
"""

from __future__ import annotations

from typing import Any

from celery import current_app


def published_task(name: Any) -> Any | None:
    """The task named ``name`` in ``celery.current_app``, or None when it has none."""
    if not isinstance(name, str):
        return None
    app = current_app._get_current_object()
    if name not in app._tasks and not app.finalized and app.autofinalize:
        app.finalize(auto=True)
    return app._tasks.get(name)
