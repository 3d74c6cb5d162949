"""A kombu consumer process for the latency scenario (``python -m bench.consumer``).

Prints ``READY`` once it consumes, then one JSON line ``{"latencies_ms": [...]}``:
for every message, the time its callback started minus the ``sent_at`` time
the producer put in the payload.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from kombu import Connection, Consumer, Exchange, Queue

import kombu_envelope.kombu.adapter  # noqa: F401  (registers envelope:// and the envelope serializer)

ACCEPT = ["json", "envelope"]


def main(argv: Sequence[str] | None = None) -> int:
    """Consume ``--count`` messages of the ``--queue`` queues and report their latencies."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--queue", required=True, action="append",
                        help="a queue to consume (repeatable)")
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--kind", choices=("envelope", "json"), required=True)
    parser.add_argument("--prefetch", type=int, default=100)
    parser.add_argument("--idle-timeout", type=float, default=20.0)
    args = parser.parse_args(argv)

    latencies: list[float] = []

    def on_message(body: Any, message: Any) -> None:
        started = time.time()
        payload = body["payload"] if args.kind == "envelope" else body
        latencies.append((started - float(payload["sent_at"])) * 1000)
        message.ack()

    queues = [Queue(name, Exchange(name, type="direct", durable=True), routing_key=name,
                    durable=True) for name in args.queue]
    plain = "kombu_envelope.kombu.transport:Transport" if args.url.startswith("envelope") else None
    with Connection(args.url, transport=plain) as conn:
        channel = conn.channel()
        channel.basic_qos(0, args.prefetch, False)
        with Consumer(channel, queues=queues, callbacks=[on_message], accept=ACCEPT):
            print("READY", flush=True)
            while len(latencies) < args.count:
                try:
                    conn.drain_events(timeout=args.idle_timeout)
                except TimeoutError:
                    break
    print(json.dumps({"latencies_ms": latencies}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
