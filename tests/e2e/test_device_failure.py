"""A Neuron device fails under the real kubelet (issue 39): its /dev/neuronN disappears from the
fake tree, the device plugin reports it Unhealthy to the kubelet and names it on its Node, and
from then on nobody plans for it.

Two real nodes for the module, each a kubelet of tools/kube against the upstream fake CRI
with our device plugin: an inf2.48xlarge (a ring of 12 devices x 2 cores) and a trn1.32xlarge (a
4x4 torus of 16 x 2). Our extender and my-scheduler place the pods; the device plugins run with
pod-bound tokens under the chart's ClusterRole and its admission policy on Node writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from neuron_scheduler.core.allocation import is_valid_device_set
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.health import UNHEALTHY_DEVICES
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE
from tests.builders import pod_json
from tests.e2e.chart import HEALTH_POLICY, device_plugin_credentials
from tests.e2e.harness import wait_for
from tests.testbed import ControlPlane, KubeError, ManagedProcess, Stack
from tests.testbed.deviceplugin import device_plugin
from tests.testbed.kubelet import Kubelet, NodeCA

pytestmark = pytest.mark.e2e

RING, TORUS = "ring-node", "torus-node"
SHAPES = {RING: ("inf2.48xlarge", 12, 2), TORUS: ("trn1.32xlarge", 16, 2)}
CATALOG = Catalog.builtin()
# Safety net against a hang, never a performance bound.
PATIENCE = 60.0

Json = dict[str, Any]


@dataclass
class Node:
    name: str
    kubelet: Kubelet
    plugin: ManagedProcess
    dev: Path  # the plugin's fake /dev

    @property
    def devices(self) -> int:
        return SHAPES[self.name][1]


@dataclass
class Cluster:
    cp: ControlPlane
    stack: Stack
    nodes: dict[str, Node]

    def pod(self, namespace: str, name: str) -> Json:
        found: Json = self.cp.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        return found

    def node(self, name: str) -> Json:
        found: Json = self.cp.request("GET", f"/api/v1/nodes/{name}")
        return found

    def events(self, namespace: str, pod: str) -> list[Json]:
        listed = self.cp.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
        return [e for e in listed if e["involvedObject"].get("name") == pod]


@pytest.fixture(scope="module")
def cluster(kubebin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("device-failure")
    ca = NodeCA(work / "node-ca")
    with ControlPlane(kubebin, work / "cp", extra_apiserver_args=ca.apiserver_args) as cp:
        stack = Stack(cp)
        stack.use_scheduler(True)
        nodes: dict[str, Node] = {}
        try:
            for name, (instance, devices, cores) in SHAPES.items():
                kubelet = Kubelet(cp, ca, name, instance_type=instance)
                plugin = device_plugin(
                    name,
                    kubelet.plugin_dir,
                    work / f"tree-{name}",
                    device_plugin_credentials(cp, node=name).kubeconfig_path,
                    cp.log_dir / f"device-plugin-{name}.log",
                    devices=devices,
                    cores=cores,
                    extra_args=[
                        *("--pod-resources-socket", str(kubelet.pod_resources_socket)),
                        *("--health-interval", "0.5"),
                    ],
                )
                nodes[name] = Node(name, kubelet, plugin, work / f"tree-{name}" / "dev")
                kubelet.start()
                plugin.start()
                kubelet.wait_allocatable(
                    {NEURONCORE: devices * cores, NEURON: devices, NEURONDEVICE: devices}
                )
            yield Cluster(cp, stack, nodes)
        finally:
            for node in nodes.values():
                node.plugin.stop()
                node.kubelet.close()
            stack.stop()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A namespace of the test's own; its pods are gone, and every device healthy again, before
    the next test starts."""
    name = f"df-{uuid.uuid4().hex[:8]}"
    cluster.cp.client.ensure_namespace(name)
    yield name
    listed = cluster.cp.request("GET", f"/api/v1/namespaces/{name}/pods")["items"]
    for pod in listed:
        delete(cluster, name, pod["metadata"]["name"])
    for node in cluster.nodes.values():
        for device in range(node.devices):
            (node.dev / f"neuron{device}").touch()
        wait_healthy(cluster, node)
    for node in cluster.nodes.values():
        assert "Traceback" not in node.plugin.log_tail(400)


