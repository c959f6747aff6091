"""What a DRA node is, for the driver that publishes its pool and for the extender that reads it
back. Pure.

The driver resolves its node's topology from the instance-type label and the devices it finds
(`node_topology`). The extender sees the same node through the pool's counter slice: one counter
per device (`slices.counter_name`), each worth the device's logical cores (`pool_size`), plus
the Node's label; so it resolves the same topology without reading the devices' attributes (a
pool's device slices are most of its bytes: of their devices only the taints are decoded, which
name the node's failed devices, `failed_devices`).
"""

from __future__ import annotations

import msgspec

from neuron_scheduler.core.catalog import CapacityError, Catalog
from neuron_scheduler.core.health import tainted_device, unhealthy_taint_key
from neuron_scheduler.core.topology import MAX_CORES_PER_DEVICE, MAX_DEVICES, Topology
from neuron_scheduler.dra.slices import (
    COUNTER_SET_PREFIX,
    MAX_DEVICES_PER_SLICE,
    MAX_TAINTS_PER_DEVICE,
)


def node_topology(
    catalog: Catalog, instance_type: str, devices: int, cores: int
) -> tuple[Topology, str | None]:
    """The node's topology from its label and its devices; a warning when they disagree (the
    devices win: they are what kubelet will hand out)."""
    try:
        resolved = catalog.resolve(instance_type, devices, devices * cores)
    except CapacityError as error:
        resolved = catalog.resolve("", devices, devices * cores)
        return resolved.topology, (
            f"{instance_type or 'no instance type'}: {error}; treating the {devices} devices "
            "found as a chain"
        )
    return resolved.topology, resolved.warning


class _Counter(msgspec.Struct):
    value: str = ""


class CounterSet(msgspec.Struct):
    name: str = ""
    counters: dict[str, _Counter] = {}


class _Pool(msgspec.Struct):
    name: str = ""
    generation: int = 0


class _Taint(msgspec.Struct):
    key: str = ""
    value: str = ""


class _Device(msgspec.Struct):
    taints: list[_Taint] = []  # (nothing else of a device is decoded)


class _SliceSpec(msgspec.Struct):
    driver: str = ""
    nodeName: str = ""
    pool: _Pool = msgspec.field(default_factory=_Pool)
    sharedCounters: list[CounterSet] = []
    devices: list[_Device] = []


class _SliceMeta(msgspec.Struct):
    name: str = ""


class PoolSlice(msgspec.Struct):
    """A ResourceSlice as the extender reads it: which pool, and its counters if any."""

    metadata: _SliceMeta = msgspec.field(default_factory=_SliceMeta)
    spec: _SliceSpec = msgspec.field(default_factory=_SliceSpec)


def pool_size(counter_sets: list[CounterSet]) -> tuple[int, int] | None:
    """(devices, logical cores per device) from a pool's counter sets; None when they are not
    ones this driver writes (untrusted: the numbers are bounded as a Node's capacity is)."""
    devices: set[int] = set()
    worth: set[str] = set()
    for counter_set in counter_sets[:16]:
        if not counter_set.name.startswith(COUNTER_SET_PREFIX):
            continue
        for name, counter in list(counter_set.counters.items())[: MAX_DEVICES + 1]:
            if not name.startswith("d") or not name[1:].isdigit() or len(name) > 4:
                return None
            devices.add(int(name[1:]))
            worth.add(counter.value)
    if not devices or devices != set(range(len(devices))) or len(devices) > MAX_DEVICES:
        return None
    if len(worth) != 1:
        return None
    (value,) = worth
    if not value.isdigit() or not 1 <= int(value) <= MAX_CORES_PER_DEVICE:
        return None
    return len(devices), int(value)


def failed_devices(item: PoolSlice, driver: str) -> int:
    """The failed devices (mask) a device slice's unhealthy taints name: each one taints every
    published device holding it, so kube-scheduler never allocates those (dra/slices)."""
    key = unhealthy_taint_key(driver)
    failed = 0
    for device in item.spec.devices[:MAX_DEVICES_PER_SLICE]:
        for taint in device.taints[:MAX_TAINTS_PER_DEVICE]:
            index = tainted_device(taint.value) if taint.key == key else None
            if index is not None:
                failed |= 1 << index
    return failed
