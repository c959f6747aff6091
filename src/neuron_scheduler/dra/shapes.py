"""The devices the DRA driver publishes: one per legal set of Neuron devices, and one per legal
window of NeuronCores. Pure.

A claim asks for `count: 1` of a size's class and the scheduler can only ever pick a set that
exists here:
- device sets: torus singles, rows, halves and the whole node; every window of a ring
  (wrap-around included) or chain. Switch nodes allow any set; they are published as chains
  (every contiguous run of ids), which is legal there but cannot offer k scattered free devices;
- core windows (`cores-<k>-at-<first core>`): k consecutive core ids on an allowed span of
  devices, exactly the windows `core.allocation` may give a k-core request (`allowed_blocks`),
  at the node's logical cores per device (its LNC setting). Core ids never wrap. Published for
  the configured counts k (each count's every legal window), and only where the counters can
  express them (`core_windows_fit`).

The order of `published_shapes` is the order the scheduler's first fit tries them: device sets
by size, then by first device (on a node without holes that is what the allocator's best fit
picks); then core windows by size, then by how many devices they touch (fewest first: a window
that fits in one device breaks no second one), then by first core.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from neuron_scheduler.core.allocation import allowed_blocks
from neuron_scheduler.core.ids import devices_of_cores, ids_mask, mask_ids
from neuron_scheduler.core.resources import Unit
from neuron_scheduler.core.topology import Topology, TopologyKind

# resource.k8s.io/v1: a device draws on at most 2 counter sets of at most 32 counters each, and
# a slice holds at most 8 sets. Core windows draw on the one set of device counters and on one
# set of 32 core counters (slices.py), so they exist only on nodes with at most 32 devices and
# 7 sets of cores, and never cross a 32-core boundary.
CORE_SET_SIZE = 32
MAX_CORE_SETS = 7
MAX_DEVICES_WITH_CORE_WINDOWS = 32
# The largest core window any configuration publishes: a window lies within one core set.
MAX_CORE_WINDOW = CORE_SET_SIZE
EVERY_CORE_WINDOW = tuple(range(1, MAX_CORE_WINDOW + 1))
CoreWindows = tuple[int, ...]  # the counts of cores windows are published for, ascending


class ShapeKind(StrEnum):
    SINGLE = "single"
    WINDOW = "window"  # a run of 2 .. n-1 devices on a ring, chain or switch
    ROW = "row"  # a 4x4 torus row (4 devices)
    HALF = "half"  # half a torus (two rows)
    GROUP = "group"  # any other torus group a catalog defines
    WHOLE = "whole"
    CORES = "cores"  # a window of NeuronCores, on devices other claims may share


@dataclass(frozen=True, slots=True)
class Shape:
    name: str  # the published device name: a DNS label, unique on the node
    mask: int  # the devices it takes (device sets) or takes cores on (core windows)
    members: tuple[int, ...]  # in topology order: a wrapped ring window starts at its first device
    kind: ShapeKind
    core_mask: int  # the global core ids it takes, at the node's logical cores per device

    @property
    def unit(self) -> Unit:
        return Unit.CORE if self.kind is ShapeKind.CORES else Unit.DEVICE

    @property
    def size(self) -> int:
        """Whole devices it gives: 0 for a core window (what the `size` attribute says, so that
        the device classes' `size == k` never matches one)."""
        return 0 if self.kind is ShapeKind.CORES else len(self.members)

    @property
    def count(self) -> int:
        """What a request for it counts: devices, or cores for a core window."""
        return self.core_mask.bit_count() if self.kind is ShapeKind.CORES else len(self.members)

    @property
    def cores(self) -> tuple[int, ...]:
        return tuple(mask_ids(self.core_mask))

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.members))


def published_shapes(topology: Topology, core_windows: CoreWindows = ()) -> tuple[Shape, ...]:
    """Every shape the driver publishes for a node of this topology, in first-fit order: device
    sets, then the core windows of each count in `core_windows` (counts beyond 1 ..
    MAX_CORE_WINDOW are ignored)."""
    return _shapes(topology, core_window_counts(core_windows))


