"""The extender serving HTTPS (--tls-cert/--tls-key), called by the real kube-scheduler."""

from __future__ import annotations

import base64
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from neuron_scheduler.core.resources import NEURONCORE
from tests.e2e.harness import Scenario, ids
from tests.testbed import ControlPlane, Stack
from tests.testbed.manifests import scheduler_config
from tests.testbed.stack import ExtenderProcess

pytestmark = pytest.mark.e2e


def openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"openssl {' '.join(args)}: {result.stderr}"


def certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a serving certificate for 127.0.0.1 signed by it: (ca, cert, key)."""
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    cert, key, csr = directory / "tls.crt", directory / "tls.key", directory / "tls.csr"
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-subj", "/CN=test-ca")
    openssl("req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=extender")
    (directory / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        *("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key)),
        *("-CAcreateserial", "-out", str(cert), "-days", "1"),
        *("-extfile", str(directory / "san.cnf")),
    )
    return ca, cert, key


def test_kube_scheduler_calls_the_extender_over_https(
    stack: Stack, control_plane: ControlPlane, tmp_path: Path
) -> None:
    ca, cert, key = certificates(tmp_path)
    extender = ExtenderProcess(
        control_plane,
        stack.extender_kubeconfig,
        name="extender-tls",
        tls=(ca, cert, key),
    )
    extender.start()
    scenario = Scenario(stack)
    scheduler = None
    try:
        assert extender.url.startswith("https://")
        # Plain HTTP to the TLS port gets no extender answer.
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{extender.port}/readyz", timeout=5)

        config = scheduler_config(
            scheduler_name="tls-scheduler", extender_url=extender.url, node_cache_capable=True
        )
        # What the chart renders for scheduler.tlsSecretName: HTTPS, checked against the CA.
        config["extenders"][0]["enableHTTPS"] = True
        config["extenders"][0]["tlsConfig"] = {"caData": base64.b64encode(ca.read_bytes()).decode()}
        scheduler = control_plane.start_scheduler(config=config)

        node = scenario.add_node("inf2.48xlarge")
        scenario.create_pod("over-tls", {NEURONCORE: 2}, scheduler="tls-scheduler")
        pod = scenario.wait_bound("over-tls")
        assert pod["spec"]["nodeName"] == node
        assert len(ids(pod)) == 2
        assert pod["metadata"]["annotations"]["NEURON_NODE"] == node
        # This extender (not the session's plain-HTTP one) bound it.
        assert extender.metric('neuron_scheduler_binds_total{result="success"}') == 1
        assert extender.metric('neuron_scheduler_request_seconds_count{verb="filter"}') >= 1
    finally:
        if scheduler is not None:
            scheduler.stop()
        extender.process.stop()
        scenario.cleanup()
