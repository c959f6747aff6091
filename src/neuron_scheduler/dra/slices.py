"""A node's ResourceSlices: one counter slice and device slices holding every published shape,
each consuming the counters of what it takes. Pure.

Counters: one per physical Neuron device (`d<i>`, worth the device's logical cores), and, when
core windows are published, one per core (`c<j>`, worth 1). A device set takes all of each of its
devices' counters; a core window takes, on each device it touches, as much as it takes cores
there, and each of its cores' counters. So the scheduler's allocator can never hand out two
shapes that share a core: two device sets share a device's whole counter, a device set and a core
window overdraw a device's counter, two core windows share a core's counter.

Slices are named so that name order is the order of `published_shapes` (the allocator sorts a
pool's slices by name and walks each slice's devices in order), and split within
resource.k8s.io/v1's limits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from neuron_scheduler.core.health import unhealthy_taint_key
from neuron_scheduler.core.ids import comma_ids, mask_ids
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra.devicegroups import group_attributes
from neuron_scheduler.dra.shapes import (
    CORE_SET_SIZE,
    CoreWindows,
    Shape,
    ShapeKind,
    published_shapes,
)

# resource.k8s.io/v1 limits (k8s.io/api v0.36.3 resource/v1/types.go).
MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_COUNTERS = 64  # also with taints
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMPTIONS_PER_DEVICE = 2
MAX_COUNTERS_PER_CONSUMPTION = 32
MAX_ATTRIBUTES_PER_DEVICE = 32
MAX_ATTRIBUTE_VALUE_LENGTH = 64
MAX_TAINTS_PER_DEVICE = 16
MAX_NAME_LENGTH = 253
# Named by the KEP and the 1.34/1.35 API docs; 1.36.3 no longer validates it. Kept, so slices
# stay valid on the older servers too.
MAX_CONSUMED_COUNTERS_PER_SLICE = 2048

COUNTER_SET_PREFIX = "neuron-devices"
CORE_COUNTER_SET_PREFIX = "neuron-cores"
SPEC_HASH_ANNOTATION = "neuron-scheduler.io/spec-hash"

JSON = dict[str, Any]


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """What the driver publishes for its node."""

    node: str
    topology: Topology
    # EFA BDF paired with each device id, on nodes that have EFA devices (AWS's group ids).
    efa_pairing: tuple[str, ...] | None = None
    # Unhealthy device id -> a short reason: every shape holding it gets a NoSchedule taint.
    unhealthy: Mapping[int, str] = field(default_factory=dict)
    # The counts of cores windows are published for beside the device sets (none: no windows).
    core_windows: CoreWindows = ()

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return published_shapes(self.topology, self.core_windows)


@dataclass(frozen=True, slots=True)
class SliceContent:
    """One slice of the pool, without the pool's generation and slice count."""

    name: str
    shared_counters: tuple[JSON, ...] = ()
    devices: tuple[JSON, ...] = ()

    def spec(self, driver: str, node: str, generation: int, count: int) -> JSON:
        spec: JSON = {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
        }
        # A slice has counters or devices, never both; an absent list, not an empty one.
        if self.shared_counters:
            spec["sharedCounters"] = list(self.shared_counters)
        else:
            spec["devices"] = list(self.devices)
        return spec

    @property
    def fingerprint(self) -> str:
        """Changes whenever the content does (the API server's defaults do not count)."""
        text = repr((self.name, self.shared_counters, self.devices)).encode()
        return hashlib.sha256(text).hexdigest()[:16]


def counter_set_name(device: int) -> str:
    return f"{COUNTER_SET_PREFIX}-{device // MAX_COUNTERS_PER_SET}"


def counter_name(device: int) -> str:
    return f"d{device}"


def core_counter_set_name(core: int) -> str:
    return f"{CORE_COUNTER_SET_PREFIX}-{core // CORE_SET_SIZE}"


def core_counter_name(core: int) -> str:
    return f"c{core}"


