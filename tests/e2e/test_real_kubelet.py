"""The device plugin against the upstream kubelet: the seed flow end to end, ids that cannot swap,
and the kubelet-side peer held to what the real kubelet does.

One node for the module: the kubelet of tools/kube (the testbed's version) as root in a mount
namespace of its own, against the upstream fake CRI runtime (tools/kube/fakecri), registered with
an x509 node identity
on a control plane of its own; our extender and my-scheduler (tests/testbed Stack); our device
plugin under the chart's ClusterRole, registering with kubelet's real device manager.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from neuron_scheduler.core.ids import cores_of_devices, format_ids
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE
from tests.builders import node_json, pod_json
from tests.e2e.chart import device_plugin_credentials
from tests.e2e.harness import ROOT, wait_for
from tests.e2e.test_deviceplugin_kubelet import KubeletPeer
from tests.testbed import ControlPlane, KubeError, ManagedProcess, Stack
from tests.testbed.deviceplugin import device_plugin
from tests.testbed.kubelet import Kubelet, NodeCA

pytestmark = pytest.mark.e2e

NODE = "real-node"
INSTANCE = "inf1.6xlarge"
DEVICES, CORES_PER_DEVICE = 4, 4
# What the Node shows once the device plugin has registered its resources.
PLUGIN_RESOURCES = {NEURONCORE: DEVICES * CORES_PER_DEVICE, NEURON: DEVICES, NEURONDEVICE: DEVICES}
CORRECTED = "NeuronIdsCorrected"
# Safety net against a hang, never a performance bound.
PATIENCE = 60.0

Json = dict[str, Any]


@dataclass
class RealNode:
    cp: ControlPlane
    stack: Stack
    kubelet: Kubelet
    plugin: ManagedProcess
    allocatable_before_plugin: dict[str, str]
    kubelet_started: datetime | None = None  # the last restart's start, local time

    def pods(self, namespace: str) -> list[Json]:
        listed: Json = self.cp.request("GET", f"/api/v1/namespaces/{namespace}/pods")
        return list(listed["items"])

    def pod(self, namespace: str, name: str) -> Json:
        found: Json = self.cp.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        return found

    def events(self, namespace: str, reason: str) -> list[Json]:
        listed: Json = self.cp.request("GET", f"/api/v1/namespaces/{namespace}/events")
        return [e for e in listed["items"] if e["reason"] == reason]

    def log(self) -> str:
        return self.plugin.log_tail(300)


@pytest.fixture(scope="module")
def real(kubebin: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    work = tmp_path_factory.mktemp("real-kubelet")
    ca = NodeCA(work / "node-ca")
    with ControlPlane(kubebin, work / "cp", extra_apiserver_args=ca.apiserver_args) as cp:
        stack = Stack(cp)
        stack.use_scheduler(True)
        kubelet = Kubelet(cp, ca, NODE, instance_type=INSTANCE)
        plugin = device_plugin(
            NODE,
            kubelet.plugin_dir,
            work / "tree",
            device_plugin_credentials(cp, node=NODE).kubeconfig_path,
            cp.log_dir / "device-plugin.log",
            devices=DEVICES,
            cores=CORES_PER_DEVICE,
            extra_args=["--pod-resources-socket", str(kubelet.pod_resources_socket)],
        )
        try:
            kubelet.start()
            before = dict((kubelet.node() or {})["status"]["allocatable"])
            plugin.start()
            kubelet.wait_allocatable(PLUGIN_RESOURCES)
            yield RealNode(cp, stack, kubelet, plugin, before)
        finally:
            plugin.stop()
            kubelet.close()
            stack.stop()


@pytest.fixture
def namespace(real: RealNode) -> Iterator[str]:
    """A namespace of the test's own; its pods are gone before the next test starts. The Node
    shows every device first: a test before may have restarted the kubelet, which reports the
    plugin's resources as 0 allocatable until the plugin has registered again, and a test that
    pauses the kubelet then would pause it with nothing to schedule on (seen once in CI)."""
    real.kubelet.wait_allocatable(PLUGIN_RESOURCES)
    name = f"rk-{uuid.uuid4().hex[:8]}"
    real.cp.client.ensure_namespace(name)
    yield name
    delete_pods(real, name, [p["metadata"]["name"] for p in real.pods(name)], graceful=False)
    assert "Traceback" not in real.log(), real.log()


# --- helpers -----------------------------------------------------------------------------------


def pod_body(
    namespace: str,
    name: str,
    limits: dict[str, int] | list[dict[str, int]],
    *,
    init: list[dict[str, int]] | None = None,
) -> Json:
    """A pod for my-scheduler, kept to the real node; init containers run `true` and finish."""
    body = pod_json(
        name,
        limits,
        namespace=namespace,
        node_selector={"kubernetes.io/hostname": NODE},
        init_limits=init,
    )
    del body["metadata"]["uid"], body["status"]
    for container in body["spec"].get("initContainers", []):
        container["command"] = ["true"]
    return body


def create_at_once(real: RealNode, bodies: list[Json]) -> float:
    """Create the pods concurrently; return when all are Running, the seconds that took."""
    began = time.monotonic()
    with ThreadPoolExecutor(len(bodies)) as pool:
        list(
            pool.map(
                lambda b: real.cp.request(
                    "POST", f"/api/v1/namespaces/{b['metadata']['namespace']}/pods", b
                ),
                bodies,
            )
        )
    for body in bodies:
        wait_running(real, body["metadata"]["namespace"], body["metadata"]["name"])
    return time.monotonic() - began


def wait_running(real: RealNode, namespace: str, name: str) -> None:
    def running() -> bool:
        return bool(real.pod(namespace, name)["status"].get("phase") == "Running")

    try:
        wait_for(running, f"{namespace}/{name} Running", PATIENCE)
    except AssertionError:
        raise AssertionError(why_not_running(real, namespace, name)) from None


def why_not_running(real: RealNode, namespace: str, name: str) -> str:
    pod = real.pod(namespace, name)
    listed = real.cp.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
    events = [
        f"{e['reason']}: {e.get('message', '')}"
        for e in listed
        if e["involvedObject"].get("name") == name
    ]
    return (
        f"{namespace}/{name} not Running: node {pod['spec'].get('nodeName')!r}, status "
        f"{json.dumps(pod['status'])[:1500]}\nevents: {events[-6:]}\n"
        f"plugin log:\n{real.plugin.log_tail(30)}\n"
        f"kubelet log:\n{real.kubelet.kubelet.log_tail(30)}"
    )


def delete_pods(real: RealNode, namespace: str, names: list[str], *, graceful: bool) -> None:
    """Graceful deletes go through the kubelet: it stops the containers, frees the devices, and
    only then is the pod object removed (about 2 s). Forced ones remove the object at once; the
    kubelet learns it from its watch, before any pod bound afterwards, and frees the devices
    before it admits one."""
    query = "" if graceful else "?gracePeriodSeconds=0"
    for name in names:
        try:
            real.cp.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}{query}")
        except KubeError as error:
            if error.status != 404:
                raise
    left = set(names)
    wait_for(
        lambda: not left & {p["metadata"]["name"] for p in real.pods(namespace)},
        f"pods {sorted(left)} gone",
        PATIENCE,
    )


def annotated(pod: Json) -> dict[str, list[int]]:
    """Container -> its ids, as the pod's annotations say."""
    slices = json.loads(pod["metadata"]["annotations"]["NEURON_CONTAINER_IDS"])
    return {name: sorted(int(i) for i in ids.split(",")) for name, ids in slices.items()}


