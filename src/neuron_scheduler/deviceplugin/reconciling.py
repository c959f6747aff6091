"""Which pods' annotations disagree with what their containers really hold, and the annotations
that say what they hold. Pure.

kubelet's Allocate carries no pod identity, so when two pods of one size wait on a node and
kubelet admits them in another order than the device plugin expected, each container gets the
other pod's annotated ids. The sets stay disjoint, but the annotations then describe the wrong
pod: when one pod ends, the scheduler would free the ids its neighbour still uses. kubelet's pod
resources API names the pod and container behind every id, so the annotations are rewritten from
it: the scheduler always frees exactly what a container held.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from neuron_scheduler.core import handoff as keys
from neuron_scheduler.core.ids import comma_ids, cores_of_devices, devices_of_cores, format_ids
from neuron_scheduler.core.resources import RESOURCE_UNITS, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.deviceplugin.holdings import ContainerIds, KubeletHoldings
from neuron_scheduler.deviceplugin.matching import app_slices, unit_count
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import assignment

CORRECTED = "NeuronIdsCorrected"  # the event's reason

# The keys a correction writes: the ids and the views derived from them, nothing else.
CORRECTED_KEYS = (keys.IDS, keys.CORES, keys.DEVS, keys.CONTAINER_IDS, keys.ALLOCATED)


@dataclass(frozen=True, slots=True)
class Correction:
    pod: Pod  # as read: its resourceVersion is the patch's precondition
    values: dict[str, str | None]  # our annotation keys, as the containers really hold
    message: str  # for the event on the pod


@dataclass(frozen=True, slots=True)
class Review:
    corrections: tuple[Correction, ...]
    agreeing: int  # pods whose annotations already say what their containers hold
    problems: tuple[str, ...]  # pods left alone, and why


def _ids_text(unit: Unit, ids: Iterable[int]) -> str:
    ordered = sorted(ids)
    noun = unit.value if len(ordered) == 1 else f"{unit.value}s"
    return f"{noun} {format_ids(ordered) if ordered else 'none'}"


def review(pods: Iterable[Pod], held: KubeletHoldings, node: str, topology: Topology) -> Review:
    """Compare each live pod bound to `node` that carries our annotations with what kubelet says
    its containers hold. Pods kubelet has not (fully) allocated yet are left alone."""
    corrections: list[Correction] = []
    problems: list[str] = []
    agreeing = 0
    for pod in pods:
        if pod.spec.nodeName != node or pod.finished or pod.metadata.deletionTimestamp:
            continue
        key = (pod.metadata.namespace, pod.metadata.name)
        if key in held.ambiguous:
            problems.append(f"{pod.key}: kubelet lists two pods of this name")
            continue
        containers = held.pods.get(key)
        if containers is None:
            continue  # not admitted yet
        try:
            found = assignment(pod, topology.cores_per_device)
        except keys.AnnotationError as error:
            problems.append(f"{pod.key}: {error}")
            continue
        if found is None:
            continue
        outcome = _compare(pod, found, containers, topology)
        if isinstance(outcome, Correction):
            corrections.append(outcome)
        elif outcome is None:
            agreeing += 1
        elif outcome:
            problems.append(f"{pod.key}: {outcome}")
    return Review(tuple(corrections), agreeing, tuple(problems))


def _compare(
    pod: Pod, found: keys.Assignment, containers: ContainerIds, topology: Topology
) -> Correction | str | None:
    """A correction; None when they agree; a reason (empty: nothing to say) when left alone."""
    unit = RESOURCE_UNITS[found.resource]
    names = {name for name, u in RESOURCE_UNITS.items() if u is unit}
    wanted = {c.name: unit_count(c, unit) for c in pod.spec.containers}
    wanted = {name: count for name, count in wanted.items() if count}
    if not wanted:
        return ""
    inits = max((unit_count(c, unit) for c in pod.spec.initContainers), default=0)
    if inits > sum(wanted.values()):
        # kubelet's List leaves out init containers: the ids only they hold cannot be seen.
        return "its init containers hold ids the pod resources API does not list"
    real: dict[str, tuple[int, ...]] = {}
    for name, count in wanted.items():
        ids = sorted({i for r in names for i in containers.get(name, {}).get(r, ())})
        if not ids:
            return ""  # kubelet has not allocated this container yet
        if len(ids) != count:
            return f"kubelet lists {len(ids)} {unit.value} ids for container {name}, not {count}"
        real[name] = tuple(ids)
    annotated = app_slices(pod, found)
    if all(set(real[name]) == set(annotated.get(name, ())) for name in real):
        return None
    union = sorted({i for ids in real.values() for i in ids})
    if len(union) != sum(len(ids) for ids in real.values()):
        return "kubelet lists the same id for two of its containers"
    if unit is Unit.CORE:
        cores, devices = tuple(union), devices_of_cores(union, topology.cores_per_device)
    else:
        devices, cores = tuple(union), cores_of_devices(union, topology.cores_per_device)
    held = keys.Assignment(found.node, found.resource, tuple(union), cores, devices, real, True)
    problem = keys.misfit(held, topology)
    if problem is not None:
        return f"kubelet's ids do not fit this node: {problem}"
    values: dict[str, str | None] = {
        keys.IDS: comma_ids(union),
        keys.CORES: comma_ids(cores),
        keys.DEVS: comma_ids(devices),
        keys.CONTAINER_IDS: json.dumps(
            {name: comma_ids(ids) for name, ids in real.items()}, separators=(",", ":")
        ),
        # kubelet holds ids for every Neuron container: the pod is allocated, whoever marked it.
        keys.ALLOCATED: "true",
    }
    changed = [
        f"container {name} holds {_ids_text(unit, real[name])}, not the annotated "
        f"{format_ids(sorted(annotated.get(name, ()))) or 'none'}"
        for name in real
        if set(real[name]) != set(annotated.get(name, ()))
    ]
    message = (
        f"kubelet admitted this pod in another order than the device plugin expected: "
        f"{'; '.join(changed)}. The Neuron annotations now record what its containers hold."
    )
    return Correction(pod, values, message)
