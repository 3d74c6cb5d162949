"""The ``envelope://`` transport for Celery: every task message becomes an Envelope."""

from __future__ import annotations

from celery_ext.protocol import CeleryAdapter
from kombu_envelope.transport import Transport as EnvelopeTransport


class Transport(EnvelopeTransport):
    """``envelope://`` with :class:`~celery_ext.protocol.CeleryAdapter` as default adapter."""

    default_adapter = CeleryAdapter