# --- helpers -----------------------------------------------------------------------------------


def fail(cluster: Cluster, node: Node, *devices: int) -> None:
    """The devices disappear from /dev: the plugin reports them Unhealthy and names them on its
    Node; wait until the kubelet's allocatable and the annotation both say so."""
    for device in devices:
        (node.dev / f"neuron{device}").unlink()
    expected = ",".join(str(d) for d in sorted(devices))

    def shown() -> bool:
        found = cluster.node(node.name)
        annotation = found["metadata"].get("annotations", {}).get(UNHEALTHY_DEVICES)
        allocatable = found["status"]["allocatable"].get(NEURON)
        return annotation == expected and allocatable == str(node.devices - len(devices))

    wait_for(shown, f"{node.name}: devices {expected} failed", PATIENCE)


def wait_healthy(cluster: Cluster, node: Node) -> None:
    def shown() -> bool:
        found = cluster.node(node.name)
        annotation = found["metadata"].get("annotations", {}).get(UNHEALTHY_DEVICES)
        return annotation is None and found["status"]["allocatable"].get(NEURON) == str(
            node.devices
        )

    wait_for(shown, f"{node.name}: every device healthy", PATIENCE)


def create(cluster: Cluster, namespace: str, name: str, node: str, limits: dict[str, int]) -> None:
    body = pod_json(
        name, limits, namespace=namespace, node_selector={"kubernetes.io/hostname": node}
    )
    del body["metadata"]["uid"], body["status"]
    cluster.cp.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)


def delete(cluster: Cluster, namespace: str, name: str) -> None:
    try:
        cluster.cp.request(
            "DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}?gracePeriodSeconds=0"
        )
    except KubeError as error:
        if error.status != 404:
            raise

    def gone() -> bool:
        try:
            cluster.pod(namespace, name)
        except KubeError as error:
            return error.status == 404
        return False

    wait_for(gone, f"{namespace}/{name} gone", PATIENCE)


def why_not_running(cluster: Cluster, namespace: str, name: str, node: Node) -> str:
    pod = cluster.pod(namespace, name)
    events = [f"{e['reason']}: {e.get('message', '')}" for e in cluster.events(namespace, name)]
    return (
        f"{namespace}/{name} not Running: node {pod['spec'].get('nodeName')!r}, status "
        f"{json.dumps(pod['status'])[:1200]}\nevents: {events[-6:]}\n"
        f"plugin log:\n{node.plugin.log_tail(30)}"
    )


def run(cluster: Cluster, namespace: str, name: str, node: Node, limits: dict[str, int]) -> Json:
    """Create the pod on the node, wait until it runs: its devices, as annotated and as the
    kubelet gave them, must be one and the same legal set of healthy devices."""
    create(cluster, namespace, name, node.name, limits)

    def running() -> bool:
        phase = cluster.pod(namespace, name)["status"].get("phase")
        if phase == "Failed":
            raise AssertionError(why_not_running(cluster, namespace, name, node))
        return bool(phase == "Running")

    try:
        wait_for(running, f"{namespace}/{name} Running", PATIENCE)
    except AssertionError as error:
        raise AssertionError(why_not_running(cluster, namespace, name, node)) from error
    return cluster.pod(namespace, name)


def devices_of(pod: Json) -> list[int]:
    return [int(d) for d in pod["metadata"]["annotations"]["NEURON_DEVS"].split(",")]


def given(node: Node, namespace: str, name: str) -> list[int]:
    """The devices the kubelet gave the pod's container, from fakecri's CreateContainer."""
    records = [
        c
        for c in node.kubelet.created_containers()
        if c["pod"]["namespace"] == namespace and c["pod"]["name"] == name
    ]
    assert records, f"{namespace}/{name}: no container created"
    paths = records[-1]["devices"]
    return sorted(int(d["host_path"].rsplit("neuron", 1)[1]) for d in paths)


