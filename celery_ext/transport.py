"""The ``envelope://`` transport for Celery: every task message becomes an Envelope."""

from __future__ import annotations

from celery_ext.protocol import CeleryAdapter
from celery_ext.revoke import RevokingChannel
from kombu_envelope.transport import Transport as EnvelopeTransport


class Transport(EnvelopeTransport):
    """``envelope://`` with :class:`~celery_ext.protocol.CeleryAdapter` as default adapter.

    Its channels also cancel still-delayed tasks when Celery broadcasts a revoke
    (:mod:`celery_ext.revoke`).
    """

    Channel = RevokingChannel
    default_adapter = CeleryAdapter
