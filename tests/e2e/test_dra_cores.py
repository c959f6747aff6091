"""NeuronCore claims through DRA, and node choice for DRA pods, on the real kube-scheduler (issue
42): the chart's DRA objects (DeviceClasses neuron-1 .. 16 and neuroncore-1, 2, 4, 8, 16,
policies) applied strictly, `neuron-scheduler dra-driver` processes publishing device sets and
core windows for an inf2.48xlarge and a trn1.32xlarge, and:
- the cluster's own kube-scheduler (default-scheduler) allocating mixed core and device claims;
  each claim is then prepared over the driver's real gRPC socket, as kubelet would
  (tests/e2e/dra.py says what stands in for kubelet and kube-controller-manager);
- `my-scheduler` with our extender (least privilege, the chart's rules) and its
  prioritize-claims entry, as the chart configures both with dra.enabled, choosing among three
  inf2.48xlarge nodes where one is clearly the best fit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from neuron_scheduler.core.allocation import is_valid_core_set, is_valid_device_set
from neuron_scheduler.core.resources import Unit
from neuron_scheduler.dra.shapes import Shape, shapes_by_name
from tests.e2e.dra import (
    CATALOG,
    DRIVER,
    DriverProcess,
    Json,
    Workloads,
    allocated_devices,
    dra_control_plane,
    wait_for,
)
from tests.testbed import ControlPlane, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.needs("dra")]


@pytest.fixture(scope="module")
def cp() -> Iterator[ControlPlane]:
    with dra_control_plane() as plane:
        yield plane


@pytest.fixture(scope="module")
def drivers(cp: ControlPlane) -> Iterator[dict[str, DriverProcess]]:
    """Five nodes, each with its driver process: an inf2.48xlarge and a trn1.32xlarge for the
    core claims, three inf2.48xlarge for node choice."""
    work = Workloads(cp, "dra-nodes")
    started: dict[str, DriverProcess] = {}
    try:
        for key, instance_type, group in (
            ("inf2", "inf2.48xlarge", "cores"),
            ("trn1", "trn1.32xlarge", "cores"),
            ("choice-a", "inf2.48xlarge", "choice"),
            ("choice-b", "inf2.48xlarge", "choice"),
            ("choice-c", "inf2.48xlarge", "choice"),
        ):
            node, _ = work.add_node(instance_type, {"dra-test": group})
            driver = DriverProcess(cp, node, instance_type)
            driver.start()
            started[key] = driver
        yield started
    finally:
        for driver in started.values():
            driver.remove()


def shape_of(claim: Json, driver: DriverProcess, instance_type: str) -> Shape:
    ((pool, device),) = allocated_devices(claim)
    assert pool == driver.node
    return shapes_by_name(CATALOG.resolve(instance_type).topology)[device]


def mix(instance_type: str) -> list[tuple[str, int, bool]]:
    """(name, count, core claim?): 1-, 2- and 4-core claims between device claims (two devices
    on a ring, a row of four on a torus: a torus has no pairs)."""
    pair = 2 if instance_type.startswith("inf2") else 4
    return [
        ("c1-a", 1, True),
        ("c1-b", 1, True),
        ("c1-c", 1, True),
        ("d1-a", 1, False),
        ("c2-a", 2, True),
        ("c4-a", 4, True),
        (f"d{pair}-a", pair, False),
        ("c2-b", 2, True),
        ("d1-b", 1, False),
        ("c4-b", 4, True),
        ("c1-d", 1, True),
    ]


@pytest.mark.parametrize(
    ("key", "instance_type"), [("inf2", "inf2.48xlarge"), ("trn1", "trn1.32xlarge")]
)
@pytest.mark.compat
def test_core_and_device_claims_share_no_core_and_get_connected_cores_over_grpc_without_kubelet(
    cp: ControlPlane, drivers: dict[str, DriverProcess], key: str, instance_type: str
) -> None:
    """Claims of 1, 2 and 4 cores and of devices, mixed, on one node: each is one connected set
    the allocator allows, no core is held twice (a device claim holds every core of its
    devices), and the environment prepared for each names exactly its cores and the devices
    they are on. Then a third of them go (unprepared, as kubelet would) and as many come back,
    into the holes; and once every device has a core in use, a device claim waits although half
    the cores are free."""
    driver = drivers[key]
    work = Workloads(cp, f"cores-{key}")
    topology = CATALOG.resolve(instance_type).topology
    on_node = {"kubernetes.io/hostname": driver.node}
    live: list[str] = []

    def place(name: str, count: int, cores: bool, members: str | None = None) -> None:
        work.claim(name, count, members, cores=cores)
        work.pod(name, claim=name, node_selector=on_node)
        live.append(name)

    def settled() -> dict[str, Json]:
        """Every live claim's pod bound or found unschedulable: the allocated claims."""

        def done() -> dict[str, Json] | None:
            pods = {p["metadata"]["name"]: p for p in work.pods()}
            allocated = {}
            for name in live:
                claim = work.get_claim(name)
                if allocated_devices(claim):
                    allocated[name] = claim
                    continue
                conditions = pods[name].get("status", {}).get("conditions", [])
                if not any(
                    c["type"] == "PodScheduled" and c["status"] == "False" for c in conditions
                ):
                    return None
            return allocated

        return wait_for(done, "every claim to be allocated or refused")

    def check(allocated: dict[str, Json]) -> set[int]:
        held: dict[int, str] = {}
        for name, claim in allocated.items():
            shape = shape_of(claim, driver, instance_type)
            if shape.unit is Unit.CORE:
                assert is_valid_core_set(topology, list(shape.cores)), (name, shape.name)
            else:
                assert is_valid_device_set(topology, list(shape.members)), (name, shape.name)
            for core in shape.cores:
                assert core not in held, f"core {core}: {held.get(core)} and {name}"
                held[core] = name
            uid = claim["metadata"]["uid"]
            answer = driver.prepare([claim]).claims[uid]
            assert answer.error == "", (name, answer.error)
            spec = driver.cdi_spec(uid)
            assert spec is not None
            (cdi,) = spec["devices"]
            edits = cdi["containerEdits"]
            visible = [e for e in edits["env"] if e.startswith("NEURON_RT_VISIBLE_CORES=")]
            assert visible == ["NEURON_RT_VISIBLE_CORES=" + ",".join(map(str, shape.cores))]
            nodes = [n["path"] for n in edits["deviceNodes"]]
            assert nodes == [f"/dev/neuron{d}" for d in shape.device_ids], name
        return set(held)

    def release(name: str) -> None:
        claim = work.get_claim(name)
        assert driver.unprepare([claim]).claims[claim["metadata"]["uid"]].error == ""
        work.release(name, name)
        live.remove(name)

    def release_all(allocated: dict[str, Json]) -> None:
        """Every live claim: unprepared first where it was allocated (and so prepared)."""
        for name in list(live):
            if name in allocated:
                release(name)
            else:
                work.release(name, name)
                live.remove(name)

    for claim in mix(instance_type):
        place(*claim)
    allocated = settled()
    assert sorted(allocated) == sorted(live), "every claim of the mix fits an empty node"
    check(allocated)
    # The first three 1-core claims took cores 0-2 (first fit); no device claim after them
    # took device 1, whose core 2 is held: its core 3 is what the last 1-core claim got.
    assert shape_of(allocated["c1-d"], driver, instance_type).cores == (3,)
    # Departures leave holes; claims of the same sizes fill what they can, sharing no core.
    leaving = live[::3]
    sizes = {name: (count, cores) for name, count, cores in mix(instance_type)}
    for name in leaving:
        release(name)
    for name in leaving:
        place(f"{name}-again", *sizes[name])
    allocated = settled()
    assert len(allocated) >= len(live) - 2, sorted(set(live) - set(allocated))
    check(allocated)
    # A device claim never takes a device a core claim holds a core of: with one core held on
    # every device, a single device waits while half the cores are free, and a core claim
    # still gets one.
    release_all(allocated)
    for device in range(topology.devices):
        place(f"pin-{device}", 1, True, members=str(device))
    pinned = settled()
    used = check(pinned)
    assert used == {d * topology.cores_per_device for d in range(topology.devices)}
    place("single", 1, False)
    place("core", 1, True)
    allocated = settled()
    assert "single" not in allocated
    message = next(
        str(e["message"]) for e in work.events("single") if e["reason"] == "FailedScheduling"
    )
    assert "cannot allocate all claims" in message, message
    assert shape_of(allocated["core"], driver, instance_type).cores == (1,)
    check(allocated)
    release_all(allocated)


