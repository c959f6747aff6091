"""The extender's HTTPS server as `serve` configures it: client certificates required, and no TLS
session tickets (kube-scheduler's client never resumes a session, issue 36)."""

from __future__ import annotations

import ssl
from pathlib import Path

from neuron_scheduler.extender.serve import ExtenderOptions, server_config, tls_settings
from tests.testbed.pki import Pki


async def app(scope: object, receive: object, send: object) -> None:
    raise AssertionError("not served in this test")


def test_the_server_context_asks_for_client_certificates_and_makes_no_tickets(
    tmp_path: Path,
) -> None:
    pki = Pki.create(tmp_path)
    options = ExtenderOptions(
        tls_cert=pki.server_cert, tls_key=pki.server_key, client_ca=pki.ca, port=0
    )
    config = server_config(app, "127.0.0.1", 0, "info", **tls_settings(options))
    config.load()
    assert isinstance(config.ssl, ssl.SSLContext)
    assert config.ssl.verify_mode == ssl.CERT_REQUIRED
    assert config.ssl.num_tickets == 0


def test_plain_http_has_no_context() -> None:
    config = server_config(app, "127.0.0.1", 0, "info", **tls_settings(ExtenderOptions()))
    config.load()
    assert config.ssl is None