def check_healthy_and_given(
    cluster: Cluster, node: Node, namespace: str, name: str, failed: set[int]
) -> list[int]:
    pod = cluster.pod(namespace, name)
    devices = devices_of(pod)
    topology = CATALOG.resolve(SHAPES[node.name][0], node.devices, None).topology
    assert not failed & set(devices), f"{name} annotated with failed {failed}: {devices}"
    assert is_valid_device_set(topology, devices), f"{name}: {devices} is no legal set"
    assert given(node, namespace, name) == sorted(devices), (name, devices)
    reasons = {e["reason"] for e in cluster.events(namespace, name)}
    assert "NeuronIdsCorrected" not in reasons, cluster.events(namespace, name)
    return devices


def status(cluster: Cluster, node: str) -> Json:
    answer = subprocess.run(
        [sys.executable, "-m", "neuron_scheduler", "status", "--json", "--node", node],
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(cluster.cp.kubeconfig_path)},
        timeout=120,
    )
    assert answer.returncode == 0, answer.stderr
    (found,) = json.loads(answer.stdout)["nodes"]
    return dict(found)


def why(cluster: Cluster, namespace: str, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neuron_scheduler", "why", name, "-n", namespace],
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(cluster.cp.kubeconfig_path), "COLUMNS": "200"},
        timeout=120,
    )


def extender_metric(cluster: Cluster, name: str) -> float:
    return cluster.stack.extender.metric(name)


def assert_unbound_token_refused(cluster: Cluster, path: str, body: Json) -> None:
    """The plugin's ServiceAccount with a token bound to no pod (so naming no node) may not
    write it: the chart's admission policies refuse it, saying why."""
    unbound = cluster.cp.service_account("kube-system", "neuron-device-plugin").token
    with pytest.raises(KubeError) as caught:
        cluster.cp.client_for(unbound).request(
            "PATCH", path, body, content_type="application/merge-patch+json"
        )
    assert caught.value.status == 403 and "names no node" in str(caught.value), caught.value


# --- the tests ---------------------------------------------------------------------------------


@pytest.mark.compat
def test_a_plugin_may_write_only_its_own_nodes_health(cluster: Cluster) -> None:
    """The chart's ValidatingAdmissionPolicy: a token bound to a pod on the ring node may set
    the ring node's health annotation, and nothing else of any Node."""
    ring_token = device_plugin_credentials(cluster.cp, node=RING).token
    as_plugin = cluster.cp.client_for(ring_token)
    patch = "application/merge-patch+json"

    def write(node: str, body: Json) -> KubeError | None:
        try:
            as_plugin.request("PATCH", f"/api/v1/nodes/{node}", body, content_type=patch)
        except KubeError as error:
            return error
        return None

    own = {"metadata": {"annotations": {UNHEALTHY_DEVICES: None}}}
    assert write(RING, own) is None
    # The policy is enforced from its binding's first reconcile on: wait for a refusal.
    refused = wait_for(lambda: write(TORUS, own), "the policy to refuse another node", 30)
    assert refused.status == 403 and f"may not write node {TORUS}" in str(refused), refused
    for body, text in (
        ({"metadata": {"labels": {"evil": "yes"}}}, "spec, labels"),
        ({"metadata": {"annotations": {"other": "x"}}}, "change only the"),
        ({"spec": {"unschedulable": True}}, "spec, labels"),
        ({"metadata": {"annotations": {UNHEALTHY_DEVICES: "0-3"}}}, "list of device indexes"),
    ):
        error = write(RING, body)
        assert error is not None and error.status == 403 and text in str(error), (body, error)
    # A token that names no node (not bound to a pod) may write no Node at all.
    assert_unbound_token_refused(cluster, f"/api/v1/nodes/{RING}", own)
    policies = cluster.cp.request(
        "GET", "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
    )
    assert HEALTH_POLICY in {p["metadata"]["name"] for p in policies["items"]}


