"""kombu-envelope: one canonical task Envelope on Redis Streams, for every language.

Importing this package registers the kombu transport aliases ``envelope``,
``envelopes`` (TLS) and their Sentinel and Cluster forms (``envelope-sentinel``...,
see :mod:`kombu_envelope.store.client`) for plain kombu. It never imports Celery: a Celery app
imports ``celery_ext`` instead, and the transport refuses to serve one that did not
(:class:`~kombu_envelope.errors.CeleryExtensionMissing`).
"""

from __future__ import annotations

from kombu.transport import TRANSPORT_ALIASES

from kombu_envelope.envelope import Envelope, Limits, check_publishable
from kombu_envelope.errors import EnvelopeError, InvalidEnvelope, MalformedEntry
from kombu_envelope.settings import Settings
from kombu_envelope.store.client import SCHEMES
from kombu_envelope.store.publisher import Publisher

#: The URL schemes of the transport (``redis://`` and ``rediss://`` stay kombu's own).
URL_SCHEMES = tuple(scheme for scheme in SCHEMES if scheme.startswith("envelope"))

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
    """Make every envelope URL scheme (``envelope://``, ``envelopes://``...) use ``target``."""
    for scheme in URL_SCHEMES:
        TRANSPORT_ALIASES[scheme] = target


if not TRANSPORT_ALIASES.get("envelope"):
    register_transport()
