"""The extender's safety claims under load and failure, against the real control plane."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from neuron_scheduler.core.allocation import NodeState, Placement, allocate
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import ids_mask
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.config import load_kubeconfig
from neuron_scheduler.kube.errors import Conflict
from tests.builders import neuron_capacity
from tests.e2e.harness import Scenario, ids, wait_for


def assert_no_overlap(scenario: Scenario) -> dict[str, set[int]]:
    """Every bound pod's cores are its own on its node; returns cores in use per node."""
    used: dict[str, set[int]] = {}
    for pod in scenario.pods():
        node = pod["spec"].get("nodeName")
        if not node:
            continue
        cores = set(ids(pod, "NEURON_CORES"))
        assert cores, f"{pod['metadata']['name']} bound without our annotations"
        assert not used.setdefault(node, set()) & cores, f"overlap on {node}: {cores}"
        used[node] |= cores
    return used


def unplaced_that_fit(scenario: Scenario, nodes: dict[str, str]) -> list[str]:
    """Pending pods that some node could still take, judged by the allocator on the cluster's
    state as the pods' annotations record it: the oracle for "all that fit are bound"."""
    catalog = Catalog.builtin()
    pods = scenario.pods()
    used: dict[str, int] = {}
    for pod in pods:
        node = pod["spec"].get("nodeName")
        if node:
            used[node] = used.get(node, 0) | ids_mask(ids(pod, "NEURON_CORES"))
    fitting = []
    for pod in pods:
        if pod["spec"].get("nodeName"):
            continue
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        request = NeuronRequest(next(iter(limits)), int(next(iter(limits.values()))))
        for node, instance_type in nodes.items():
            topology = catalog.resolve(instance_type, *neuron_capacity(instance_type)).topology
            if isinstance(allocate(topology, NodeState(used.get(node, 0)), request), Placement):
                fitting.append(pod["metadata"]["name"])
                break
    return fitting


def test_concurrent_binds_to_one_node_never_overlap(scenario: Scenario) -> None:
    node = scenario.add_node("inf1.24xlarge")  # 16 devices
    # Pods for a scheduler that does not exist, so only our direct binds place them.
    pods = [scenario.create_pod(f"b{i}", {NEURON: 1}, scheduler="nobody") for i in range(20)]
    extender = scenario.stack.extender
    with ThreadPoolExecutor(max_workers=20) as pool:
        errors = list(pool.map(lambda p: extender.bind(p, node), pods))
    assert errors.count("") == 16, errors
    assert all("needs 1 devices" in e or "needs 1 device" in e for e in errors if e), errors
    used = assert_no_overlap(scenario)
    assert len(used[node]) == 64


def test_retried_bind_succeeds_without_allocating_twice(scenario: Scenario) -> None:
    node = scenario.add_node("inf1.6xlarge")
    pod = scenario.create_pod("retry", {NEURONCORE: 3}, scheduler="nobody")
    extender = scenario.stack.extender
    assert extender.bind(pod, node) == ""
    first = scenario.pod("retry")["metadata"]["annotations"]
    assert extender.bind(pod, node) == ""
    assert scenario.pod("retry")["metadata"]["annotations"] == first
    other = scenario.add_node("inf1.6xlarge")
    assert "already bound" in extender.bind(pod, other)


def test_bind_checks_the_pod_uid(scenario: Scenario) -> None:
    node = scenario.add_node("inf1.6xlarge")
    pod = scenario.create_pod("uid", {NEURONCORE: 1}, scheduler="nobody")
    stale = {**pod, "metadata": {**pod["metadata"], "uid": "00000000-0000-0000-0000-000000000000"}}
    assert "was deleted and created again" in scenario.stack.extender.bind(stale, node)
    assert not scenario.pod("uid")["spec"].get("nodeName")


def test_failed_binding_rolls_back_annotations_and_reservation(scenario: Scenario) -> None:
    cp = scenario.cp
    node = scenario.add_node("inf1.6xlarge")
    role = "/apis/rbac.authorization.k8s.io/v1/clusterroles/neuron-scheduler-extender"
    original = cp.request("GET", role)
    # Take away pods/binding: the annotation patch succeeds, the Binding is refused (403).
    without = [r for r in original["rules"] if "pods/binding" not in r["resources"]]
    cp.request("PATCH", role, {"rules": without}, "application/merge-patch+json")
    try:
        pod = scenario.create_pod("denied", {NEURON: 4}, scheduler="nobody")

        def refused() -> str | None:
            error = scenario.stack.extender.bind(pod, node)
            assert error, "bind succeeded without pods/binding"
            return error if "forbidden" in error.lower() else None

        wait_for(refused, "binding to be forbidden", 30)
        annotations = scenario.pod("denied")["metadata"].get("annotations", {})
        assert "AWS_NEURON_IDS" not in annotations and "NEURON_NODE" not in annotations
        scenario.wait_event("denied", "FailedNeuronAllocation", "binding failed")
    finally:
        cp.request("PATCH", role, {"rules": original["rules"]}, "application/merge-patch+json")
    # The reservation was released: all 4 devices can be bound again.
    wait_for(
        lambda: scenario.stack.extender.bind(pod, node) == "",
        "bind to succeed once allowed",
        30,
    )
    assert ids(scenario.pod("denied")) == [0, 1, 2, 3]