def test_a_plugin_may_write_only_hand_off_annotations_of_its_own_nodes_pods(
    cluster: Cluster, namespace: str
) -> None:
    """The chart's policy on the plugin's pod updates (`pods patch` is cluster-wide, and a pod
    update may change container images): a token bound to a pod on the ring node may mark a pod
    on the ring node allocated, and change nothing else of any pod. The other tests run the
    plugins under it, so the patches a plugin really sends pass it."""
    patch = "application/merge-patch+json"
    for pod, node in (("on-ring", RING), ("on-torus", TORUS)):
        cluster.cp.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/pods",
            pod_json(pod, {}, namespace=namespace, node=node),
        )
    as_plugin = cluster.cp.client_for(device_plugin_credentials(cluster.cp, node=RING).token)

    def write(pod: str, body: Json) -> KubeError | None:
        path = f"/api/v1/namespaces/{namespace}/pods/{pod}"
        try:
            as_plugin.request("PATCH", path, body, content_type=patch)
        except KubeError as error:
            return error
        return None

    mark = {"metadata": {"annotations": {"NEURON_ALLOCATED": "true"}}}
    assert write("on-ring", mark) is None
    # The policy is enforced from its binding's first reconcile on: wait for a refusal.
    refused = wait_for(lambda: write("on-torus", mark), "the policy to refuse another node", 30)
    assert refused.status == 403 and f"may not write pods of node {TORUS}" in str(refused)
    image = {"spec": {"containers": [{"name": "c0", "image": "attacker.example/evil:1"}]}}
    for body, text in (
        (image, "spec, labels"),
        ({"metadata": {"labels": {"evil": "yes"}}}, "spec, labels"),
        ({"metadata": {"annotations": {"NEURON_NODE": TORUS}}}, "not NEURON_NODE"),
        ({"metadata": {"annotations": {"neuron-scheduler.io/woken": "1"}}}, "hand-off"),
    ):
        error = write("on-ring", body)
        assert error is not None and error.status == 403 and text in str(error), (body, error)
    assert "attacker" not in cluster.pod(namespace, "on-ring")["spec"]["containers"][0]["image"]
    assert_unbound_token_refused(cluster, f"/api/v1/namespaces/{namespace}/pods/on-ring", mark)


def test_on_a_ring_pods_get_legal_blocks_that_avoid_a_failed_device(
    cluster: Cluster, namespace: str
) -> None:
    ring = cluster.nodes[RING]
    fail(cluster, ring, 5)
    shown = status(cluster, RING)
    assert shown["unhealthy_devices"] == [5] and shown["withheld_cores"] == 0
    assert (shown["free_devices"], shown["largest_free_block"]) == (11, 11)
    wait_for(
        lambda: (
            extender_metric(cluster, f'neuron_scheduler_node_unhealthy_devices{{node="{RING}"}}')
            == 1
        ),
        "the metric",
        PATIENCE,
    )
    # The failure: on the old code this pod was annotated 0-7 and failed at the kubelet.
    run(cluster, namespace, "eight", ring, {NEURON: 8})
    eight = check_healthy_and_given(cluster, ring, namespace, "eight", {5})
    left = status(cluster, RING)
    assert left["largest_free_block"] == 3 and left["free_devices"] == 3, left
    run(cluster, namespace, "three", ring, {NEURON: 3})
    three = check_healthy_and_given(cluster, ring, namespace, "three", {5})
    assert not set(eight) & set(three)
    delete(cluster, namespace, "eight")
    delete(cluster, namespace, "three")
    placed: list[int] = []
    for name, limits in (
        ("four", {NEURON: 4}),
        ("two", {NEURON: 2}),
        ("one", {NEURON: 1}),
        ("cores", {NEURONCORE: 2}),
    ):
        run(cluster, namespace, name, ring, limits)
        if NEURON in limits:
            placed += check_healthy_and_given(cluster, ring, namespace, name, {5})
        else:
            cores = cluster.pod(namespace, name)["metadata"]["annotations"]["NEURON_CORES"]
            assert cores not in ("10,11",) and not {10, 11} & {int(c) for c in cores.split(",")}
    assert len(placed) == len(set(placed)) == 7
    # The device comes back: usable again at once.
    for name in ("four", "two", "one", "cores"):
        delete(cluster, namespace, name)
    (ring.dev / "neuron5").touch()
    wait_healthy(cluster, ring)
    whole = run(cluster, namespace, "twelve", ring, {NEURON: 12})
    assert devices_of(whole) == list(range(12))