def disagreements(real: RealNode, namespace: str) -> list[str]:
    """Containers whose ids in kubelet's pod resources differ from their pod's annotation."""
    held = real.kubelet.held()
    found = []
    for pod in real.pods(namespace):
        name = pod["metadata"]["name"]
        resource = pod["metadata"]["annotations"]["NEURON_RESOURCE_TYPE"]
        for container, ids in annotated(pod).items():
            really = held.get((namespace, name, container), {}).get(resource)
            if really != ids:
                found.append(f"{name}/{container}: annotated {ids}, kubelet gave {really}")
    return found


def wait_agreement(real: RealNode, namespace: str) -> None:
    """Until every container's ids equal its annotation: at once, or after the plugin's
    correction (about a second after kubelet's last Allocate)."""
    try:
        wait_for(lambda: not disagreements(real, namespace), "annotations = pod resources", 15)
    except AssertionError:
        raise AssertionError(f"{disagreements(real, namespace)}\n{real.log()}") from None


def shared_cores(real: RealNode) -> list[str]:
    """Cores that two containers on the node hold at once, from kubelet's pod resources."""
    owner: dict[int, str] = {}
    clashes = []
    for (namespace, pod, container), held in real.kubelet.held().items():
        cores = set(held.get(NEURONCORE, []))
        for resource in (NEURON, NEURONDEVICE):
            cores |= set(cores_of_devices(held.get(resource, []), CORES_PER_DEVICE))
        for core in cores:
            who = f"{namespace}/{pod}/{container}"
            if core in owner:
                clashes.append(f"core {core}: {owner[core]} and {who}")
            owner[core] = who
    return clashes


