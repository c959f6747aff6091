"""The DRA driver's published devices against the allocator's rules.

- every published device is a set the allocator allows, and every allowed set is published;
- the published core windows are the windows the allocator may give a core request;
- the counters make two shapes that share a core impossible together, device sets and core
  windows alike: an allocator that only looks at the published counters (as kube-scheduler's
  does) never hands out a core twice;
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
    allowed_blocks,
    is_valid_core_set,
    is_valid_device_set,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import ids_mask, mask_ids
from neuron_scheduler.core.resources import NEURON, NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology, TopologyKind
from neuron_scheduler.dra.firstfit import first_fit
from neuron_scheduler.dra.shapes import core_windows_fit, published_shapes, shapes_by_name
from neuron_scheduler.dra.slices import NodeInventory, SliceContent, limit_problems, pool_slices

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


class Counters:
    """An allocator that knows only what the slices publish, as kube-scheduler's does: each
    device's counter consumption, the counter sets' values, and that a device is allocated at
    most once."""

    def __init__(self, slices: list[SliceContent]) -> None:
        self.capacity = {
            (s["name"], name): int(v["value"])
            for c in slices
            for s in c.shared_counters
            for name, v in s["counters"].items()
        }
        self.devices = [d for c in slices for d in c.devices]
        self.draws = {d["name"]: drawn(d) for d in self.devices}
        self.used: dict[tuple[str, str], int] = {}
        self.allocated: list[str] = []

    def fits(self, name: str) -> bool:
        return name not in self.allocated and all(
            self.used.get(k, 0) + amount <= self.capacity[k]
            for k, amount in self.draws[name].items()
        )

    def take(self, name: str) -> None:
        for k, amount in self.draws[name].items():
            self.used[k] = self.used.get(k, 0) + amount
        self.allocated.append(name)

    def give_back(self, name: str) -> None:
        for k, amount in self.draws[name].items():
            self.used[k] -= amount
        self.allocated.remove(name)


def drawn(device: dict[str, Any]) -> dict[tuple[str, str], int]:
    return {
        (c["counterSet"], name): int(value["value"])
        for c in device.get("consumesCounters", [])
        for name, value in c["counters"].items()
    }


# Catalog types, their other LNC settings, and lab rings and chains, each with core windows of
# any counts of 1 .. 32 cores (none included).
node_shapes = st.tuples(
    st.one_of(
        topologies,
        st.builds(
            lambda kind, n, cores: Topology(f"lab.{kind.value}{n}", kind, n, cores),
            st.sampled_from([TopologyKind.RING, TopologyKind.CHAIN]),
            st.integers(1, 12),
            st.integers(1, 8),
        ),
        # Trn2 at LNC=1 (8 cores per device: 128 cores, 4 sets of core counters) and LNC=2.
        st.sampled_from([4, 8]).map(
            lambda cores: CATALOG.resolve("trn2.48xlarge", 16, 16 * cores).topology
        ),
    ),
    st.sets(st.integers(1, 32), max_size=8).map(lambda counts: tuple(sorted(counts))),
)


@settings(max_examples=150, deadline=None)
@given(node_shapes, st.data())
def test_core_and_device_windows_never_allocate_overlapping_cores(
    node: tuple[Topology, tuple[int, ...]], data: st.DataObject
) -> None:
    """Any sequence of allocations and releases an allocator that reads only the counters can
    make (any free device, not only the first) holds no core twice; and two devices fit
    together from an empty node exactly when they share no core."""
    topology, core_windows = node
    slices = pool_slices(DRIVER, NodeInventory("n", topology, core_windows=core_windows))
    assert limit_problems(slices) == []
    by_name = shapes_by_name(topology)
    counters = Counters(slices)
    names = [d["name"] for d in counters.devices]
    if len(names) < 2:
        return
    for a, b in data.draw(
        st.lists(st.tuples(st.sampled_from(names), st.sampled_from(names)), max_size=30)
    ):
        if a == b:
            continue
        empty = Counters(slices)
        empty.take(a)
        together = empty.fits(b)
        assert together == (not by_name[a].core_mask & by_name[b].core_mask), (a, b)
    for release, name in data.draw(
        st.lists(st.tuples(st.booleans(), st.sampled_from(names)), max_size=80)
    ):
        if release and counters.allocated:
            counters.give_back(
                counters.allocated[data.draw(st.integers(0, len(counters.allocated) - 1))]
            )
            continue
        if not counters.fits(name):
            continue
        counters.take(name)
        held = [by_name[n].core_mask for n in counters.allocated]
        assert (
            sum(m.bit_count() for m in held)
            == ids_mask(c for m in held for c in mask_ids(m)).bit_count()
        ), f"two devices share a core: {counters.allocated}"


@settings(max_examples=100, deadline=None)
@given(node_shapes, st.data())
def test_first_fit_by_cores_is_first_fit_by_counters(
    node: tuple[Topology, tuple[int, ...]], data: st.DataObject
) -> None:
    """`dra.firstfit` (what benchmarks and node scores use) decides by cores in use; the
    scheduler by counters. On any state the counters reach, they pick the same device."""
    topology, core_windows = node
    slices = pool_slices(DRIVER, NodeInventory("n", topology, core_windows=core_windows))
    shapes = published_shapes(topology, core_windows)
    counters = Counters(slices)
    kinds = sorted({(s.unit, s.count) for s in shapes})
    for unit, count in data.draw(st.lists(st.sampled_from(kinds), max_size=40)):
        used = 0
        for name in counters.allocated:
            used |= shapes_by_name(topology)[name].core_mask
        chosen = first_fit(topology, used, unit, count, core_windows=core_windows)
        by_counters = next(
            (s for s in shapes if (s.unit, s.count) == (unit, count) and counters.fits(s.name)),
            None,
        )
        assert chosen == by_counters
        if chosen is not None:
            counters.take(chosen.name)
        elif counters.allocated and data.draw(st.booleans()):
            counters.give_back(counters.allocated[0])


@settings(max_examples=100, deadline=None)
@given(node_shapes)
def test_core_windows_are_the_allocators_windows(node: tuple[Topology, tuple[int, ...]]) -> None:
    """Every published core window is one `core.allocation` may give a request of its count;
    all of them are published for each configured count, unless the counters cannot express
    them (a window across a 32-core boundary draws on two sets of core counters)."""
    topology, core_windows = node
    windows = [s for s in published_shapes(topology, core_windows) if s.unit is Unit.CORE]
    for shape in windows:
        assert is_valid_core_set(topology, list(shape.cores)), shape
        assert shape.members == tuple(sorted({c // topology.cores_per_device for c in shape.cores}))
    if not core_windows_fit(topology):
        assert windows == []
        return
    published = {w.core_mask for w in windows}
    for count in (c for c in core_windows if c <= topology.total_cores):
        for block in allowed_blocks(topology, Unit.CORE, count):
            first = (block & -block).bit_length() - 1
            crosses = first // 32 != (first + count - 1) // 32
            assert (block in published) != crosses, (count, mask_ids(block))


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
        shape = first_fit(topology, topology.core_mask_of_devices(busy), Unit.DEVICE, size)
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
    shape = first_fit(topology, state.used_cores, Unit.DEVICE, 1)
    assert isinstance(best, Placement) and shape is not None
    assert best.devices == (11,)
    assert shape.members == (1,)