def core_window_counts(counts: Iterable[int]) -> CoreWindows:
    """The counts as published: within 1 .. MAX_CORE_WINDOW, each once, ascending."""
    return tuple(sorted({c for c in counts if 1 <= c <= MAX_CORE_WINDOW}))


def shapes_by_name(topology: Topology) -> dict[str, Shape]:
    """Every shape any configuration publishes on this node, by device name: what an allocated
    device name stands for, whatever sizes of core windows are published now (a claim may have
    been allocated before a restart that changed them)."""
    return _by_name(topology)


def core_windows_fit(topology: Topology) -> bool:
    """Whether the API's counter limits can express this node's core windows."""
    sets = -(-topology.total_cores // CORE_SET_SIZE)
    return topology.devices <= MAX_DEVICES_WITH_CORE_WINDOWS and sets <= MAX_CORE_SETS


@lru_cache(maxsize=256)
def _by_name(topology: Topology) -> dict[str, Shape]:
    return {shape.name: shape for shape in _shapes(topology, EVERY_CORE_WINDOW)}


@lru_cache(maxsize=1024)
def _shapes(topology: Topology, core_windows: CoreWindows) -> tuple[Shape, ...]:
    n = topology.devices
    shapes: list[Shape] = []
    for size in range(1, n + 1):
        if size == 1:
            shapes.extend(
                _device_shape(topology, f"single-{d}", (d,), ShapeKind.SINGLE) for d in range(n)
            )
        elif size == n:
            shapes.append(_device_shape(topology, "all", tuple(range(n)), ShapeKind.WHOLE))
        elif topology.kind is TopologyKind.TORUS:
            kind = _torus_kind(n, size)
            for index, mask in enumerate(topology.device_sets(size)):
                name = f"{kind.value}-{index}" if kind is not ShapeKind.GROUP else None
                shapes.append(
                    _device_shape(
                        topology, name or f"group-{size}-{index}", tuple(mask_ids(mask)), kind
                    )
                )
        else:
            shapes.extend(_windows(topology, size))
    if core_windows_fit(topology):
        for count in core_windows:
            if count <= topology.total_cores:
                shapes.extend(_core_windows(topology, count))
    return tuple(shapes)


def _device_shape(
    topology: Topology, name: str, members: tuple[int, ...], kind: ShapeKind
) -> Shape:
    mask = ids_mask(members)
    return Shape(name, mask, members, kind, topology.core_mask_of_devices(mask))


def _torus_kind(devices: int, size: int) -> ShapeKind:
    if devices == 16 and size == 4:
        return ShapeKind.ROW
    if size * 2 == devices:
        return ShapeKind.HALF
    return ShapeKind.GROUP


def _windows(topology: Topology, size: int) -> list[Shape]:
    n = topology.devices
    wraps = topology.kind is TopologyKind.RING
    starts = range(n) if wraps else range(n - size + 1)
    return [
        _device_shape(
            topology,
            f"window-{size}-at-{start}",
            tuple((start + i) % n for i in range(size)),
            ShapeKind.WINDOW,
        )
        for start in starts
    ]


def _core_windows(topology: Topology, count: int) -> list[Shape]:
    """The legal windows of `count` cores that stay within one set of core counters, fewest
    devices touched first, then by first core."""
    windows = []
    for block in allowed_blocks(topology, Unit.CORE, count):
        first = (block & -block).bit_length() - 1
        if first // CORE_SET_SIZE != (first + count - 1) // CORE_SET_SIZE:
            continue
        devices = devices_of_cores(mask_ids(block), topology.cores_per_device)
        windows.append(
            Shape(f"cores-{count}-at-{first}", ids_mask(devices), devices, ShapeKind.CORES, block)
        )
    windows.sort(key=lambda w: (len(w.members), w.core_mask & -w.core_mask))
    return windows
