"""The ASGI app: routes, error answers, security headers, body limit, OpenAPI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from starlette.staticfiles import StaticFiles

from kombu_envelope import __version__
from kombu_envelope.dispatcher import problems
from kombu_envelope.dispatcher.config import DispatcherConfig
from kombu_envelope.dispatcher.guard import RateLimiter
from kombu_envelope.dispatcher.middleware import Guarded
from kombu_envelope.dispatcher.routes import (
    dead_letters,
    delayed,
    health,
    metrics,
    periodic,
    schemas,
    task_limits,
    tasks,
    whoami,
    workers,
)
from kombu_envelope.dispatcher.stores import Stores
from kombu_envelope.schema import envelope_json_schema
from kombu_envelope.settings import Settings

#: The operators' console: static HTML, CSS and ES modules served under ``/console/``.
CONSOLE_DIR = Path(__file__).resolve().parent / "console"

#: Fields of an Envelope the dispatcher fills in when a posted task leaves them out.
FILLED_IN = ("task_id", "trace_id", "created_at")


def task_input_schema() -> dict[str, Any]:
    """The Envelope's JSON Schema with :data:`FILLED_IN` optional: what ``POST /tasks`` takes."""
    schema = {k: v for k, v in envelope_json_schema().items() if k not in ("$id", "$schema")}
    schema["required"] = [name for name in schema["required"] if name not in FILLED_IN]
    schema["title"] = "TaskInput"
    return schema


def _openapi(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is None:
        document = get_openapi(title="kombu-envelope dispatcher", version=__version__,
                               description=app.description, routes=app.routes)
        document.setdefault("components", {}).setdefault("schemas", {})["TaskInput"] = (
            task_input_schema())
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"bearer": []}, {}]
        app.openapi_schema = document
    return app.openapi_schema


def create_app(client: Any, settings: Settings | None = None,
               config: DispatcherConfig | None = None) -> Any:
    """The dispatcher for Redis ``client`` (from :func:`~kombu_envelope.store.client.new_client`).

    The returned ASGI app is :class:`fastapi.FastAPI` wrapped in the security headers and
    body limit (its ``.app`` attribute).
    """
    config = config or DispatcherConfig()
    app = FastAPI(title="kombu-envelope dispatcher", version=__version__,
                  description="Schedule, cancel and inspect kombu-envelope tasks over HTTP.",
                  docs_url=None, redoc_url=None)
    app.state.config = config
    app.state.stores = Stores(client, settings or Settings())
    app.state.limiter = RateLimiter(*config.rate_per_process)
    problems.install(app)
    for module in (health, whoami, tasks, delayed, periodic, dead_letters, schemas, task_limits,
                   workers, metrics):
        app.include_router(module.router)
    app.mount("/console", StaticFiles(directory=CONSOLE_DIR, html=True), name="console")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return Guarded(app, config.max_body_bytes)
