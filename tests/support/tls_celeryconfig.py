"""Celery configuration module for workers whose broker is ``envelopes://`` (TLS).

Name it in ``CELERY_CONFIG_MODULE`` (``support.tls_celeryconfig``) for a worker of
``apps.envelope_app``: the broker connection then verifies the server certificate
against the CA file named by ``TEST_BROKER_CA_CERTS``. Settings the app sets
itself (broker URL, result backend, transport options) are left to the app.
"""

from __future__ import annotations

import os
import ssl

broker_use_ssl = {
    "ssl_cert_reqs": ssl.CERT_REQUIRED,
    "ssl_ca_certs": os.environ["TEST_BROKER_CA_CERTS"],
}
