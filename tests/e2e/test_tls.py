"""Only kube-scheduler may drive the extender (issue 15): HTTPS with client certificates, as the
chart sets it up and as the whole e2e suite runs it (tests/testbed/stack.py: my-scheduler calls
with its client certificate). Here: what everyone else gets."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from neuron_scheduler.core.resources import NEURONCORE
from tests.builders import pod_json
from tests.e2e.harness import Scenario, wait_for
from tests.testbed import ControlPlane, Stack
from tests.testbed.pki import Pki
from tests.testbed.stack import ExtenderProcess

pytestmark = pytest.mark.e2e

VERBS = ("filter", "prioritize", "bind", "preempt")


def post(url: str, context: ssl.SSLContext | None) -> int:
    request = urllib.request.Request(
        url, data=b"{}", headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def test_callers_without_the_schedulers_certificate_get_no_answer(
    stack: Stack, tmp_path: Path
) -> None:
    extender = stack.extender
    assert extender.url.startswith("https://") and stack.pki is not None
    stranger = Pki.create(tmp_path / "other")  # a certificate, but from another CA
    no_certificate = stack.pki.client_context(with_certificate=False)
    wrong_ca = ssl.create_default_context(cafile=str(stack.pki.ca))
    wrong_ca.load_cert_chain(str(stranger.client_cert), str(stranger.client_key))
    for verb in VERBS:
        for context in (no_certificate, wrong_ca):
            with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
                post(f"{extender.url}/{verb}", context)
        # Plain HTTP to the TLS port gets no extender answer either.
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            post(f"http://127.0.0.1:{extender.port}/{verb}", None)
        # The scheduler's certificate reaches the verb (an empty body is a 400, not refused).
        assert post(f"{extender.url}/{verb}", stack.pki.client_context()) in (400, 404)
    # Probes and Prometheus need no certificate, on the metrics port.
    for path in ("/healthz", "/readyz", "/metrics"):
        with urllib.request.urlopen(extender.metrics_url + path, timeout=10) as answer:
            assert answer.status == 200
    # ... and the metrics port serves nothing else.
    assert post(extender.metrics_url + "/bind", None) == 404


def test_the_issues_curl_is_refused_even_with_a_certificate(scenario: Scenario) -> None:
    """Issue 15's curl: a pod of another scheduler, whose nodeSelector matches no node, bound
    directly to a Neuron node. Without a certificate it gets no answer (above); with the
    scheduler's certificate it is refused, and nothing is written."""
    node = scenario.add_node("trn1.32xlarge")
    body = pod_json(
        "victim",
        {NEURONCORE: 1},
        namespace=scenario.namespace,
        scheduler="default-scheduler",
        node_selector={"no-such-label": "x"},
    )
    del body["metadata"]["uid"]
    victim = scenario.cp.request("POST", f"/api/v1/namespaces/{scenario.namespace}/pods", body)
    error = scenario.stack.extender.bind(victim, node)
    assert "schedulerName is 'default-scheduler'" in error
    # Even a pod of a served scheduler is refused where its own spec says it may not go.
    body["spec"]["schedulerName"] = "nobody"
    body["metadata"]["name"] = "selector"
    selector = scenario.cp.request("POST", f"/api/v1/namespaces/{scenario.namespace}/pods", body)
    assert "nodeSelector no-such-label=x does not match" in scenario.stack.extender.bind(
        selector, node
    )
    for name in ("victim", "selector"):
        pod = scenario.pod(name)
        assert not pod["spec"].get("nodeName")
        assert "AWS_NEURON_IDS" not in pod["metadata"].get("annotations", {})
        scenario.wait_event(name, "NeuronBindRefused", "not bound to")


def test_tainted_node_and_pods_without_neuron_requests_are_refused(scenario: Scenario) -> None:
    node = scenario.add_node("inf2.48xlarge")
    scenario.cp.request(
        "PATCH",
        f"/api/v1/nodes/{node}",
        {"spec": {"taints": [{"key": "dedicated", "value": "training", "effect": "NoSchedule"}]}},
        "application/merge-patch+json",
    )
    pod = scenario.create_pod("untolerated", {NEURONCORE: 1}, scheduler="nobody")

    def refused_for_taint() -> str | None:
        error = scenario.stack.extender.bind(pod, node)
        return error if "taint dedicated=training:NoSchedule" in error else None

    wait_for(refused_for_taint, "the taint to reach the extender's cache", 30)
    plain = scenario.create_pod("cpu-only", {"cpu": 1}, scheduler="nobody")
    assert "requests no Neuron resource" in scenario.stack.extender.bind(plain, node)
    assert not scenario.pod("cpu-only")["spec"].get("nodeName")
    refused = scenario.stack.extender.metric('neuron_scheduler_binds_total{result="refused"}')
    assert refused >= 2


def test_an_open_extender_says_so_when_it_starts(stack: Stack, control_plane: ControlPlane) -> None:
    open_one = ExtenderProcess(control_plane, stack.extender_kubeconfig, name="extender-open")
    open_one.start()
    try:
        log = open_one.process.log_path.read_text()
        assert "serving plain HTTP" in log and "(--insecure)" in log
        assert json.loads(json.dumps(open_one.call("filter", b"{}")[1]))["Error"]
    finally:
        open_one.process.stop()
