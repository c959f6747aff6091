"""The decision kube-scheduler's DRA allocator makes on one node over the devices this driver
publishes: first fit, in our order. Pure; for benchmarks and tests that compare it with our
best fit (`core.allocation.allocate`).

The allocator (k8s.io/dynamic-resource-allocation/structured, 1.36) sorts a pool's slices by name,
walks each slice's devices in order and takes the first one that matches the claim's class
(`size == k`) and whose counters are all still free; there is no scoring. With `count: 1` of a
size's class that is: the first published shape of that size whose members are all free and not
tainted. Which node the claim lands on is kube-scheduler's choice among the nodes where such a
shape exists; callers decide the node order.
"""

from __future__ import annotations

from functools import lru_cache

from neuron_scheduler.core.allocation import (
    Decision,
    NodeState,
    Placement,
    Refusal,
    busy_devices,
    check_request,
)
from neuron_scheduler.core.ids import cores_of_devices, format_ids
from neuron_scheduler.core.resources import NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra.shapes import Shape, published_shapes


@lru_cache(maxsize=256)
def _by_size(topology: Topology) -> dict[int, tuple[Shape, ...]]:
    sizes: dict[int, list[Shape]] = {}
    for shape in published_shapes(topology):
        sizes.setdefault(shape.size, []).append(shape)
    return {size: tuple(shapes) for size, shapes in sizes.items()}


def first_fit(topology: Topology, busy: int, size: int, tainted: int = 0) -> Shape | None:
    """The shape the allocator picks for `count: 1` of the size-`size` class, None if none fits.

    busy: devices (mask) held by allocated claims; tainted: unhealthy devices (mask), whose
    shapes carry a NoSchedule taint the claim does not tolerate."""
    for shape in _by_size(topology).get(size, ()):
        if not shape.mask & (busy | tainted):
            return shape
    return None


def allocate_like_scheduler(
    topology: Topology, state: NodeState, request: NeuronRequest
) -> Decision:
    """`core.allocation.allocate`'s contract, decided the way the scheduler's DRA allocator
    decides over our published devices. The score is 0: DRA does not score devices."""
    refusal = check_request(topology, request)
    if refusal is not None:
        return refusal
    if request.unit is not Unit.DEVICE:
        return Refusal("the DRA driver publishes whole devices; ask for devices", True)
    if not _by_size(topology).get(request.count):
        return Refusal(f"no published device of size {request.count}", True)
    busy = busy_devices(topology, state.used_cores)
    if state.unattributed_cores:
        # DRA has no such thing: every holder is a claim whose devices are known.
        return Refusal("DRA nodes do not have cores held by pods placed elsewhere")
    shape = first_fit(topology, busy, request.count)
    if shape is None:
        free = [d for d in range(topology.devices) if not busy >> d & 1]
        return Refusal(
            f"no free published device of size {request.count} (free devices: {format_ids(free)})"
        )
    return Placement(shape.members, cores_of_devices(shape.members, topology.cores_per_device), 0)
