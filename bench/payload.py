"""The message body every scenario sends: a ~300-byte JSON object."""

from __future__ import annotations

import json
from typing import Any

#: Task type (Celery task name) used by the kombu-level scenarios.
TASK_TYPE = "bench.noop"

#: A typical business payload; the same dict is the body on every transport.
PAYLOAD: dict[str, Any] = {
    "order_id": 202509110001,
    "store_id": "S10086",
    "customer": {"id": 731204, "tier": "gold", "email": "customer.name@example.com"},
    "items": [
        {"sku": "SKU-000123", "qty": 2, "price": "19.99"},
        {"sku": "SKU-004567", "qty": 1, "price": "5.49"},
    ],
    "currency": "EUR",
    "channel": "web",
    "note": "leave the parcel at the front door and ring twice",
}


def payload_bytes() -> int:
    """Size of :data:`PAYLOAD` as compact JSON."""
    return len(json.dumps(PAYLOAD, separators=(",", ":")))
