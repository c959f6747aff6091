"""The decision kube-scheduler's DRA allocator makes on one node over the devices this driver
publishes: first fit, in our order. Pure; for benchmarks and tests that compare it with our
best fit (`core.allocation.allocate`), and for the extender's node score of a pod with our claim.

The allocator (k8s.io/dynamic-resource-allocation/structured, 1.36) sorts a pool's slices by name,
walks each slice's devices in order and takes the first one that matches the claim's class
(`size == k`, or `shape == 'cores' && cores == k`) and whose counters are all still free; there
is no scoring. With `count: 1` of a class that is: the first published shape of that unit and
count whose cores are all free and whose devices are not tainted. (A core window's counters are
free exactly when its cores are: a device set in use holds all its devices' cores, and a core
window its own; tests/property/test_dra_shapes.py checks the counters say the same.) Which node
the claim lands on is kube-scheduler's choice among the nodes where such a shape exists; callers
decide the node order.
"""

from __future__ import annotations

from functools import lru_cache

from neuron_scheduler.core.allocation import (
    Decision,
    NodeState,
    Placement,
    Refusal,
    check_request,
    counted,
)
from neuron_scheduler.core.ids import cores_of_devices, devices_touched, format_ids, mask_ids
from neuron_scheduler.core.resources import NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra.shapes import CoreWindows, Shape, published_shapes


@lru_cache(maxsize=1024)
def _by_request(
    topology: Topology, core_windows: CoreWindows
) -> dict[tuple[Unit, int], tuple[Shape, ...]]:
    kinds: dict[tuple[Unit, int], list[Shape]] = {}
    for shape in published_shapes(topology, core_windows):
        kinds.setdefault((shape.unit, shape.count), []).append(shape)
    return {key: tuple(shapes) for key, shapes in kinds.items()}


def published_for(
    topology: Topology, unit: Unit, count: int, core_windows: CoreWindows = ()
) -> bool:
    """Whether the node publishes any device a request of `count` `unit`s can get."""
    return bool(_by_request(topology, core_windows).get((unit, count)))


def first_fit(
    topology: Topology,
    used_cores: int,
    unit: Unit,
    count: int,
    *,
    tainted: int = 0,
    core_windows: CoreWindows = (),
) -> Shape | None:
    """The shape the allocator picks for `count: 1` of the class for `count` `unit`s, None if
    none fits.

    used_cores: cores (mask) held by allocated claims (a device set holds all its devices'
    cores); tainted: unhealthy devices (mask), whose shapes carry a NoSchedule taint the claim
    does not tolerate."""
    for shape in _by_request(topology, core_windows).get((unit, count), ()):
        if not shape.core_mask & used_cores and not shape.mask & tainted:
            return shape
    return None


def allocate_like_scheduler(
    topology: Topology, state: NodeState, request: NeuronRequest, core_windows: CoreWindows = ()
) -> Decision:
    """`core.allocation.allocate`'s contract, decided the way the scheduler's DRA allocator
    decides over our published devices (with core windows of the counts in `core_windows`,
    ascending). The score is
    0: DRA does not score devices (the extender's score for DRA nodes is `dra.scoring`'s)."""
    refusal = check_request(topology, request)
    if refusal is not None:
        return refusal
    unit, count = request.unit, request.count
    if not published_for(topology, unit, count, core_windows):
        what = "core window" if unit is Unit.CORE else "device set"
        return Refusal(f"no published {what} of {counted(count, unit)}", True)
    if state.unattributed_cores:
        # DRA has no such thing: every holder is a claim whose devices are known.
        return Refusal("DRA nodes do not have cores held by pods placed elsewhere")
    shape = first_fit(topology, state.used_cores, unit, count, core_windows=core_windows)
    if shape is None:
        if unit is Unit.CORE:
            free = mask_ids(~state.used_cores & ((1 << topology.total_cores) - 1))
            where = f"free cores: {format_ids(free)}"
        else:
            busy = devices_touched(state.used_cores, topology.cores_per_device, topology.devices)
            free = [d for d in range(topology.devices) if not busy >> d & 1]
            where = f"free devices: {format_ids(free)}"
        return Refusal(f"no free published device of {counted(count, unit)} ({where})")
    if unit is Unit.CORE:
        return Placement(shape.members, shape.cores, 0)
    return Placement(shape.members, cores_of_devices(shape.members, topology.cores_per_device), 0)
