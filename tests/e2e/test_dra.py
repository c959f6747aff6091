"""The DRA driver end to end: the chart's objects in a real kube-apiserver, `neuron-scheduler
dra-driver` processes publishing ResourceSlices, and the real kube-scheduler allocating claims
over them. Tests whose name ends in `_over_grpc_without_kubelet` call NodePrepareResources and
NodeUnprepareResources on the driver's real socket themselves (many nodes, restarts and claims
deleted behind kubelet's back are cheaper that way); test_dra_real_kubelet.py runs the driver
under the real kubelet. tests/e2e/dra.py says what else stands in for missing components.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_scheduler.core.allocation import is_valid_device_set
from neuron_scheduler.core.ids import mask_ids
from neuron_scheduler.dra import DEFAULT_CORE_WINDOWS
from neuron_scheduler.dra.shapes import ShapeKind, published_shapes, shapes_by_name
from tests.e2e.dra import (
    CATALOG,
    DRIVER,
    RESOURCE,
    DriverProcess,
    Json,
    Workloads,
    allocated_devices,
    dra_control_plane,
    publish,
    slices_of,
    wait_for,
)
from tests.testbed import ControlPlane, KubeError

pytestmark = [pytest.mark.e2e, pytest.mark.needs("dra")]


@pytest.fixture(scope="module")
def cp() -> Iterator[ControlPlane]:
    with dra_control_plane() as plane:
        yield plane


@pytest.fixture(scope="module")
def work(cp: ControlPlane) -> Workloads:
    workloads = Workloads(cp, "dra-work")
    # The admission policies act once the API server has loaded them: wait until one refuses.
    bad = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "two-singles"},
        "spec": {
            "devices": {
                "requests": [{"name": "n", "exactly": {"deviceClassName": "neuron-1", "count": 2}}]
            }
        },
    }

    def refused() -> str | None:
        try:
            cp.request("POST", f"{RESOURCE}/namespaces/dra-work/resourceclaims?dryRun=All", bad)
        except KubeError as error:
            return str(error)
        return None

    message = wait_for(refused, "the chart's claim policy to be enforced")
    assert "must ask for exactly one device" in message, message
    return workloads


@pytest.fixture(scope="module")
def drivers(cp: ControlPlane, work: Workloads) -> Iterator[dict[str, DriverProcess]]:
    """One inf2.48xlarge and two trn1.32xlarge nodes, each with its driver process."""
    started: dict[str, DriverProcess] = {}
    try:
        for key, instance_type in (
            ("inf2", "inf2.48xlarge"),
            ("trn1", "trn1.32xlarge"),
            ("trn1-whole", "trn1.32xlarge"),
        ):
            node, _ = work.add_node(instance_type, {"dra-test": "shapes"})
            driver = DriverProcess(cp, node, instance_type)
            driver.start()
            started[key] = driver
        yield started
    finally:
        for driver in started.values():
            driver.remove()


def on_node(driver: DriverProcess) -> dict[str, str]:
    return {"kubernetes.io/hostname": driver.node}


def members(claim: Json, driver: DriverProcess, instance_type: str) -> list[int]:
    ((pool, device),) = allocated_devices(claim)
    assert pool == driver.node
    topology = CATALOG.resolve(instance_type).topology
    return list(shapes_by_name(topology)[device].members)


def test_policies_keep_a_driver_to_its_own_nodes_slices(
    cp: ControlPlane, drivers: dict[str, DriverProcess]
) -> None:
    inf2, trn1 = drivers["inf2"], drivers["trn1"]
    as_driver = cp.client_for(inf2.token)
    own = slices_of(cp, inf2.node)[0]
    forged = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"forged-{trn1.node}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": trn1.node,
            "pool": {"name": trn1.node, "generation": 99, "resourceSliceCount": 1},
            "devices": [{"name": "x"}],
        },
    }
    with pytest.raises(KubeError) as refused:
        as_driver.request("POST", f"{RESOURCE}/resourceslices", forged)
    assert f"may not write ResourceSlices of node {trn1.node}" in str(refused.value)
    other_driver = {
        **forged,
        "spec": {**forged["spec"], "driver": "gpu.example.com", "nodeName": inf2.node},
    }
    with pytest.raises(KubeError) as refused:
        as_driver.request("POST", f"{RESOURCE}/resourceslices?dryRun=All", other_driver)
    assert f"may write only {DRIVER} ResourceSlices" in str(refused.value)
    with pytest.raises(KubeError) as refused:
        as_driver.request(
            "DELETE", f"{RESOURCE}/resourceslices/{slices_of(cp, trn1.node)[0]['metadata']['name']}"
        )
    assert "may not write ResourceSlices" in str(refused.value)
    # Its own node's slices it may write (dry run: the pool stays as published).
    as_driver.request("PUT", f"{RESOURCE}/resourceslices/{own['metadata']['name']}?dryRun=All", own)
    # And RBAC gives it nothing else.
    with pytest.raises(KubeError) as forbidden:
        as_driver.request("GET", "/api/v1/namespaces/dra-work/pods")
    assert forbidden.value.status == 403


@pytest.mark.compat
def test_shapes_bind_and_prepare_over_grpc_without_kubelet(
    work: Workloads, drivers: dict[str, DriverProcess]
) -> None:
    inf2, trn1, whole = drivers["inf2"], drivers["trn1"], drivers["trn1-whole"]
    info = inf2.get_info()
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(inf2.dra_socket))
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]

    # Devices 2-8 and 9,10 held: the only free 3-window is 11,0,1, across the ring's wrap.
    for name, size, held in (("hold-2-8", 7, "2,3,4,5,6,7,8"), ("hold-9-10", 2, "9,10")):
        work.claim(name, size, members=held)
        work.pod(name, claim=name, node_selector=on_node(inf2))
        assert members(work.wait_allocated(name), inf2, "inf2.48xlarge") == [
            int(d) for d in held.split(",")
        ]
    for name, size in (("inf2-window-3", 3), ("trn1-row", 4), ("trn1-half", 8), ("trn1-all", 16)):
        work.template(name, size)
    wrap = work.pod("wrap", template="inf2-window-3", node_selector=on_node(inf2))
    row = work.pod("row", template="trn1-row", node_selector=on_node(trn1))
    half = work.pod("half", template="trn1-half", node_selector=on_node(trn1))
    all16 = work.pod("all16", template="trn1-all", node_selector=on_node(whole))
    expected = {
        "wrap": (inf2, "inf2.48xlarge", [11, 0, 1]),
        "row": (trn1, "trn1.32xlarge", [0, 1, 2, 3]),
        "half": (trn1, "trn1.32xlarge", list(range(8, 16))),
        "all16": (whole, "trn1.32xlarge", list(range(16))),
    }
    for pod in (wrap, row, half, all16):
        name = pod["metadata"]["name"]
        driver, instance_type, devices = expected[name]
        claim = work.wait_allocated(work.pod_claim(name))
        assert members(claim, driver, instance_type) == devices, name
        wait_for(
            lambda n=name: work.cp.request("GET", f"/api/v1/namespaces/dra-work/pods/{n}")[
                "spec"
            ].get("nodeName"),
            f"pod {name} to be bound",
        )
        # kubelet's call for the pod's claim; v1beta1 for one of them, as an older kubelet would.
        version = "v1beta1" if name == "row" else "v1"
        response = driver.prepare([claim], version)
        uid = claim["metadata"]["uid"]
        answer = response.claims[uid]
        assert answer.error == "", answer.error
        (device,) = answer.devices
        assert list(device.request_names) == ["neurons"]
        assert device.pool_name == driver.node
        assert list(device.cdi_device_ids) == [f"{DRIVER}/neuron={uid}-{device.device_name}"]
        spec = driver.cdi_spec(uid)
        assert spec is not None
        (cdi,) = spec["devices"]
        nodes = [n["path"] for n in cdi["containerEdits"]["deviceNodes"]]
        assert nodes == [f"/dev/neuron{d}" for d in sorted(devices)], name
        cores = sorted(c for d in devices for c in (2 * d, 2 * d + 1))
        assert (
            f"NEURON_RT_VISIBLE_CORES={','.join(map(str, cores))}" in cdi["containerEdits"]["env"]
        )
        # Idempotent: kubelet asking again gets the same answer.
        assert driver.prepare([claim], version).claims[uid].devices[0] == device
        assert driver.unprepare([claim]).claims[uid].error == ""
        assert driver.cdi_spec(uid) is None
    # The module's nodes are shared: what this test placed goes (the other tests need their
    # devices, in whatever order they run).
    for name in ("wrap", "row", "half", "all16"):
        work.release(name, work.pod_claim(name))
    for name in ("hold-2-8", "hold-9-10"):
        work.release(name, name)


def test_a_claim_that_cannot_fit_stays_pending_with_the_schedulers_reason(
    work: Workloads, drivers: dict[str, DriverProcess]
) -> None:
    """Five devices are no legal set on a torus: no device of class neuron-5 exists there."""
    work.claim("five-on-torus", 5)
    work.pod("five-on-torus", claim="five-on-torus", node_selector=on_node(drivers["trn1"]))

    def reason() -> str | None:
        for event in work.events("five-on-torus"):
            if event["reason"] == "FailedScheduling":
                return str(event["message"])
        return None

    message = wait_for(reason, "a FailedScheduling event")
    assert "cannot allocate all claims" in message, message

    def condition() -> dict[str, str] | None:
        # kube-scheduler writes the event and the pod's status apart: under load the event came
        # first and the pod had no conditions yet (a full run failed so).
        pod = work.cp.request("GET", "/api/v1/namespaces/dra-work/pods/five-on-torus")
        assert not pod["spec"].get("nodeName")
        found = [c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"]
        return found[0] if found else None

    scheduled = wait_for(condition, "the pod's PodScheduled condition")
    assert (scheduled["status"], scheduled["reason"]) == ("False", "Unschedulable")
    assert not work.get_claim("five-on-torus").get("status", {}).get("allocation")


def test_a_driver_restart_loses_no_prepared_claim_over_grpc_without_kubelet(
    work: Workloads, drivers: dict[str, DriverProcess]
) -> None:
    driver = drivers["trn1-whole"]
    work.claim("restart-row", 4)
    work.pod("restart-row", claim="restart-row", node_selector=on_node(driver))
    claim = work.wait_allocated("restart-row")
    uid = claim["metadata"]["uid"]
    before = driver.prepare([claim]).claims[uid]
    assert before.error == "" and len(before.devices) == 1
    generation = slices_of(work.cp, driver.node)[0]["spec"]["pool"]["generation"]
    driver.stop(kill=True)
    # While the driver is down the claim disappears from the API: only the checkpoint knows it.
    work.release("restart-row", "restart-row")
    driver.start()
    after = driver.prepare([claim]).claims[uid]
    assert after == before
    assert driver.cdi_spec(uid) is not None
    # The restart republished nothing: same pool generation, no churn for the scheduler.
    assert slices_of(work.cp, driver.node)[0]["spec"]["pool"]["generation"] == generation
    assert driver.unprepare([claim]).claims[uid].error == ""
    assert driver.cdi_spec(uid) is None
    assert uid not in driver.checkpoint.read_text()


@pytest.mark.compat
def test_device_health_becomes_device_taints(
    work: Workloads, drivers: dict[str, DriverProcess]
) -> None:
    driver = drivers["trn1-whole"]
    core_count = driver.sys / "class" / "neuron_device" / "neuron13" / "core_count"
    core_count.write_text("garbage")

    def tainted() -> set[str] | None:
        names = {
            d["name"]
            for s in slices_of(work.cp, driver.node)
            for d in s["spec"].get("devices", [])
            if d.get("taints")
        }
        return names or None

    # The device sets holding it, and every core window with a core on it (cores 26 and 27).
    windows = {
        s.name
        for s in published_shapes(CATALOG.resolve("trn1.32xlarge").topology, DEFAULT_CORE_WINDOWS)
        if s.kind is ShapeKind.CORES and 13 in s.members
    }
    assert {"cores-1-at-26", "cores-2-at-26", "cores-4-at-24", "cores-16-at-16"} <= windows
    expected = {"single-13", "row-3", "half-1", "all", *windows}
    # The slices are updated one after the other: wait for the last.
    wait_for(lambda: tainted() == expected, "taints on every device holding neuron13")
    # The scheduler keeps the half away from it.
    work.claim("half-while-13-sick", 8)
    work.pod("half-while-13-sick", claim="half-while-13-sick", node_selector=on_node(driver))
    claim = work.wait_allocated("half-while-13-sick")
    assert allocated_devices(claim) == [(driver.node, "half-0")]
    # status and why say what the scheduler does: the failed device, read from the same taints.
    shown = cli(work.cp, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    dra = json.loads(shown.stdout)["dra"]
    (node,) = [n for n in dra["nodes"] if n["name"] == driver.node]
    assert node["unhealthy_devices"] == [13] and dra["unread"] is None
    work.claim("all-while-13-sick", 16)
    work.pod("all-while-13-sick", claim="all-while-13-sick", node_selector=on_node(driver))
    answer = cli(work.cp, "why", "all-while-13-sick", "-n", work.namespace)
    assert answer.returncode == 1, answer
    assert "DRA plugin places it" in answer.stderr and f"{driver.node} (device 13)" in answer.stderr
    work.release("all-while-13-sick", "all-while-13-sick")
    core_count.write_text("2\n")
    wait_for(lambda: not tainted(), "the taints to be lifted")
    work.release("half-while-13-sick", "half-while-13-sick")


@pytest.mark.compat
def test_taints_an_api_server_drops_are_said(tmp_path: Path) -> None:
    """The taints above are what keeps a failed device from claims. With device taints off
    (DRADeviceTaints: alpha and off in 1.35; beta in 1.36 and GA in 1.37, both on unless turned
    off, together with DRADeviceTaintRules which needs it), the API server keeps the slices and
    drops the taints without an error; the driver says which gate to turn on."""
    off = {"DRADeviceTaints": False, "DRADeviceTaintRules": False}
    with dra_control_plane(off, tmp_path / "cp") as plane:
        work = Workloads(plane, "dra-taints-off")
        node, _ = work.add_node("trn1.32xlarge", {})
        driver = DriverProcess(plane, node, "trn1.32xlarge")
        try:
            driver.start()
            (driver.sys / "class" / "neuron_device" / "neuron13" / "core_count").write_text("x")
            said = "without the taints that mark their failed device: device taints are off"
            wait_for(
                lambda: said in driver.process.log_path.read_text() or None,
                "the driver to say that device taints are off",
            )
            assert "DRADeviceTaints feature gate" in driver.process.log_path.read_text()
            devices = [d for s in slices_of(plane, node) for d in s["spec"].get("devices", [])]
            assert devices and not any(d.get("taints") for d in devices)
        finally:
            driver.remove()


def cli(cp: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neuron_scheduler", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(cp.kubeconfig_path), "COLUMNS": "200"},
        timeout=120,
    )


FLEET = [
    "inf2.48xlarge",
    "inf2.48xlarge",
    "inf2.48xlarge",
    "inf2.24xlarge",
    "inf2.24xlarge",
    "inf1.24xlarge",
    "inf1.6xlarge",
    "trn1.32xlarge",
    "trn1.32xlarge",
    "trn2.48xlarge",
]
SIZES = [1, 1, 1, 2, 2, 3, 3, 4, 4, 6, 8, 12, 16]


def test_300_random_claims_over_10_mixed_nodes_never_overlap(
    cp: ControlPlane, work: Workloads
) -> None:
    """The real kube-scheduler allocates 300 claims of random sizes over 10 nodes of mixed types,
    with deletions in between; read back from claim status, no allocated set is ever illegal
    and no two live claims share a device. The slices are published with the driver's own
    publisher in this process (ten driver processes would only add load)."""
    bulk = Workloads(cp, "dra-bulk")
    types: dict[str, str] = {}
    for instance_type in FLEET:
        node, uid = bulk.add_node(instance_type, {"dra-test": "bulk"})
        publish(cp, node, instance_type, uid)
        types[node] = instance_type
    rng = random.Random(20)
    live: dict[str, str] = {}  # pod -> claim
    allocations_seen: set[str] = set()
    created = 0

    def settled() -> bool:
        pods = bulk.pods()
        for pod in pods:
            if pod["spec"].get("nodeName"):
                continue
            conditions = pod.get("status", {}).get("conditions", [])
            if not any(c["type"] == "PodScheduled" and c["status"] == "False" for c in conditions):
                return False
        return True

    def check() -> int:
        held: dict[str, int] = {}
        allocated = 0
        for claim in bulk.claims():
            devices = allocated_devices(claim)
            if not devices:
                continue
            allocated += 1
            allocations_seen.add(claim["metadata"]["uid"])
            ((pool, device),) = devices
            size = int(
                claim["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"].split("-")[1]
            )
            topology = CATALOG.resolve(
                types[pool], CATALOG.device_count(types[pool]) or 16
            ).topology
            shape = shapes_by_name(topology)[device]
            assert shape.size == size, (claim["metadata"]["name"], device)
            assert is_valid_device_set(topology, list(shape.members)), (pool, device)
            overlap = held.get(pool, 0) & shape.mask
            assert not overlap, f"{pool}: devices {mask_ids(overlap)} allocated twice"
            held[pool] = held.get(pool, 0) | shape.mask
        return allocated

    while created < 300:
        for _ in range(min(30, 300 - created)):
            name = f"c{created:03d}"
            bulk.claim(name, rng.choice(SIZES))
            bulk.pod(name, claim=name, node_selector={"dra-test": "bulk"})
            live[name] = name
            created += 1
        wait_for(settled, "every pod to be bound or found unschedulable")
        check()
        bound = [p["metadata"]["name"] for p in bulk.pods() if p["spec"].get("nodeName")]
        for pod in rng.sample(bound, k=len(bound) * 2 // 5):
            bulk.release(pod, live.pop(pod))
    wait_for(settled, "the last pods to settle")
    check()
    capacity = sum(
        CATALOG.resolve(t, CATALOG.device_count(t) or 16).topology.devices for t in FLEET
    )
    # Deletions made room again and again: far more claims were allocated than the fleet holds
    # at once (each claim at least one device).
    assert len(allocations_seen) > capacity, (len(allocations_seen), capacity)
    for pod, claim in list(live.items()):
        bulk.release(pod, claim)