def created(real: RealNode, namespace: str, pod: str) -> dict[str, Json]:
    """Container -> fakecri's CreateContainer record for it (the latest)."""
    return {
        c["container"]: c
        for c in real.kubelet.created_containers()
        if c["pod"]["namespace"] == namespace and c["pod"]["name"] == pod
    }


def visible_cores(record: Json) -> list[int]:
    return [int(c) for c in record["envs"]["NEURON_RT_VISIBLE_CORES"].split(",")]


# --- the tests ---------------------------------------------------------------------------------


@pytest.mark.compat
def test_node_capacity_comes_from_the_device_plugin(real: RealNode) -> None:
    assert not any(k.startswith("aws.amazon.com/") for k in real.allocatable_before_plugin)
    # A test before may have restarted the kubelet: it shows the plugin's resources as 0 until
    # the plugin registers again (seen in CI with a random order), so wait for them first.
    real.kubelet.wait_allocatable(PLUGIN_RESOURCES)
    node = real.kubelet.node()
    assert node is not None
    for field in ("capacity", "allocatable"):
        neuron = {k: v for k, v in node["status"][field].items() if k.startswith("aws.amazon.com")}
        assert neuron == {NEURON: "4", NEURONCORE: "16", NEURONDEVICE: "4"}, field
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == str(real.cp.version)
    assert info["containerRuntimeVersion"].startswith("fakeRuntime://")
    assert node["metadata"]["labels"]["node.kubernetes.io/instance-type"] == INSTANCE