def slice_prefix(driver: str, node: str) -> str:
    """Slice names start with this; long node names are shortened with a hash to stay unique."""
    prefix = f"{node}-{driver}"
    room = MAX_NAME_LENGTH - len("-devices-000") - 17
    if len(prefix) > room:
        digest = hashlib.sha256(prefix.encode()).hexdigest()[:16]
        prefix = f"{prefix[:room].rstrip('.-')}-{digest}"
    return prefix


def pool_slices(driver: str, inventory: NodeInventory) -> list[SliceContent]:
    """The node's slices in name order: the counter slice, then device slices in shape order."""
    topology = inventory.topology
    shapes = inventory.shapes
    prefix = slice_prefix(driver, inventory.node)
    # One shape alone (a one-device node without core windows) can overlap nothing.
    counted = len(shapes) > 1
    slices: list[SliceContent] = []
    if counted:
        with_cores = any(s.kind is ShapeKind.CORES for s in shapes)
        slices.append(
            SliceContent(f"{prefix}-counters", shared_counters=_counter_sets(topology, with_cores))
        )
    limit = MAX_DEVICES_PER_SLICE_WITH_COUNTERS if counted else MAX_DEVICES_PER_SLICE
    if inventory.unhealthy:
        limit = MAX_DEVICES_PER_SLICE_WITH_COUNTERS
    batch: list[JSON] = []
    consumed = 0
    for shape in shapes:
        device = _device(driver, inventory, shape, counted)
        draws = _counters_drawn(shape) if counted else 0
        if batch and (len(batch) >= limit or consumed + draws > MAX_CONSUMED_COUNTERS_PER_SLICE):
            slices.append(SliceContent(f"{prefix}-devices-{len(slices):03d}", devices=tuple(batch)))
            batch, consumed = [], 0
        batch.append(device)
        consumed += draws
    if batch:
        slices.append(SliceContent(f"{prefix}-devices-{len(slices):03d}", devices=tuple(batch)))
    return slices


def _counters_drawn(shape: Shape) -> int:
    if shape.kind is ShapeKind.CORES:
        return len(shape.members) + shape.count
    return len(shape.members)


def id_text(ids: Sequence[int]) -> str:
    """`11,0,1`, in the order given; when that is longer than an attribute may be (nodes beyond
    the catalog's), runs of consecutive ids become ranges: `54-63,0-11`."""
    plain = comma_ids(ids)
    if len(plain) <= MAX_ATTRIBUTE_VALUE_LENGTH:
        return plain
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _counter_sets(topology: Topology, with_cores: bool) -> tuple[JSON, ...]:
    sets: dict[str, JSON] = {}
    worth = {"value": str(topology.cores_per_device)}
    for d in range(topology.devices):
        sets.setdefault(counter_set_name(d), {})[counter_name(d)] = worth
    if with_cores:
        for c in range(topology.total_cores):
            sets.setdefault(core_counter_set_name(c), {})[core_counter_name(c)] = {"value": "1"}
    return tuple({"name": name, "counters": counters} for name, counters in sets.items())


def _consumption(topology: Topology, shape: Shape) -> list[JSON]:
    consumes: dict[str, JSON] = {}
    per_device = topology.cores_per_device
    for d in shape.members:
        taken = (shape.core_mask >> (d * per_device)) & ((1 << per_device) - 1)
        consumes.setdefault(counter_set_name(d), {})[counter_name(d)] = {
            "value": str(taken.bit_count())
        }
    if shape.kind is ShapeKind.CORES:
        for c in mask_ids(shape.core_mask):
            consumes.setdefault(core_counter_set_name(c), {})[core_counter_name(c)] = {"value": "1"}
    return [{"counterSet": name, "counters": counters} for name, counters in consumes.items()]


