"""Running the dispatcher: the command line shared by ``python -m kombu_envelope.dispatcher``
and ``celery -A proj envelope dispatcher``, and the OpenAPI document under docs/."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kombu_envelope.dispatcher.app import create_app
from kombu_envelope.dispatcher.config import TOKENS_ENV, DispatcherConfig, load_tokens
from kombu_envelope.dispatcher.processes import Workers, listen
from kombu_envelope.settings import Settings

logger = logging.getLogger("kombu_envelope.dispatcher")

#: Where the OpenAPI document is checked in.
OPENAPI_PATH = Path(__file__).resolve().parents[2] / "docs" / "dispatcher" / "openapi.json"


def openapi_document() -> dict[str, Any]:
    """The OpenAPI document the server serves (built without connecting to Redis)."""
    document: dict[str, Any] = create_app(client=None).app.openapi()
    return document


def render_openapi() -> str:
    """The document as checked in: indented, keys in order, one final newline."""
    return json.dumps(openapi_document(), indent=2, sort_keys=True) + "\n"


def add_options(parser: argparse.ArgumentParser) -> None:
    """The dispatcher's own options (listening address, tokens, limits)."""
    defaults = DispatcherConfig()
    parser.add_argument("--host", default=defaults.host,
                        help="address to listen on (loopback only without tokens)")
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--tokens-file", type=Path, default=None,
                        help=f"JSON token file (also ${TOKENS_ENV}, see docs/dispatcher.md)")
    parser.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    parser.add_argument("--batch-max", type=int, default=defaults.batch_max)
    parser.add_argument("--rate", type=float, default=defaults.rate_per_s,
                        help="requests per second per token")
    parser.add_argument("--burst", type=int, default=defaults.rate_burst)
    parser.add_argument("--workers", type=int, default=defaults.workers,
                        help="processes serving the port (e.g. one per core)")


def config_from(args: argparse.Namespace) -> DispatcherConfig:
    """The configuration the parsed options give."""
    return DispatcherConfig(host=args.host, port=args.port,
                            tokens=tuple(load_tokens(args.tokens_file)),
                            max_body_bytes=args.max_body_bytes, batch_max=args.batch_max,
                            rate_per_s=args.rate, rate_burst=args.burst, workers=args.workers)


def serve(client: Any, settings: Settings, config: DispatcherConfig) -> None:
    """Serve until interrupted (SIGINT or SIGTERM), in ``config.workers`` processes."""
    import uvicorn

    if config.tokens:
        logger.warning("dispatcher on %s:%d with %d token(s)", config.host, config.port,
                       len(config.tokens))
    else:
        logger.warning("no token configured: the dispatcher accepts every request and listens "
                       "on %s:%d (loopback) only", config.host, config.port)
    # h11, not httptools: uvicorn's httptools protocol drops the body of a request that
    # also asks for an h2c upgrade, which java.net.http's default client does.
    options: dict[str, Any] = {"host": config.host, "port": config.port, "http": "h11",
                               "log_level": "error", "access_log": False,
                               "server_header": False}
    if config.workers == 1:
        uvicorn.run(create_app(client, settings, config), **options)
        return
    try:
        listening = listen(config.host, config.port, config.workers)
    except OSError as exc:
        raise SystemExit(f"cannot listen on {config.host}:{config.port}: {exc}") from exc

    def serve_here(index: int) -> None:
        for other in listening:
            if other is not listening[index]:
                other.close()
        server = uvicorn.Server(uvicorn.Config(create_app(client, settings, config), **options))
        server.run(sockets=[listening[index]])

    Workers(serve_here, config.workers).run()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kombu_envelope.dispatcher``."""
    parser = argparse.ArgumentParser(
        prog="python -m kombu_envelope.dispatcher",
        description="The kombu-envelope HTTP API (docs/dispatcher.md).")
    parser.add_argument("--url", help="envelope://, envelope-sentinel:// or envelope-cluster:// "
                                      "URL of Redis (';' between nodes)")
    parser.add_argument("--option", "-o", action="append", default=[], metavar="NAME=JSON",
                        help="a transport option, its value as JSON (repeatable), e.g. "
                             "-o master_name='\"mymaster\"'")
    parser.add_argument("--write-openapi", type=Path, nargs="?", const=OPENAPI_PATH,
                        metavar="PATH", help="write the OpenAPI document and exit (default "
                                             "docs/dispatcher/openapi.json)")
    add_options(parser)
    args = parser.parse_args(argv)
    if args.write_openapi:
        args.write_openapi.parent.mkdir(parents=True, exist_ok=True)
        args.write_openapi.write_text(render_openapi(), encoding="utf-8")
        return 0
    if not args.url:
        parser.error("--url is required")
    from kombu_envelope.store.client import client_for_url

    options = {}
    for item in args.option:
        name, sep, value = item.partition("=")
        try:
            options[name] = json.loads(value) if sep else None
        except ValueError:
            parser.error(f"--option {name}: the value must be JSON, e.g. {name}=30 or "
                         f"{name}='\"text\"'")
    try:
        settings = Settings.from_transport_options(options)
        config = config_from(args)
        client = client_for_url(args.url, settings)
    except ValueError as exc:  # InvalidTransportOption names the option or the URL part
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    serve(client, settings, config)
    return 0
