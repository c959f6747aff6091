"""Which pods' annotations disagree with what their containers really hold, and the annotations
that say what they hold. Pure.

A container can hold other ids than its pod's annotations say for these reasons, and the event
names which:
- kubelet admitted two pods of one size in another order than the device plugin expected (it
  could not ask kubelet which pod it was admitting), so each got the other's annotated ids;
- kubelet did not offer the annotated ids, and the device plugin gave a legal set of what it
  offered instead (it remembers why in `withheld`): a device among them failed (kubelet never
  offers an unhealthy device); or after a restart kubelet still counted the devices of pods
  deleted meanwhile as in use until it had read all its pods; or kubelet counted them as in use
  for another reason. Without that record (the plugin restarted since), a failed device among
  the annotated ids, or ids that no container kubelet lists holds, tell the same.
The sets stay disjoint, but the annotations describe the wrong ids: when a pod ends, the scheduler
would free ids another pod uses. kubelet's pod resources API names the pod and container behind
every id, so the annotations are rewritten from it: the scheduler always frees exactly what a
container held.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from neuron_scheduler.core import handoff as keys
from neuron_scheduler.core.ids import comma_ids, cores_of_devices, devices_of_cores, format_ids
from neuron_scheduler.core.resources import RESOURCE_UNITS, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.deviceplugin.admission import Withheld, WithheldCause
from neuron_scheduler.deviceplugin.holdings import ContainerIds, KubeletHoldings
from neuron_scheduler.deviceplugin.matching import app_slices, failed_among, unit_count
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
    # Pods kubelet lists whose start it has not recorded yet (not compared: the entry may be an
    # older pod's of that name): the next pass must look again, even if kubelet says the same.
    unstarted: int = 0


def _ids_text(unit: Unit, ids: Iterable[int]) -> str:
    ordered = sorted(ids)
    noun = unit.value if len(ordered) == 1 else f"{unit.value}s"
    return f"{noun} {format_ids(ordered) if ordered else 'none'}"


# (unit, id) -> "namespace/pod container" holding it, from kubelet's List.
Owners = dict[tuple[Unit, int], str]


def _owners(held: KubeletHoldings) -> Owners:
    owners: Owners = {}
    for (namespace, name), containers in held.pods.items():
        for container, resources in containers.items():
            for resource, ids in resources.items():
                unit = RESOURCE_UNITS.get(resource)
                if unit is not None:
                    for i in ids:
                        owners[(unit, i)] = f"{namespace}/{name} container {container}"
    return owners


NOT_OFFERED = "kubelet did not offer the annotated ids: "
HELD_THROUGH_ANOTHER = (
    "kubelet offered the annotated ids, but another pod's containers held them through another "
    "Neuron resource (kubelet keeps ids apart within one resource only)"
)


def review(
    pods: Iterable[Pod],
    held: KubeletHoldings,
    node: str,
    topology: Topology,
    withheld: Mapping[tuple[str, str], Withheld] | None = None,
    unhealthy: int = 0,
) -> Review:
    """Compare each live pod bound to `node` that carries our annotations with what kubelet says
    its containers hold. Pods kubelet has not (fully) allocated yet are left alone. `withheld`:
    (pod uid, container) the device plugin gave other ids because kubelet did not offer theirs;
    `unhealthy`: the devices (mask) the plugin reports failed now."""
    owners = _owners(held)
    corrections: list[Correction] = []
    problems: list[str] = []
    agreeing = unstarted = 0
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
        if not found.allocated and pod.status.startTime is None:
            # Neither handed ids by this plugin nor started by kubelet: what kubelet lists under
            # its name can be an older pod's of that name (a StatefulSet's replacement, bound
            # before kubelet has seen the old one go). List names no uid; a pod kubelet has
            # started has a startTime, so a lost allocated mark is still corrected.
            unstarted += 1
            continue
        outcome = _compare(pod, found, containers, topology, owners, withheld or {}, unhealthy)
        if isinstance(outcome, Correction):
            corrections.append(outcome)
        elif outcome is None:
            agreeing += 1
        elif outcome:
            problems.append(f"{pod.key}: {outcome}")
    return Review(tuple(corrections), agreeing, tuple(problems), unstarted)


def _compare(
    pod: Pod,
    found: keys.Assignment,
    containers: ContainerIds,
    topology: Topology,
    owners: Owners,
    withheld: Mapping[tuple[str, str], Withheld],
    unhealthy: int = 0,
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
    swapped: list[str] = []
    not_given: dict[str, list[str]] = {}  # why they were not given -> containers
    for name in real:
        wanted_ids = annotated.get(name, ())
        if set(real[name]) == set(wanted_ids):
            continue
        text = (
            f"container {name} holds {_ids_text(unit, real[name])}, not the annotated "
            f"{format_ids(sorted(wanted_ids)) or 'none'}"
        )
        record = withheld.get((pod.metadata.uid, name))
        others = sorted(
            {
                owners[(unit, i)]
                for i in wanted_ids
                if (unit, i) in owners and not owners[(unit, i)].startswith(f"{pod.key} ")
            }
        )
        failed = record.failed if record is not None else ()
        if record is None:
            failed = failed_among(unit, wanted_ids, unhealthy, topology.cores_per_device)
        if record is None and others and not failed:
            swapped.append(f"{text} (kubelet gave those to {', '.join(others)})")
            continue
        if record is not None and record.offered is not None:
            text += f" (kubelet offered {record.offered} of {record.total} {unit.value}s)"
        if failed:
            why = NOT_OFFERED + (
                f"device {format_ids(list(failed))} failed (the device plugin reports it "
                "unhealthy, and kubelet offers an unhealthy device to nobody)"
            )
        elif record is not None and record.cause is WithheldCause.IN_USE:
            why = NOT_OFFERED + "kubelet counted them as in use when it admitted this pod"
        elif record is not None and record.cause is WithheldCause.HELD_ELSEWHERE:
            why = HELD_THROUGH_ANOTHER
        else:
            why = NOT_OFFERED + (
                "it still counted them as in use (after a restart it holds the devices of pods "
                "deleted since its last allocation until it has admitted the pods it started "
                "with)"
            )
        not_given.setdefault(why, []).append(text)
    parts = [
        f"{why}; the device plugin gave a legal set of what it offered instead: {'; '.join(texts)}."
        for why, texts in not_given.items()
    ]
    if swapped:
        parts.append(
            "kubelet admitted this pod in another order than the device plugin expected: "
            f"{'; '.join(swapped)}."
        )
    message = f"{' '.join(parts)} The Neuron annotations now record what its containers hold."
    return Correction(pod, values, message)
