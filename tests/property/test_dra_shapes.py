"""The DRA driver's published devices against the allocator's rules.

- every published device is a set the allocator allows, and every allowed set is published;
- the counters make two overlapping shapes impossible together: an allocator that only looks at
  the published counters (as kube-scheduler's does) never hands out a device twice;
- on a node without holes, the scheduler's first fit over our order is our best fit.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
from hypothesis import given, settings

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    allocate,
    is_valid_device_set,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import ids_mask, mask_ids
from neuron_scheduler.core.resources import NEURON, NeuronRequest
from neuron_scheduler.core.topology import Topology, TopologyKind
from neuron_scheduler.dra.firstfit import first_fit
from neuron_scheduler.dra.shapes import published_shapes
from neuron_scheduler.dra.slices import NodeInventory, pool_slices

CATALOG = Catalog.builtin()
DRIVER = "neuron.example.com"


def catalog_topology(instance_type: str) -> Topology:
    return CATALOG.resolve(instance_type, CATALOG.device_count(instance_type) or 16).topology


topologies = st.one_of(
    st.sampled_from(CATALOG.instance_types).map(catalog_topology),
    st.builds(
        lambda kind, n, cores: Topology(f"lab.{kind.value}{n}", kind, n, cores),
        st.sampled_from([TopologyKind.RING, TopologyKind.CHAIN, TopologyKind.SWITCH]),
        st.integers(2, 24),
        st.integers(1, 8),
    ),
)


def allowed_sets(topology: Topology) -> set[int]:
    if topology.kind is TopologyKind.SWITCH:
        # Any set is allowed on a switch; the driver publishes the contiguous ones.
        n = topology.devices
        return {((1 << k) - 1) << s for k in range(1, n + 1) for s in range(n - k + 1)}
    return {m for k in range(1, topology.devices + 1) for m in topology.device_sets(k)}


@settings(max_examples=200, deadline=None)
@given(topologies)
def test_published_is_exactly_the_allowed_sets(topology: Topology) -> None:
    shapes = published_shapes(topology)
    masks = [s.mask for s in shapes]
    assert len(set(masks)) == len(masks), "a set published twice"
    assert len({s.name for s in shapes}) == len(shapes)
    for shape in shapes:
        assert ids_mask(shape.members) == shape.mask
        assert is_valid_device_set(topology, list(shape.members)), shape
    assert set(masks) == allowed_sets(topology)


def consumed(device: dict[str, Any]) -> set[tuple[str, str]]:
    return {
        (c["counterSet"], name)
        for c in device.get("consumesCounters", [])
        for name, value in c["counters"].items()
        if value == {"value": "1"}
    }


@settings(max_examples=100, deadline=None)
@given(topologies, st.data())
def test_counters_make_overlapping_shapes_impossible_together(
    topology: Topology, data: st.DataObject
) -> None:
    slices = pool_slices(DRIVER, NodeInventory("n", topology))
    capacity = {
        (s["name"], name): int(v["value"])
        for c in slices
        for s in c.shared_counters
        for name, v in s["counters"].items()
    }
    devices = [d for c in slices for d in c.devices]
    by_name = {s.name: s for s in published_shapes(topology)}
    counted = bool(capacity)
    # Pairwise: counters overlap exactly when the device sets do.
    for a, b in data.draw(
        st.lists(st.tuples(st.sampled_from(devices), st.sampled_from(devices)), max_size=30)
    ):
        if a is b or not counted:
            continue
        shares = bool(consumed(a) & consumed(b))
        assert shares == bool(by_name[a["name"]].mask & by_name[b["name"]].mask)
    # An allocator that knows only the published counters (and that a device is allocated at
    # most once) never hands out one physical device twice.
    used: dict[tuple[str, str], int] = {}
    allocated: list[str] = []
    for step in data.draw(
        st.lists(st.tuples(st.booleans(), st.sampled_from(devices)), max_size=60)
    ):
        release, device = step
        if release and allocated:
            name = allocated.pop(data.draw(st.integers(0, len(allocated) - 1)))
            for key in consumed(next(d for d in devices if d["name"] == name)):
                used[key] -= 1
            continue
        if device["name"] in allocated:
            continue
        keys = consumed(device)
        if any(used.get(k, 0) + 1 > capacity[k] for k in keys):
            continue
        for k in keys:
            used[k] = used.get(k, 0) + 1
        allocated.append(device["name"])
        held = [by_name[n].mask for n in allocated]
        assert (
            sum(m.bit_count() for m in held)
            == ids_mask(d for m in held for d in mask_ids(m)).bit_count()
        ), f"overlapping allocation {allocated}"


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([t for t in CATALOG.instance_types if CATALOG.device_count(t)]),
    st.lists(st.integers(1, 16), max_size=20),
)
def test_without_holes_first_fit_in_our_order_is_best_fit(
    instance_type: str, sizes: list[int]
) -> None:
    topology = catalog_topology(instance_type)
    busy = 0
    for size in sizes:
        best = allocate(
            topology, NodeState(topology.core_mask_of_devices(busy)), NeuronRequest(NEURON, size)
        )
        shape = first_fit(topology, busy, size)
        if not isinstance(best, Placement):
            assert shape is None
            continue
        assert shape is not None and shape.mask == ids_mask(best.devices)
        busy |= shape.mask


def test_first_fit_differs_from_best_fit_once_there_are_holes() -> None:
    """What a static order cannot see: on a 12-ring with holes {1, 2} and {11} (departures),
    best fit puts a single into the one-device hole and keeps the pair whole; first fit in id
    order breaks the pair."""
    topology = catalog_topology("inf2.48xlarge")
    busy = ids_mask([0, *range(3, 11)])
    state = NodeState(topology.core_mask_of_devices(busy))
    best = allocate(topology, state, NeuronRequest(NEURON, 1))
    shape = first_fit(topology, busy, 1)
    assert isinstance(best, Placement) and shape is not None
    assert best.devices == (11,)
    assert shape.members == (1,)