def test_a_binding_lands_only_on_the_pod_as_bind_last_saw_it(scenario: Scenario) -> None:
    """What the bind's safety rests on, checked against the real kube-apiserver through our own
    client: a Binding (or patch) conditioned on an older resourceVersion is refused, so one still
    on its way when its bind gave up cannot land once the pod changed (removing its annotations)."""
    node = scenario.add_node("inf1.6xlarge")
    body = scenario.create_pod("fenced", {NEURON: 1}, scheduler="nobody")
    meta = body["metadata"]

    async def run() -> None:
        async with KubeAPI(load_kubeconfig(scenario.cp.kubeconfig_path)) as api:
            ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
            patched = await api.patch_annotations(
                ns, name, uid, {"x": "1"}, resource_version=meta["resourceVersion"]
            )
            assert patched != meta["resourceVersion"]
            with pytest.raises(Conflict):  # the patch is conditioned on the pod as read
                await api.patch_annotations(
                    ns, name, uid, {"x": "2"}, resource_version=meta["resourceVersion"]
                )
            removed = await api.patch_annotations(
                ns, name, uid, {"x": None}, resource_version=patched
            )
            with pytest.raises(Conflict):  # the Binding sent after the first patch
                await api.bind(ns, name, uid, node, resource_version=patched)
            assert not (await api.get_pod(ns, name)).spec.nodeName
            await api.bind(ns, name, uid, node, resource_version=removed)

    asyncio.run(run())
    assert scenario.pod("fenced")["spec"]["nodeName"] == node


def test_two_hundred_pods_on_twenty_mixed_nodes(scenario: Scenario) -> None:
    types = ["inf2.48xlarge", "trn1.32xlarge", "inf1.24xlarge", "inf2.24xlarge", "trn2.48xlarge"]
    nodes = {scenario.add_node(t): t for t in types for _ in range(4)}
    requests = [{NEURONCORE: 1}] * 100 + [{NEURON: 1}] * 60 + [{NEURON: 2}] * 40
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda a: scenario.create_pod(f"p{a[0]}", a[1]), enumerate(requests)))
    wait_for(lambda: not unplaced_that_fit(scenario, nodes), "every pod that fits to be bound", 240)
    used = assert_no_overlap(scenario)
    bound = [p for p in scenario.pods() if p["spec"].get("nodeName")]
    # Every pod that fits is bound (above); how many fit depends on the order kube-scheduler
    # takes them in: 2-device pods fit only on the rings (Trn torus nodes take 1, 4, 8 or 16), so
    # the simulator places 180-192 of these 200 over 20 orders, and real runs placed 177-178.
    # This floor only catches a placement that wastes far more than that.
    assert len(bound) >= 170, f"only {len(bound)} of 200 bound"
    catalog = Catalog.builtin()
    for pod in bound:
        node = pod["spec"]["nodeName"]
        devices = ids(pod, "NEURON_DEVS")
        topology = catalog.resolve(nodes[node]).topology
        if pod["metadata"]["annotations"]["NEURON_RESOURCE_TYPE"] == NEURON:
            assert topology.device_sets(len(devices)) and ids_mask(devices) in topology.device_sets(
                len(devices)
            ), (node, devices)
    assert sum(len(c) for c in used.values()) > 0


def test_sigkill_in_the_middle_of_a_stream(scenario: Scenario) -> None:
    nodes = {scenario.add_node(t): t for t in ["inf2.48xlarge", "trn1.32xlarge"] * 2}
    extender = scenario.stack.extender

    def stream() -> None:
        for i in range(40):
            scenario.create_pod(f"s{i}", {NEURONCORE: 1 + i % 3})
            time.sleep(0.05)

    creator = threading.Thread(target=stream)
    creator.start()
    wait_for(
        lambda: sum(1 for p in scenario.pods() if p["spec"].get("nodeName")) >= 8,
        "some pods bound before the kill",
    )
    extender.kill()
    time.sleep(1)
    extender.start()
    creator.join()
    capacity = sum(neuron_capacity(t)[1] for t in nodes.values())
    demand = sum(1 + i % 3 for i in range(40))
    assert demand <= capacity
    scenario.wait_all_bound(240)
    used = assert_no_overlap(scenario)
    # The restarted extender's view, rebuilt from annotations, matches the pods exactly.
    catalog = Catalog.builtin()
    for node, instance_type in nodes.items():
        topology = catalog.resolve(instance_type, *neuron_capacity(instance_type)).topology
        busy = {core // topology.cores_per_device for core in used.get(node, set())}
        wait_for(
            lambda node=node, busy=busy, total=topology.devices: (
                extender.metric(f'neuron_scheduler_node_free_devices{{node="{node}"}}')
                == total - len(busy)
            ),
            f"extender's free devices on {node} to match the annotations",
            30,
        )


class _Failing(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"Error": "stand-in extender is failing on purpose"}')

    def log_message(self, *_: Any) -> None:
        pass


def test_extender_down_or_failing_keeps_pods_pending_until_it_is_back(scenario: Scenario) -> None:
    node = scenario.add_node("inf1.6xlarge")
    extender = scenario.stack.extender
    extender.kill()
    try:
        scenario.create_pod("while-down", {NEURONCORE: 2})
        event = scenario.wait_event("while-down", "FailedScheduling", "")
        assert "connection refused" in event["message"] or "extender" in event["message"].lower()
        # A stand-in that answers HTTP 500 on the extender's port, over the same TLS.
        server = HTTPServer(("127.0.0.1", extender.port), _Failing)
        server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        pki = scenario.stack.pki
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
        tls.load_cert_chain(str(pki.server_cert), str(pki.server_key))
        tls.verify_mode = ssl.CERT_REQUIRED
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            scenario.create_pod("while-failing", {NEURONCORE: 2})
            scenario.wait_event("while-failing", "FailedScheduling", "500")
            assert not scenario.pod("while-failing")["spec"].get("nodeName")
        finally:
            server.shutdown()
            server.server_close()
    finally:
        extender.start()
    for name in ("while-down", "while-failing"):
        assert scenario.wait_bound(name, seconds=240)["spec"]["nodeName"] == node
    assert_no_overlap(scenario)
