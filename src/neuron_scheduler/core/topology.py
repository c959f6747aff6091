"""Instance-type topologies: which sets of Neuron devices are directly connected.

Pure data and arithmetic, no I/O. Device sets are int bit masks (bit d = device d) because the
allocator compares thousands of them per second.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache

from neuron_scheduler.core.ids import core_mask_of_devices, format_ids, mask_ids

# The largest node this project will model. Every known instance type is far inside these; a node
# advertising more is refused as unusable (core.catalog), so no mask, id list or allocator loop is
# ever sized by what an API object claims.
MAX_DEVICES = 64
MAX_CORES_PER_DEVICE = 16
MAX_CORES = MAX_DEVICES * MAX_CORES_PER_DEVICE


class TopologyKind(StrEnum):
    SINGLE = "single"
    CHAIN = "chain"
    RING = "ring"
    TORUS = "torus"
    SWITCH = "switch"


@dataclass(frozen=True, slots=True)
class Topology:
    instance_type: str
    kind: TopologyKind
    devices: int
    cores_per_device: int
    # Torus only: allowed request size -> the device sets (masks) a request of that size may get.
    groups: tuple[tuple[int, tuple[int, ...]], ...] = field(default=())
    # Derived once: allowed sets by size, and the hash (topologies key the allocator's caches,
    # and hashing every field on each lookup was the allocator's largest cost).
    _sets: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _allowed: tuple[int, ...] | None = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __post_init__(self) -> None:
        for what, value, most in (
            ("devices", self.devices, MAX_DEVICES),
            ("cores_per_device", self.cores_per_device, MAX_CORES_PER_DEVICE),
        ):
            name = self.instance_type
            if value < 1:
                raise ValueError(f"{name}: {what} must be at least 1, got {value}")
            if value > most:
                raise ValueError(f"{name}: {what} must be at most {most}, got {value}")
        if self.kind is TopologyKind.SINGLE and self.devices != 1:
            raise ValueError(f"{self.instance_type}: a single topology has exactly 1 device")
        for size, masks in self.groups:
            for mask in masks:
                if mask.bit_count() != size or mask >> self.devices:
                    raise ValueError(
                        f"{self.instance_type}: group {format_ids(mask_ids(mask))} is not a set "
                        f"of {size} devices within 0-{self.devices - 1}"
                    )
        allowed = None
        if self.kind is TopologyKind.TORUS:
            allowed = tuple(sorted({1, self.devices, *(size for size, _ in self.groups)}))
        object.__setattr__(self, "_allowed", allowed)
        object.__setattr__(
            self, "_sets", tuple(_device_sets(self, count) for count in range(self.devices + 1))
        )
        object.__setattr__(
            self,
            "_hash",
            hash((self.instance_type, self.kind, self.devices, self.cores_per_device, self.groups)),
        )

    @property
    def total_cores(self) -> int:
        return self.devices * self.cores_per_device

    @property
    def all_devices(self) -> int:
        return (1 << self.devices) - 1

    @property
    def allowed_device_counts(self) -> tuple[int, ...] | None:
        """Request sizes this topology accepts; None means any size from 1 to all devices."""
        return self._allowed

    def device_sets(self, count: int) -> tuple[int, ...]:
        """Every allowed device set of `count` devices, in a fixed order (lowest start first).

        A switch allows any set; those are not enumerated (see `allocation`), so this is empty.
        """
        return self._sets[count] if 0 <= count <= self.devices else ()

    def span_allowed(self, touched: int) -> bool:
        """Whether a core request may touch this set of devices (already contiguous by id)."""
        if self.kind is not TopologyKind.TORUS:
            return True
        size = touched.bit_count()
        for allowed in self.allowed_device_counts or ():
            if allowed >= size:
                return any(touched & mask == touched for mask in self.device_sets(allowed))
        return False

    def core_mask_of_devices(self, devices: int) -> int:
        """The global core ids (as a mask) owned by a set of devices."""
        return core_mask_of_devices(devices, self.cores_per_device)


def _device_sets(topology: Topology, count: int) -> tuple[int, ...]:
    n = topology.devices
    if count < 1 or count > n:
        return ()
    if count == n:
        return (topology.all_devices,)
    run = (1 << count) - 1
    kind = topology.kind
    if kind is TopologyKind.CHAIN:
        return tuple(run << start for start in range(n - count + 1))
    if kind is TopologyKind.RING:
        full = topology.all_devices
        return tuple(((run << start) | (run >> (n - start))) & full for start in range(n))
    if kind is TopologyKind.TORUS:
        if count == 1:
            return tuple(1 << d for d in range(n))
        return dict(topology.groups).get(count, ())
    return ()


def free_runs(topology: Topology, busy: int) -> list[tuple[int, int]]:
    """Maximal runs of free devices as (start, length), in id order; on a ring a run may wrap
    (it then starts near the end and its length counts the devices after the wrap)."""
    return list(_free_runs(topology, busy))


@lru_cache(maxsize=1 << 16)
def _free_runs(topology: Topology, busy: int) -> tuple[tuple[int, int], ...]:
    n = topology.devices
    runs: list[tuple[int, int]] = []
    start = -1
    for d in range(n + 1):
        free = d < n and not busy >> d & 1
        if free and start < 0:
            start = d
        elif not free and start >= 0:
            runs.append((start, d - start))
            start = -1
    if (
        topology.kind is TopologyKind.RING
        and len(runs) > 1
        and runs[0][0] == 0
        and runs[-1][0] + runs[-1][1] == n
    ):
        # The last run continues through the n-1 -> 0 link into the first.
        last_start, last_length = runs.pop()
        runs[0] = (last_start, last_length + runs[0][1])
    return tuple(runs)
