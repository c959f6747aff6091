"""Reading simulator inputs: a fleet file and a workload file (YAML).

Fleet:
    nodes:
      - {instance_type: inf2.48xlarge, count: 3}
      - {instance_type: trn2.48xlarge, count: 2, neuroncore_capacity: 128, name_prefix: lnc1-}

Workload, either generated:
    generate: {pods: 600, seed: 7, mean_interarrival: 1.0, mean_lifetime: 90,
               mix: [{resource: neuroncore, sizes: [1, 2, 4], weight: 1},
                     {resource: neuron, sizes: [4, 8], weight: 0.2, priority: 1000}]}
or listed (times in any unit; `duration` is how long the pod runs once placed, omitted: until the
end):
    pods:
      - {name: a, resource: neuron, count: 3, arrive: 0, duration: 50}
      - {name: b, resource: neuron, count: 4, arrive: 9, priority: 1000}
`priority` is a PriorityClass value (default 0): a pod that fits nowhere may evict pods of lower
priority (sim/preemption.py says how).
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NeuronRequest, RequestError, resource_name
from neuron_scheduler.core.yamlfile import read_yaml
from neuron_scheduler.sim.simulation import NodeSpec, PodEvent
from neuron_scheduler.sim.workloads import DEFAULT_MIX, PodMix, generate_workload


class ScenarioError(ValueError):
    """A fleet or workload file that cannot be used; the message names the file and the field."""


class _NodeGroup(msgspec.Struct, forbid_unknown_fields=True):
    instance_type: str
    count: int = 1
    name_prefix: str | None = None
    neuroncore_capacity: int | None = None


class _Fleet(msgspec.Struct, forbid_unknown_fields=True):
    nodes: list[_NodeGroup]


class _Mix(msgspec.Struct, forbid_unknown_fields=True):
    resource: str
    sizes: list[int]
    weight: float = 1.0
    priority: int = 0


class _Generate(msgspec.Struct, forbid_unknown_fields=True):
    pods: int = 600
    seed: int = 7
    mean_interarrival: float = 1.0
    mean_lifetime: float = 90.0
    mix: list[_Mix] | None = None


class _Pod(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    resource: str
    count: int
    arrive: float = 0.0
    duration: float | None = None
    priority: int = 0


class _Workload(msgspec.Struct, forbid_unknown_fields=True):
    generate: _Generate | None = None
    pods: list[_Pod] | None = None


T = TypeVar("T")


def _decode(path: Path, kind: type[T]) -> T:
    return read_yaml(path, kind, ScenarioError)


def load_fleet(path: Path, catalog: Catalog) -> list[NodeSpec]:
    fleet = _decode(path, _Fleet)
    specs: list[NodeSpec] = []
    for index, group in enumerate(fleet.nodes):
        where = f"{path}: nodes[{index}]"
        if not catalog.knows(group.instance_type):
            raise ScenarioError(
                f"{where}: unknown instance type {group.instance_type!r} "
                "(add it with --topology-file)"
            )
        if group.count < 1:
            raise ScenarioError(f"{where}: count must be at least 1, got {group.count}")
        if group.neuroncore_capacity is not None and group.neuroncore_capacity < 1:
            raise ScenarioError(f"{where}: neuroncore_capacity must be at least 1")
        prefix = group.name_prefix or group.instance_type.replace(".", "-") + "-"
        specs.extend(
            NodeSpec(f"{prefix}{i}", group.instance_type, group.neuroncore_capacity)
            for i in range(group.count)
        )
    if not specs:
        raise ScenarioError(f"{path}: the fleet has no nodes")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{path}: node names repeat; give each group its own name_prefix")
    return specs


def load_workload(path: Path, seed: int | None = None) -> list[PodEvent]:
    workload = _decode(path, _Workload)
    if (workload.generate is None) == (workload.pods is None):
        raise ScenarioError(f"{path}: give exactly one of `generate` or `pods`")
    try:
        if workload.generate is not None:
            g = workload.generate
            if g.pods < 0 or g.mean_interarrival <= 0 or g.mean_lifetime <= 0:
                raise ScenarioError(
                    f"{path}: generate: pods must be >= 0 and the means must be positive"
                )
            mix: tuple[PodMix, ...] = DEFAULT_MIX
            if g.mix:
                mix = tuple(
                    PodMix(
                        resource_name(m.resource),
                        tuple(_positive(m.sizes, path)),
                        m.weight,
                        _priority(m.priority, path),
                    )
                    for m in g.mix
                )
            return generate_workload(
                g.pods, g.seed if seed is None else seed, g.mean_interarrival, g.mean_lifetime, mix
            )
        events: list[PodEvent] = []
        for pod in workload.pods or []:
            request = NeuronRequest(resource_name(pod.resource), pod.count)
            if pod.duration is not None and pod.duration < 0:
                raise ScenarioError(f"{path}: pod {pod.name}: duration must be >= 0")
            priority = _priority(pod.priority, path)
            events.append(PodEvent(pod.arrive, pod.name, request, priority, pod.duration))
    except RequestError as error:
        raise ScenarioError(f"{path}: {error}") from error
    names = [e.pod for e in events]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{path}: pod names repeat; each pod needs its own name")
    events.sort(key=lambda e: (e.time, e.pod))
    return events


def _priority(value: int, path: Path) -> int:
    # PriorityClass values are 32-bit; above 1e9 is reserved for system classes but allowed.
    if not -(2**31) <= value < 2**31:
        raise ScenarioError(f"{path}: priority {value} is outside a 32-bit integer")
    return value


def _positive(sizes: list[int], path: Path) -> list[int]:
    if not sizes or any(size < 1 for size in sizes):
        raise ScenarioError(f"{path}: mix sizes must be a non-empty list of counts >= 1")
    return sizes
