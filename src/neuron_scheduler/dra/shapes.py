"""The devices the DRA driver publishes: one per legal set of Neuron devices. Pure.

A claim asks for `count: 1` of a size's class and the scheduler can only ever pick a set that
exists here: torus singles, rows, halves and the whole node; every window of a ring (wrap-around
included) or chain. Switch nodes allow any set; they are published as chains (every contiguous run
of ids), which is legal there but cannot offer k scattered free devices.

The order of `published_shapes` is the order the scheduler's first-fit tries them (by size, then
by first device): on a node without holes it picks what the allocator's best fit picks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from neuron_scheduler.core.ids import mask_ids
from neuron_scheduler.core.topology import Topology, TopologyKind


class ShapeKind(StrEnum):
    SINGLE = "single"
    WINDOW = "window"  # a run of 2 .. n-1 devices on a ring, chain or switch
    ROW = "row"  # a 4x4 torus row (4 devices)
    HALF = "half"  # half a torus (two rows)
    GROUP = "group"  # any other torus group a catalog defines
    WHOLE = "whole"


@dataclass(frozen=True, slots=True)
class Shape:
    name: str  # the published device name: a DNS label, unique on the node
    mask: int
    members: tuple[int, ...]  # in topology order: a wrapped ring window starts at its first device
    kind: ShapeKind

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def device_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self.members))


def published_shapes(topology: Topology) -> tuple[Shape, ...]:
    """Every shape the driver publishes for a node of this topology, in first-fit order."""
    return _shapes(topology)


def shapes_by_name(topology: Topology) -> dict[str, Shape]:
    return _by_name(topology)


@lru_cache(maxsize=256)
def _by_name(topology: Topology) -> dict[str, Shape]:
    return {shape.name: shape for shape in _shapes(topology)}


@lru_cache(maxsize=256)
def _shapes(topology: Topology) -> tuple[Shape, ...]:
    n = topology.devices
    shapes: list[Shape] = []
    for size in range(1, n + 1):
        if size == 1:
            shapes.extend(Shape(f"single-{d}", 1 << d, (d,), ShapeKind.SINGLE) for d in range(n))
        elif size == n:
            shapes.append(Shape("all", topology.all_devices, tuple(range(n)), ShapeKind.WHOLE))
        elif topology.kind is TopologyKind.TORUS:
            kind = _torus_kind(n, size)
            for index, mask in enumerate(topology.device_sets(size)):
                name = f"{kind.value}-{index}" if kind is not ShapeKind.GROUP else None
                shapes.append(
                    Shape(name or f"group-{size}-{index}", mask, tuple(mask_ids(mask)), kind)
                )
        else:
            shapes.extend(_windows(topology, size))
    return tuple(shapes)


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
    windows = []
    for start in starts:
        members = tuple((start + i) % n for i in range(size))
        mask = 0
        for d in members:
            mask |= 1 << d
        windows.append(Shape(f"window-{size}-at-{start}", mask, members, ShapeKind.WINDOW))
    return windows