@pytest.fixture(scope="module")
def stack(cp: ControlPlane, drivers: dict[str, DriverProcess]) -> Iterator[Stack]:
    """Our extender with --dra-driver, and `my-scheduler` with its DRA scoring entry."""
    del drivers
    stack = Stack(cp, extender_args=["--dra-driver", DRIVER])
    stack.use_scheduler(node_cache_capable=True, dra_prioritize=True)
    yield stack
    stack.stop()


def test_node_choice_for_a_core_claim_follows_prioritize(
    cp: ControlPlane, drivers: dict[str, DriverProcess], stack: Stack
) -> None:
    """Three empty inf2.48xlarge nodes; a single device held on b and on c, one core held on a.
    A 1-core claim then wastes nothing on a (it takes the held core's neighbour) and cuts a
    whole device on b or c (a device the cluster asks for single devices of): prioritize scores
    a 10, b and c 9, and my-scheduler picks a. Without prioritize the three are equal to
    kube-scheduler (same pods per node), a one-in-three pick: done five times over, a test
    that passed by chance would do so one time in 243."""
    a, b, c = (drivers[f"choice-{n}"] for n in "abc")
    work = Workloads(cp, "choice")
    for name, driver, count, cores in (
        ("hold-a", a, 1, True),
        ("hold-b", b, 1, False),
        ("hold-c", c, 1, False),
    ):
        work.claim(name, count, cores=cores)
        work.pod(
            name,
            claim=name,
            node_selector={"kubernetes.io/hostname": driver.node},
            scheduler="my-scheduler",
        )
        work.wait_allocated(name)
    for attempt in range(5):
        name = f"one-core-{attempt}"
        work.claim(name, 1, cores=True)
        work.pod(name, claim=name, node_selector={"dra-test": "choice"}, scheduler="my-scheduler")
        claim = work.wait_allocated(name)
        ((pool, device),) = allocated_devices(claim)
        assert (pool, device) == (a.node, "cores-1-at-1"), (attempt, pool, device)
        work.release(name, name)
        # The next attempt must not see this claim's core as held: wait until it is free.
        wait_for(
            lambda n=name: not any(c["metadata"]["name"] == n for c in work.claims()),
            f"claim {name} to be gone",
        )
    metrics = stack.extender.metrics()
    assert 'verb="prioritize-claims"' in metrics
    for name in ("hold-a", "hold-b", "hold-c"):
        work.release(name, name)