@pytest.mark.compat
def test_seed_flow_through_the_real_kubelet(real: RealNode, namespace: str) -> None:
    """A pod asking my-scheduler for 2 neuroncores: the extender binds and annotates it, kubelet
    calls GetPreferredAllocation and Allocate, fakecri starts it with exactly those cores."""
    seconds = create_at_once(real, [pod_body(namespace, "seed", {NEURONCORE: 2})])
    pod = real.pod(namespace, "seed")
    annotations = pod["metadata"]["annotations"]
    assert pod["spec"]["nodeName"] == NODE
    assert annotations["NEURON_ALLOCATED"] == "true"
    cores = [int(c) for c in annotations["NEURON_CORES"].split(",")]
    devices = [int(d) for d in annotations["NEURON_DEVS"].split(",")]
    assert len(cores) == 2 and devices == sorted({c // CORES_PER_DEVICE for c in cores})
    record = created(real, namespace, "seed")["c0"]
    assert visible_cores(record) == cores
    assert [d["host_path"] for d in record["devices"]] == [f"/dev/neuron{d}" for d in devices]
    assert [d["container_path"] for d in record["devices"]] == [f"/dev/neuron{d}" for d in devices]
    held = real.kubelet.held()[(namespace, "seed", "c0")]
    assert held == {NEURONCORE: cores}
    log = real.log()
    assert f"preferring core {format_ids(cores)} for {namespace}/seed container c0" in log
    assert f"-> {namespace}/seed container c0: /dev/neuron" in log
    print(f"seed pod: create -> Running {seconds:.2f}s, cores {cores}, devices {devices}")
    # Through the kubelet and fakecri (StopContainer, RemoveContainer, log cleanup), and the
    # kubelet's working directory keeps its files.
    delete_pods(real, namespace, ["seed"], graceful=True)
    assert real.kubelet.host_changes() == []


def test_same_size_pods_never_hold_each_others_ids(real: RealNode, namespace: str) -> None:
    """10 rounds of 4 same-size pods bound at once. After each round every container's ids (from
    kubelet's pod resources) equal its pod's annotation; then the older half is deleted, and the
    next round places 4 pods into the ids they freed: no two containers ever share one."""
    live: list[str] = []
    timings = []
    for round_ in range(10):
        names = [f"r{round_}-{i}" for i in range(4)]
        timings.append(
            create_at_once(real, [pod_body(namespace, name, {NEURONCORE: 2}) for name in names])
        )
        live += names
        wait_agreement(real, namespace)
        assert not shared_cores(real), shared_cores(real)
        assert len(real.kubelet.held()) == len(live)
        for name in names:  # and each container was started with the cores it holds
            pod = real.pod(namespace, name)
            assert visible_cores(created(real, namespace, name)["c0"]) == annotated(pod)["c0"]
        older, live = live[:4], live[4:]
        delete_pods(real, namespace, older, graceful=False)
    corrected = real.events(namespace, CORRECTED)
    print(
        f"10 rounds x 4 pods: create -> all Running {min(timings):.2f}-{max(timings):.2f}s; "
        f"{len(corrected)} pods corrected"
    )


def test_a_pod_written_again_before_admission_still_gets_its_own_ids(
    real: RealNode, namespace: str
) -> None:
    """Two same-size pods bound while kubelet is paused, and the one bound first written again
    before kubelet resumes (here a label; any controller could): kubelet admits them in the order
    their bindings reached it, while their resourceVersions now say the opposite. The plugin asks
    kubelet which pod it is admitting, so each container gets its own annotated ids."""
    with real.kubelet.paused():
        for name in ("a", "b"):
            body = pod_body(namespace, name, {NEURONCORE: 2})
            real.cp.request("POST", f"/api/v1/namespaces/{namespace}/pods", body)
        wait_for(
            lambda: all(real.pod(namespace, n)["spec"].get("nodeName") for n in "ab"),
            "a and b bound",
            PATIENCE,
        )
        pods = {n: real.pod(namespace, n) for n in "ab"}
        first = min("ab", key=lambda n: int(pods[n]["metadata"]["resourceVersion"]))
        bound = {n: annotated(pods[n]) for n in "ab"}
        real.cp.request(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{first}",
            {"metadata": {"labels": {"touched": "yes"}}},
            "application/merge-patch+json",
        )
    for name in "ab":
        wait_running(real, namespace, name)
    assert got_what_was_bound(real, namespace, bound, NEURONCORE) == []
    assert not shared_cores(real)


# --- a kubelet restarted with pods bound meanwhile -----------------------------------------------


ROUNDS = 3
NOT_OFFERED = "kubelet did not offer"
OTHER_ORDER = "another order"


def flush_checkpoint(real: RealNode, namespace: str, name: str) -> None:
    """The kubelet forgets deleted pods' devices only when it next allocates (or lists its pod
    resources), and its checkpoint file keeps them until that allocation: a pod it admits now
    makes it let go of them. This one asks for a neurondevice, a resource the rounds do not use,
    and is deleted at once (so what it leaves in the checkpoint cannot meet them)."""
    create_at_once(real, [pod_body(namespace, name, {NEURONDEVICE: 1})])
    delete_pods(real, namespace, [name], graceful=False)


def bound_while_kubelet_is_down(
    real: RealNode,
    namespace: str,
    bodies: list[Json],
    *,
    delete: tuple[str, ...] = (),
    running: bool = True,
) -> dict[str, dict[str, list[int]]]:
    """Stop the kubelet; delete `delete` (forced: gone from the API at once, so the restarted
    kubelet never hears of them); create `bodies` together and wait until my-scheduler has bound
    them; start the kubelet: it admits them in one batch at its start. Returns each pod's
    container -> ids as bound (once they run, unless `running` is false); `real.kubelet_started`
    is when the kubelet was started."""
    real.kubelet.stop_kubelet()
    try:
        if delete:
            delete_pods(real, namespace, list(delete), graceful=False)
        with ThreadPoolExecutor(len(bodies)) as pool:
            list(
                pool.map(
                    lambda b: real.cp.request("POST", f"/api/v1/namespaces/{namespace}/pods", b),
                    bodies,
                )
            )
        names = [b["metadata"]["name"] for b in bodies]
        wait_for(
            lambda: all(real.pod(namespace, n)["spec"].get("nodeName") for n in names),
            f"{names} bound",
            PATIENCE,
        )
        bound = {n: annotated(real.pod(namespace, n)) for n in names}
    finally:
        real.kubelet_started = datetime.now()
        real.kubelet.start_kubelet()
    for name in names if running else ():
        wait_running(real, namespace, name)
    return bound


def got_what_was_bound(
    real: RealNode, namespace: str, bound: dict[str, dict[str, list[int]]], resource: str
) -> list[str]:
    """Containers whose ids (kubelet's pod resources, and the environment fakecri was given)
    differ from what their pod was annotated with at bind."""
    held = real.kubelet.held()
    wrong = []
    for name, slices in bound.items():
        records = created(real, namespace, name)
        for container, ids in slices.items():
            really = held.get((namespace, name, container), {}).get(resource)
            cores = ids if resource == NEURONCORE else list(cores_of_devices(ids, CORES_PER_DEVICE))
            started = visible_cores(records[container]) if container in records else None
            if really != ids or started != cores:
                wrong.append(
                    f"{name}/{container}: bound {ids}, kubelet gave {really}, started with "
                    f"cores {started}"
                )
    return wrong


def kubelet_order(real: RealNode, namespace: str) -> str:
    """The kubelet's batch and the plugin's preferences, from their logs (for failures)."""
    lines = [
        line
        for line in real.kubelet.kubelet.log_tail(400).splitlines()
        if "SyncLoop ADD" in line and namespace in line
    ]
    return (
        "\n".join(lines[-4:])
        + "\n"
        + "\n".join(
            line for line in real.log().splitlines() if "preferring" in line or "->" in line
        )
    )


@pytest.mark.parametrize(
    ("resource", "count"), [(NEURONCORE, 2), (NEURON, 1)], ids=["cores", "devices"]
)
def test_pods_bound_while_the_kubelet_is_down_get_the_scheduler_ids(
    real: RealNode, namespace: str, resource: str, count: int
) -> None:
    """Rounds of: kubelet stopped, two same-size pods created together and bound, kubelet
    started. The restarted kubelet admits both in one batch, sorted by creation time (the same
    second here, so in no order anyone can predict); every container still gets exactly the ids
    the scheduler chose, and nothing needs correcting."""
    for round_ in range(ROUNDS):
        flush_checkpoint(real, namespace, f"flush-{round_}")
        names = [f"r{round_}-a", f"r{round_}-b"]
        bound = bound_while_kubelet_is_down(
            real, namespace, [pod_body(namespace, n, {resource: count}) for n in names]
        )
        wrong = got_what_was_bound(real, namespace, bound, resource)
        assert wrong == [], f"round {round_}: {wrong}\n{kubelet_order(real, namespace)}"
        assert not shared_cores(real), shared_cores(real)
        delete_pods(real, namespace, names, graceful=False)
    assert real.events(namespace, CORRECTED) == []


def withheld_timeline(real: RealNode, namespace: str) -> str:
    """Measured, never asserted: from the kubelet's start, when its start batch came (SyncLoop
    ADD, kubelet log), when the plugin first saw ids withheld and when it gave the batch's last
    ids (plugin log): how long the kubelet withholds ids, and how late the plugin learns it."""
    assert real.kubelet_started is not None
    year = real.kubelet_started.year
    batch = [
        datetime.strptime(f"{year}{line[1:21]}", "%Y%m%d %H:%M:%S.%f")
        for line in real.kubelet.kubelet.log_tail(3000).splitlines()
        if "SyncLoop ADD" in line and f"{namespace}/a" in line and f"{namespace}/b" in line
    ]
    plugin = [
        (datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f"), line)
        for line in real.plugin.log_tail(3000).splitlines()
        if namespace in line and line[:2] == "20"
    ]
    seen = [t for t, line in plugin if "did not offer its annotated" in line]
    given = [
        t for t, line in plugin if f"-> {namespace}/a " in line or f"-> {namespace}/b " in line
    ]
    if not (batch and seen and given):
        return f"timeline incomplete: batch {batch}, withheld seen {seen}, given {given}"

    def after(t: datetime) -> str:
        assert real.kubelet_started is not None
        return f"{(t - real.kubelet_started).total_seconds():.2f}s"

    return (
        f"kubelet started; start batch (SyncLoop ADD) after {after(batch[-1])}; plugin first "
        f"saw ids withheld after {after(seen[0])}, gave the batch's last ids after "
        f"{after(given[-1])} ({(given[-1] - seen[0]).total_seconds() * 1000:.0f} ms later)"
    )


@pytest.mark.parametrize(
    ("resource", "count"), [(NEURONCORE, 2), (NEURON, 1)], ids=["cores", "devices"]
)
def test_ids_the_restarted_kubelet_withholds(
    real: RealNode, namespace: str, resource: str, count: int
) -> None:
    """Two pods run and are deleted while the kubelet is down; two new pods of the same size are
    bound onto the ids they freed. The restarted kubelet still counts those ids as in use until
    it has read all its pods, so it does not offer them: the new pods get other legal ids, never
    one another's, and the plugin rewrites their annotations with an event that says the
    kubelet did not offer the annotated ids. Once the batch is admitted the kubelet lets go of
    them: the next pod placed there gets exactly its ids."""
    flush_checkpoint(real, namespace, "flush")
    gone = ["x", "y"]
    create_at_once(real, [pod_body(namespace, n, {resource: count}) for n in gone])
    withheld = {i for n in gone for ids in annotated(real.pod(namespace, n)).values() for i in ids}
    began = time.time()
    bound = bound_while_kubelet_is_down(
        real,
        namespace,
        [pod_body(namespace, n, {resource: count}) for n in "ab"],
        delete=("x", "y"),
    )
    placed = {i for slices in bound.values() for ids in slices.values() for i in ids}
    assert placed <= withheld, f"the scheduler placed a, b on {placed}, not on {withheld}"
    wait_for(lambda: len(real.events(namespace, CORRECTED)) == 2, "a and b corrected", PATIENCE)
    wait_agreement(real, namespace)
    assert not shared_cores(real), shared_cores(real)
    held = real.kubelet.held()
    for name in "ab":
        pod = real.pod(namespace, name)
        now = annotated(pod)["c0"]
        assert not set(now) & withheld, (name, now, withheld)
        assert held[(namespace, name, "c0")] == {resource: now}
        cores = now if resource == NEURONCORE else list(cores_of_devices(now, CORES_PER_DEVICE))
        assert visible_cores(created(real, namespace, name)["c0"]) == cores
        assert pod["metadata"]["annotations"]["NEURON_ALLOCATED"] == "true"
    messages = [e["message"] for e in real.events(namespace, CORRECTED)]
    assert all(NOT_OFFERED in m and OTHER_ORDER not in m for m in messages), messages
    assert sorted(e["involvedObject"].get("name") for e in real.events(namespace, CORRECTED)) == [
        "a",
        "b",
    ]
    # The kubelet let go of them after its first batch: pods placed now get exactly the ids the
    # scheduler chose, and as the node fills one is placed on the withheld ids (which the
    # allocator picks first depends on what it has seen before: the tests run in any order).
    then: dict[str, dict[str, list[int]]] = {}
    for i in range(DEVICES * CORES_PER_DEVICE):
        name = f"c{i}"
        create_at_once(real, [pod_body(namespace, name, {resource: count})])
        then[name] = annotated(real.pod(namespace, name))
        if set(then[name]["c0"]) <= withheld:
            break
    else:
        raise AssertionError(f"no pod was placed on the withheld ids {sorted(withheld)}: {then}")
    assert got_what_was_bound(real, namespace, then, resource) == []
    timeline = withheld_timeline(real, namespace)
    print(
        f"{timeline}\nwithheld {sorted(withheld)}: a, b corrected to "
        f"{[annotated(real.pod(namespace, n))['c0'] for n in 'ab']}; then placed {then}; "
        f"kubelet stopped -> both corrected {time.time() - began:.1f}s"
    )


def test_withheld_ids_that_leave_too_few_fail_the_pod_at_the_kubelet(
    real: RealNode, namespace: str
) -> None:
    """When what the restarted kubelet withholds leaves fewer ids than a pod asks for, kubelet
    rejects the pod itself before asking the plugin anything (UnexpectedAdmissionError), as it
    does with any admission it cannot serve: the pod fails, nothing is shared or corrected, and
    the ids are free again for the next pod."""
    flush_checkpoint(real, namespace, "flush")
    create_at_once(real, [pod_body(namespace, n, {NEURON: 1}) for n in ("p", "q", "x", "y")])
    withheld = {annotated(real.pod(namespace, n))["c0"][0] for n in "xy"}
    bound = bound_while_kubelet_is_down(
        real,
        namespace,
        [pod_body(namespace, n, {NEURON: 1}) for n in "ab"],
        delete=("x", "y"),
        running=False,
    )
    assert {ids["c0"][0] for ids in bound.values()} == withheld
    for name in "ab":
        wait_for(
            lambda n=name: real.pod(namespace, n)["status"].get("phase") == "Failed",
            f"{name} rejected",
            PATIENCE,
        )
        status = real.pod(namespace, name)["status"]
        assert status["reason"] == "UnexpectedAdmissionError", status
        assert (
            "requested number of devices unavailable for aws.amazon.com/neuron"
            in (status["message"])
        ), status
    assert real.events(namespace, CORRECTED) == []
    assert not shared_cores(real), shared_cores(real)
    print(f"a, b rejected by the kubelet: {status['message']}")
    create_at_once(real, [pod_body(namespace, "c", {NEURON: 1})])
    then = annotated(real.pod(namespace, "c"))
    assert set(then["c0"]) <= withheld, (then, withheld)
    assert got_what_was_bound(real, namespace, {"c": then}, NEURON) == []


def test_multi_container_and_init_container_pods(real: RealNode, namespace: str) -> None:
    """Two pods with two Neuron containers each and two with a Neuron init container, bound at
    once: each container holds exactly its own annotated slice, the init container ran with the
    cores its app container then reuses, and no two pods share a core."""
    bodies = [
        pod_body(namespace, f"pair{i}", [{NEURONCORE: 2}, {NEURONCORE: 2}]) for i in range(2)
    ] + [
        pod_body(namespace, f"init{i}", [{NEURONCORE: 2}], init=[{NEURONCORE: 2}]) for i in range(2)
    ]
    create_at_once(real, bodies)
    wait_agreement(real, namespace)
    assert not shared_cores(real), shared_cores(real)
    for i in range(2):
        pair = real.pod(namespace, f"pair{i}")
        slices = annotated(pair)
        assert set(slices) == {"c0", "c1"} and not set(slices["c0"]) & set(slices["c1"])
        records = created(real, namespace, f"pair{i}")
        for container, ids in slices.items():
            assert visible_cores(records[container]) == ids
        assert pair["metadata"]["annotations"]["NEURON_ALLOCATED"] == "true"
        init = real.pod(namespace, f"init{i}")
        records = created(real, namespace, f"init{i}")
        assert visible_cores(records["init0"]) == visible_cores(records["c0"])
        assert visible_cores(records["c0"]) == annotated(init)["c0"]
        assert init["metadata"]["annotations"]["NEURON_ALLOCATED"] == "true"


def test_a_pod_never_shares_a_device_with_a_pod_placed_without_the_scheduler(
    real: RealNode, namespace: str
) -> None:
    """kubelet keeps ids apart within one resource only. A pod bound straight to the node with 2
    neuroncores gets cores 0 and 1, which no annotation records; the extender, knowing only that
    2 cores are taken somewhere, annotates device 0 for a pod asking `neuron: 1`, and kubelet,
    to which device 0 of `neuron` is free, offers it. The device plugin reads kubelet's pod
    resources, steers kubelet to another device, and the correction records it."""
    stray = pod_body(namespace, "stray", {NEURONCORE: 2})
    stray["spec"]["nodeName"] = NODE
    del stray["spec"]["schedulerName"], stray["spec"]["nodeSelector"]
    create_at_once(real, [stray])
    assert real.kubelet.held()[(namespace, "stray", "c0")] == {NEURONCORE: [0, 1]}

    create_at_once(real, [pod_body(namespace, "device", {NEURON: 1})])
    assert not shared_cores(real), shared_cores(real)

    def corrections() -> list[str]:
        listed = real.events(namespace, CORRECTED)
        return [e["message"] for e in listed if e["involvedObject"]["name"] == "device"]

    wait_for(corrections, "the device pod's annotations corrected", PATIENCE)
    (message,) = corrections()
    assert "through another Neuron resource" in message, message
    holds = real.kubelet.held()[(namespace, "device", "c0")][NEURON]
    assert holds != [0]
    pod = real.pod(namespace, "device")
    assert annotated(pod) == {"c0": holds}
    assert visible_cores(created(real, namespace, "device")["c0"]) == list(
        cores_of_devices(holds, CORES_PER_DEVICE)
    )
    # The extender had annotated device 0, which kubelet offered.
    assert (
        f"kubelet is admitting {namespace}/device container c0 but offers another pod's cores "
        "as its annotated device 0 (held through another Neuron resource)"
    ) in real.log()
    assert f"{namespace}/device container c0 gets device" in real.log()


@pytest.fixture(scope="module")
def peer_binary() -> Path:
    result = subprocess.run(
        ["make", "--no-print-directory", "-f", "tools/kubeletpeer.mk", "kubeletpeer-bin"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"building the peer failed:\n{result.stdout}{result.stderr}"
    return Path(result.stdout.strip().splitlines()[-1])


def handed(node: str, namespace: str, pods: list[tuple[str, str, dict[str, str]]]) -> list[Json]:
    """Pods bound to `node` as the extender leaves them: (name, resource, container -> ids)."""
    bodies = []
    for name, resource, slices in pods:
        ids = ",".join(slices.values())
        numbers = [int(i) for i in ids.split(",")]
        if resource == NEURONCORE:
            cores, devices = numbers, sorted({c // CORES_PER_DEVICE for c in numbers})
        else:
            devices, cores = numbers, list(cores_of_devices(numbers, CORES_PER_DEVICE))
        body = pod_json(
            name,
            [{resource: len(v.split(","))} for v in slices.values()],
            namespace=namespace,
            node=node,
            annotations={
                "AWS_NEURON_IDS": ids,
                "NEURON_RESOURCE_TYPE": resource,
                "NEURON_ALLOC_TIME": str(time.time_ns()),
                "NEURON_ALLOCATED": "false",
                "NEURON_CORES": ",".join(map(str, cores)),
                "NEURON_DEVS": ",".join(map(str, devices)),
                "NEURON_NODE": node,
                "NEURON_CONTAINER_IDS": json.dumps(slices, separators=(",", ":")),
            },
        )
        del body["metadata"]["uid"], body["status"]
        bodies.append(body)
    return bodies


def test_the_peer_and_the_real_kubelet_agree(
    real: RealNode, namespace: str, peer_binary: Path, tmp_path: Path
) -> None:
    """The same pods, bound with the same annotations, on the real node and on a node served by
    tools/kubeletpeer: every container gets the same ids, devices and environment, and the pods
    end up with the same annotations. The peer stays for what a real kubelet cannot be made to
    do on demand; this keeps it from drifting."""
    scenario: list[tuple[str, str, dict[str, str]]] = [
        ("solo", NEURONCORE, {"c0": "2,3"}),
        ("pair", NEURONCORE, {"c0": "4,5", "c1": "6,7"}),
        ("whole", NEURON, {"c0": "3"}),
    ]
    peer_node = f"peer-{uuid.uuid4().hex[:6]}"
    real.cp.request("POST", "/api/v1/nodes", node_json(peer_node, INSTANCE))
    peer_space = f"{namespace}-peer"
    real.cp.client.ensure_namespace(peer_space)
    plugin_dir = Path("/tmp") / f"dp-{uuid.uuid4().hex[:8]}"  # socket paths stay short
    plugin_dir.mkdir()
    plugin = device_plugin(
        peer_node,
        plugin_dir,
        tmp_path / "tree",
        device_plugin_credentials(real.cp, node=peer_node).kubeconfig_path,
        tmp_path / "device-plugin.log",
        devices=DEVICES,
        cores=CORES_PER_DEVICE,
    )
    plugin.start()
    peer = KubeletPeer(peer_binary, plugin_dir, tmp_path / "kubeletpeer.log")
    try:
        peer.wait_registered()
        # The real kubelet admits pods one by one, in the order their bindings arrive.
        on_real: dict[tuple[str, str], Json] = {}
        for body in handed(NODE, namespace, scenario):
            create_at_once(real, [body])
        held = real.kubelet.held()
        for name, resource, slices in scenario:
            records = created(real, namespace, name)
            for container in slices:
                on_real[(name, container)] = {
                    "ids": held[(namespace, name, container)][resource],
                    "devices": [d["host_path"] for d in records[container]["devices"]],
                    "cores": visible_cores(records[container]),
                }
        on_peer: dict[tuple[str, str], Json] = {}
        for body, (name, resource, slices) in zip(
            handed(peer_node, peer_space, scenario), scenario, strict=True
        ):
            real.cp.request("POST", f"/api/v1/namespaces/{peer_space}/pods", body)
            for container in slices:
                size = len(slices[container].split(","))
                admitted = peer.call("admit", resource=resource, size=size)
                assert "error" not in admitted, admitted
                on_peer[(name, container)] = {
                    "ids": sorted(int(i) for i in admitted["ids"]),
                    "devices": [d["host_path"] for d in admitted["response"]["devices"]],
                    "cores": [
                        int(c)
                        for c in admitted["response"]["envs"]["NEURON_RT_VISIBLE_CORES"].split(",")
                    ],
                }
        assert on_peer == on_real

        def ours(space: str) -> dict[str, Json]:
            keep = ("AWS_NEURON_IDS", "NEURON_ALLOCATED", "NEURON_CONTAINER_IDS", "NEURON_CORES")
            return {
                p["metadata"]["name"]: {k: p["metadata"]["annotations"].get(k) for k in keep}
                for p in real.pods(space)
            }

        wait_for(
            lambda: ours(peer_space) == ours(namespace),
            "the same annotations on both nodes",
            15,
        )
        assert all(a["NEURON_ALLOCATED"] == "true" for a in ours(namespace).values())
    finally:
        peer.stop()
        plugin.stop()
        shutil.rmtree(plugin_dir, ignore_errors=True)
        for pod in real.pods(peer_space):
            real.cp.request(
                "DELETE",
                f"/api/v1/namespaces/{peer_space}/pods/{pod['metadata']['name']}?gracePeriodSeconds=0",
            )
        real.cp.request("DELETE", f"/api/v1/nodes/{peer_node}")


def test_the_host_is_left_as_it_was(real: RealNode) -> None:
    """After pods came and went through the kubelet: no kernel tunable changed, no kubelet path
    on the host, the sentinel in the kubelet's working directory still there, no mount leaked."""
    assert real.kubelet.host_changes() == []