def _device(driver: str, inventory: NodeInventory, shape: Shape, counted: bool) -> JSON:
    topology = inventory.topology
    attributes: JSON = {
        "size": {"int": shape.size},
        "shape": {"string": shape.kind.value},
        "members": {"string": id_text(shape.members)},
        "deviceIds": {"string": id_text(shape.device_ids)},
        "instanceType": {"string": topology.instance_type[:MAX_ATTRIBUTE_VALUE_LENGTH]},
        "topology": {"string": topology.kind.value},
        "coresPerDevice": {"int": topology.cores_per_device},
    }
    if shape.kind is ShapeKind.SINGLE:
        # AWS's driver's name for the same thing, so its per-device CEL selectors read the same.
        attributes["deviceId"] = {"int": shape.members[0]}
    if shape.kind is ShapeKind.CORES:
        attributes["cores"] = {"int": shape.count}
        attributes["coreIds"] = {"string": id_text(shape.cores)}
    if inventory.efa_pairing:
        for name, value in group_attributes(inventory.efa_pairing, shape.members).items():
            attributes[name] = {"string": value}
    device: JSON = {"name": shape.name, "attributes": attributes}
    if counted:
        device["consumesCounters"] = _consumption(topology, shape)
    sick = [d for d in shape.device_ids if d in inventory.unhealthy]
    if sick:
        device["taints"] = [
            {
                "key": unhealthy_taint_key(driver),
                "value": f"neuron{sick[0]}",
                "effect": "NoSchedule",
            }
        ]
    return device


def limit_problems(slices: Sequence[SliceContent]) -> list[str]:
    """Every way these slices break resource.k8s.io/v1's limits (empty: they are valid)."""
    problems: list[str] = []
    set_names = {s["name"] for c in slices for s in c.shared_counters}
    counters = {
        (s["name"], counter) for c in slices for s in c.shared_counters for counter in s["counters"]
    }
    names: set[str] = set()
    for content in slices:
        where = content.name
        if len(where) > MAX_NAME_LENGTH:
            problems.append(f"{where}: name longer than {MAX_NAME_LENGTH}")
        if content.shared_counters and content.devices:
            problems.append(f"{where}: both counters and devices")
        if len(content.shared_counters) > MAX_COUNTER_SETS_PER_SLICE:
            problems.append(f"{where}: {len(content.shared_counters)} counter sets")
        for counter_set in content.shared_counters:
            if len(counter_set["counters"]) > MAX_COUNTERS_PER_SET:
                problems.append(f"{where}: {len(counter_set['counters'])} counters in a set")
        advanced = any("consumesCounters" in d or "taints" in d for d in content.devices)
        most = MAX_DEVICES_PER_SLICE_WITH_COUNTERS if advanced else MAX_DEVICES_PER_SLICE
        if len(content.devices) > most:
            problems.append(f"{where}: {len(content.devices)} devices (at most {most})")
        consumed = 0
        for device in content.devices:
            name = device["name"]
            if name in names:
                problems.append(f"{where}: device {name} published twice")
            names.add(name)
            if len(name) > 63:
                problems.append(f"{where}: device name {name} longer than 63")
            attributes = device["attributes"]
            if len(attributes) > MAX_ATTRIBUTES_PER_DEVICE:
                problems.append(f"{where}/{name}: {len(attributes)} attributes")
            for key, value in attributes.items():
                text = value.get("string")
                if text is not None and len(text) > MAX_ATTRIBUTE_VALUE_LENGTH:
                    problems.append(f"{where}/{name}: attribute {key} longer than 64")
            consumptions = device.get("consumesCounters", [])
            if len(consumptions) > MAX_CONSUMPTIONS_PER_DEVICE:
                problems.append(f"{where}/{name}: {len(consumptions)} counter consumptions")
            for consumption in consumptions:
                if consumption["counterSet"] not in set_names:
                    problems.append(f"{where}/{name}: unknown counter set")
                if len(consumption["counters"]) > MAX_COUNTERS_PER_CONSUMPTION:
                    problems.append(f"{where}/{name}: {len(consumption['counters'])} counters")
                for counter in consumption["counters"]:
                    if (consumption["counterSet"], counter) not in counters:
                        problems.append(f"{where}/{name}: unknown counter {counter}")
                consumed += len(consumption["counters"])
            if len(device.get("taints", [])) > MAX_TAINTS_PER_DEVICE:
                problems.append(f"{where}/{name}: too many taints")
        if consumed > MAX_CONSUMED_COUNTERS_PER_SLICE:
            problems.append(f"{where}: {consumed} consumed counters")
    return problems