def test_on_a_torus_only_the_groups_that_avoid_a_failed_device_are_offered(
    cluster: Cluster, namespace: str
) -> None:
    torus = cluster.nodes[TORUS]
    fail(cluster, torus, 5)
    run(cluster, namespace, "half", torus, {NEURON: 8})
    assert check_healthy_and_given(cluster, torus, namespace, "half", {5}) == list(range(8, 16))
    # Best fit fills row 1 (which the failed device breaks) first, then breaks row 0. The cores
    # pod counts against neuroncore, not neuron: kube-scheduler still sees 4 devices free.
    singles = (
        ("one-a", {NEURON: 1}),
        ("one-b", {NEURON: 1}),
        ("cores", {NEURONCORE: 2}),
        ("one-c", {NEURON: 1}),
    )
    for name, limits in singles:
        run(cluster, namespace, name, torus, limits)
        if NEURON in limits:
            check_healthy_and_given(cluster, torus, namespace, name, {5})
    # What filter will say for a row of 4 is what status says now.
    block = status(cluster, TORUS)["largest_free_block"]
    create(cluster, namespace, "row", TORUS, {NEURON: 4})
    if block >= 4:
        wait_for(lambda: cluster.pod(namespace, "row")["status"].get("phase") == "Running", "row")
        row = check_healthy_and_given(cluster, torus, namespace, "row", {5})
        assert row == [0, 1, 2, 3]
        return
    refusal = wait_for(
        lambda: next(
            (
                e["message"]
                for e in cluster.events(namespace, "row")
                if e["reason"] == "FailedScheduling" and "device 5 failed" in e["message"]
            ),
            None,
        ),
        "a refusal naming the failed device",
        PATIENCE,
    )
    assert "needs 4 devices" in refusal, refusal
    answer = why(cluster, namespace, "row")
    assert "device 5 failed" in answer.stdout, answer.stdout + answer.stderr


def test_a_pod_running_on_a_device_that_fails_is_told_counted_and_shown(
    cluster: Cluster, namespace: str
) -> None:
    ring = cluster.nodes[RING]
    run(cluster, namespace, "victim", ring, {NEURON: 4})
    devices = devices_of(cluster.pod(namespace, "victim"))
    broken = devices[1]
    fail(cluster, ring, broken)
    told = wait_for(
        lambda: next(
            (e for e in cluster.events(namespace, "victim") if e["reason"] == "NeuronDeviceFailed"),
            None,
        ),
        "a NeuronDeviceFailed event",
        PATIENCE,
    )
    assert f"device {broken} of node {RING}" in told["message"] and told["type"] == "Warning"
    assert cluster.pod(namespace, "victim")["status"]["phase"] == "Running"  # it runs on
    assert extender_metric(cluster, "neuron_scheduler_pods_on_unhealthy_devices") == 1
    shown = status(cluster, RING)
    (pod,) = [p for p in shown["pods"] if p["pod"] == f"{namespace}/victim"]
    assert pod["on_unhealthy_devices"] == [broken]
    # Its other devices stay its own; the failed one is never free. Allocatable dropped to 11
    # while the pod still requests 4: kube-scheduler leaves 7 for others, and so does status.
    assert shown["unhealthy_devices"] == [broken]
    assert (shown["free_devices"], shown["largest_free_block"]) == (7, 7), shown
    run(cluster, namespace, "seven", ring, {NEURON: 7})
    seven = check_healthy_and_given(cluster, ring, namespace, "seven", {broken})
    assert not set(seven) & set(devices)
    answer = why(cluster, namespace, "victim")
    assert answer.returncode == 1 and f"failed device {broken}" in answer.stderr, answer
    (ring.dev / f"neuron{broken}").touch()
    wait_healthy(cluster, ring)
    wait_for(
        lambda: any(
            e["reason"] == "NeuronDeviceRecovered" for e in cluster.events(namespace, "victim")
        ),
        "a NeuronDeviceRecovered event",
        PATIENCE,
    )
