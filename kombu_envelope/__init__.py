"""kombu-envelope: one canonical task Envelope on Redis Streams, for every language.

Importing this package registers the kombu transport aliases ``envelope``
and ``envelopes`` (TLS) for plain kombu. It never imports Celery: a Celery app
imports ``celery_ext`` instead, and the transport refuses to serve one that did not
(:class:`~kombu_envelope.errors.CeleryExtensionMissing`).
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from kombu_envelope.envelope import Envelope, Limits, check_publishable
from kombu_envelope.errors import EnvelopeError, InvalidEnvelope, MalformedEntry
from kombu_envelope.settings import Settings
from kombu_envelope.store.publisher import Publisher

__all__ = [
    "Envelope",
    "EnvelopeError",
    "InvalidEnvelope",
    "Limits",
    "MalformedEntry",
    "Publisher",
    "Settings",
    "check_publishable",
    "register_transport",
]
__version__ = "0.1.0"


def register_transport(target: str = "kombu_envelope.kombu.transport:Transport") -> None:
    """Make ``envelope://`` and ``envelopes://`` URLs use the transport ``target``."""
    TRANSPORT_ALIASES["envelope"] = target
    TRANSPORT_ALIASES["envelopes"] = target


if not TRANSPORT_ALIASES.get("envelope"):
    register_transport()
