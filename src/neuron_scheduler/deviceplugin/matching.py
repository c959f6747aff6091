"""Which pod kubelet is asking for, and which ids to steer it to. Pure.

kubelet's Allocate and GetPreferredAllocation carry device ids and nothing about the pod. A
preference is the annotated slice of the container kubelet is admitting (`admission`: what its pod
resources say, else its own order). An allocation is matched by the ids themselves: to the
container whose annotated slice is exactly those ids, never to "the oldest pending pod of that
size". Other ids are accepted for the container kubelet is known to be admitting when they are
legal and no other pod's (kubelet did not offer its annotated ids), and for a pod placed without
us when they obey the node's topology rule and touch no core the scheduler gave to another pod.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from neuron_scheduler.core import handoff as keys
from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    allocate,
    is_valid_core_set,
    is_valid_device_set,
)
from neuron_scheduler.core.ids import (
    core_mask_of_devices,
    devices_of_cores,
    format_ids,
    ids_mask,
    mask_ids,
)
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.quantity import whole_quantity
from neuron_scheduler.core.resources import (
    NEURON,
    NEURONCORE,
    RESOURCE_UNITS,
    NeuronRequest,
    RequestError,
    Unit,
)
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.deviceplugin.admission import (
    UNREAD,
    Arrival,
    KubeletView,
    OrderKey,
    Stage,
    arrival,
)
from neuron_scheduler.kube.objects import Container, Pod
from neuron_scheduler.kube.reading import assignment, held_request, neuron_request

log = logging.getLogger(__name__)

# The containers of a multi-container pod that kubelet has already been given their slice,
# comma-separated. NEURON_ALLOCATED turns "true" once all of them are.
ALLOCATED_CONTAINERS = keys.ALLOCATED_CONTAINERS
SCHEDULER_HINT = (
    "Pods that use Neuron devices must be placed by the neuron scheduler: set "
    "`schedulerName: my-scheduler` in the pod spec"
)


@dataclass(frozen=True, slots=True)
class Slot:
    """One container's share of a pod's assignment, in the pod's unit."""

    pod: str  # namespace/name
    uid: str
    container: str
    ids: tuple[int, ...]
    allocated: bool
    arrival: Arrival  # what kubelet's admission order is made of
    position: int  # among the pod's Neuron containers, init containers first
    init: bool

    @property
    def name_key(self) -> tuple[str, str]:
        """(namespace, name): how kubelet's pod resources name its pod."""
        return (self.arrival.namespace, self.arrival.name)

    def order(self, unit: Unit, kubelet: KubeletView) -> OrderKey:
        """Among candidates, the one kubelet admits first; stable across calls."""
        return kubelet.order(self.arrival, self.uid, self.container, self.position, self.init, unit)

    def stage(self, unit: Unit, kubelet: KubeletView) -> Stage:
        return kubelet.stage(self.arrival, self.container, self.init, unit)


@dataclass(frozen=True, slots=True)
class AnnotatedPod:
    """What the scheduler gave one live pod on this node."""

    pod: str
    uid: str
    unit: Unit
    core_mask: int
    pending: bool  # not (fully) allocated and not being deleted
    slots: tuple[Slot, ...]
    allocated_containers: frozenset[str]

    @property
    def slot_names(self) -> frozenset[str]:
        return frozenset(s.container for s in self.slots)


@dataclass(frozen=True, slots=True)
class NodeView:
    holdings: tuple[AnnotatedPod, ...]
    unreadable: tuple[str, ...] = ()  # "pod: why", pods whose annotations cannot be used

    def slots(self, unit: Unit) -> Iterator[tuple[Slot, AnnotatedPod]]:
        """Every container's slice in `unit`, with its pod."""
        for holding in self.holdings:
            if holding.unit is unit:
                for slot in holding.slots:
                    yield slot, holding


@dataclass(frozen=True, slots=True)
class Matched:
    slot: Slot
    holding: AnnotatedPod
    again: bool  # the slot was handed out before: kubelet is retrying for the same pod
    # kubelet gives the container it is admitting other ids than its annotated ones: it did not
    # offer those (it still counts them as in use).
    substitute: bool = False


@dataclass(frozen=True, slots=True)
class Unclaimed:
    """Ids that match no pod's slice but are safe to hand out (a pod placed without us)."""

    note: str


@dataclass(frozen=True, slots=True)
class Rejected:
    message: str


Match = Matched | Unclaimed | Rejected


def cores_of(unit: Unit, ids: Iterable[int], cores_per_device: int) -> int:
    """The cores (mask) that ids in `unit` stand for."""
    if unit is Unit.CORE:
        return ids_mask(ids)
    return core_mask_of_devices(ids_mask(ids), cores_per_device)


def kubelet_ids(values: Sequence[str]) -> tuple[int, ...] | None:
    """kubelet's string ids as ints; None if any is not one of ours."""
    try:
        ids = tuple(int(v) for v in values)
    except ValueError:
        return None
    return ids if all(i >= 0 for i in ids) and len(set(ids)) == len(ids) else None


def unit_count(container: Container, unit: Unit) -> int:
    """How many ids of `unit` the container asks for."""
    merged = {**container.resources.requests, **container.resources.limits}
    total = 0
    for name, value in merged.items():
        if RESOURCE_UNITS.get(name) is unit:
            try:
                total += whole_quantity(value, name)
            except RequestError:
                continue
    return total


def _slots(pod: Pod, found: keys.Assignment, done: frozenset[str]) -> tuple[Slot, ...]:
    unit = RESOURCE_UNITS[found.resource]
    came = arrival(pod, _alloc_time(pod))
    shares: list[tuple[str, tuple[int, ...], bool]] = []
    # kubelet admits init containers first, each with the pod's first ids (the app containers
    # then reuse them); the extender records only app containers.
    for container in pod.spec.initContainers:
        count = unit_count(container, unit)
        if count and container.name not in found.containers:
            shares.append((container.name, found.ids[:count], True))
    shares.extend((name, ids, False) for name, ids in app_slices(pod, found).items())
    return tuple(
        Slot(
            pod.key,
            pod.metadata.uid,
            name,
            ids,
            found.allocated or name in done,
            came,
            position,
            init,
        )
        for position, (name, ids, init) in enumerate(shares)
        if ids
    )


def app_slices(pod: Pod, found: keys.Assignment) -> dict[str, tuple[int, ...]]:
    """Each app container's annotated slice of the pod's ids (init containers reuse them)."""
    if found.containers:
        return dict(found.containers)
    return dict(_split_without_record(pod, found, RESOURCE_UNITS[found.resource]))


def _split_without_record(
    pod: Pod, found: keys.Assignment, unit: Unit
) -> list[tuple[str, tuple[int, ...]]]:
    # Annotated by the upstream extension (no per-container record): split the ids the way the
    # extender would have, by each container's count in container order.
    try:
        request = neuron_request(pod)
    except RequestError:
        request = None
    if request is not None and request.unit is unit:
        split = keys.split_per_container(found.ids, request, pod.container_names)
        if split:
            return list(split.items())
    users = [c.name for c in pod.spec.containers if unit_count(c, unit)]
    return [(users[0] if users else "", found.ids)]


def _alloc_time(pod: Pod) -> int:
    try:
        return int(pod.metadata.annotations.get(keys.ALLOC_TIME, "0"))
    except ValueError:
        return 0


def node_view(pods: Iterable[Pod], node: str, topology: Topology) -> NodeView:
    """The scheduler's assignments on this node, from the pods bound to it. Ids that cannot be
    this node's (beyond its devices or cores, more than it has, ids and cores that disagree) or
    this pod's (more than it asks for) are never handed out: the pod is listed as unreadable
    instead, as any pod's annotations may say anything."""
    holdings: list[AnnotatedPod] = []
    unreadable: list[str] = []
    for pod in pods:
        if pod.spec.nodeName != node or pod.finished:
            continue
        try:
            found = assignment(pod, topology.cores_per_device)
            problem = keys.misfit(found, topology) if found is not None else None
            if found is not None and problem is None:
                problem = _beyond_request(pod, found)
        except keys.AnnotationError as error:
            found, problem = None, str(error)
        if problem is not None:
            unreadable.append(f"{pod.key}: {problem}")
            continue
        if found is None:
            continue
        terminating = pod.metadata.deletionTimestamp is not None
        if terminating and not found.allocated:
            continue  # never admitted, never will be: its ids are nobody's
        raw = pod.metadata.annotations.get(ALLOCATED_CONTAINERS, "")
        done = frozenset(name for name in raw.split(",") if name)
        unit = RESOURCE_UNITS[found.resource]
        holdings.append(
            AnnotatedPod(
                pod.key,
                pod.metadata.uid,
                unit,
                found.core_mask,
                not found.allocated and not terminating,
                _slots(pod, found, done),
                done,
            )
        )
    return NodeView(tuple(holdings), tuple(unreadable))


def _beyond_request(pod: Pod, found: keys.Assignment) -> str | None:
    """Why the pod's ids are more than it asks for (its creator may write any), or None."""
    try:
        request = held_request(pod)
    except RequestError as error:
        return str(error)
    if request is None:
        return "ids on a pod that requests no Neuron resource"
    return keys.beyond_request(found, request)


def _ids_text(unit: Unit, ids: Iterable[int]) -> str:
    ordered = sorted(ids)
    noun = unit.value if len(ordered) == 1 else f"{unit.value}s"
    return f"{noun} {format_ids(ordered)}"


def obeys_topology(topology: Topology, unit: Unit, ids: Sequence[int]) -> bool:
    if unit is Unit.CORE:
        return is_valid_core_set(topology, list(ids))
    return is_valid_device_set(topology, list(ids))


def decide_allocation(
    view: NodeView,
    unit: Unit,
    ids: Sequence[int],
    cores_per_device: int,
    topology: Topology,
    handed_out: frozenset[tuple[str, str]] = frozenset(),
    kubelet: KubeletView = UNREAD,
    unhealthy: int = 0,
    resource: str | None = None,
) -> Match:
    """Whose container kubelet's `ids` (of `resource`; default: the unit's first) are for.

    handed_out: (pod uid, container) pairs this process gave ids to but whose annotation may not
    show it yet (the patch failed or is in flight); unhealthy: devices (mask) this plugin
    reports failed, named when they are why a pod cannot get its ids.

    Whatever the match, ids whose cores kubelet's pod resources show held already are refused
    (but those the matched pod holds through `resource`): kubelet keeps ids apart within one
    resource only, so a `neuron` pod can be offered the device whose cores a `neuroncore` pod
    placed without the scheduler runs on, or the device a `neuron` pod holds through
    `neurondevice`.
    """
    resource = resource or resource_of(unit)
    decision = _match(
        view, unit, ids, cores_per_device, topology, handed_out, kubelet, unhealthy, resource
    )
    if isinstance(decision, Rejected):
        return decision
    slot = decision.slot if isinstance(decision, Matched) else None
    mask = cores_of(unit, ids, cores_per_device)
    held = kubelet.holders(slot.name_key if slot else None, cores_per_device, resource)
    holders = [(owner, cores & mask) for owner, cores in sorted(held.items()) if cores & mask]
    if not holders:
        return decision
    owners = "; ".join(
        f"{loggable(owner)} holds {_ids_text(Unit.CORE, mask_ids(cores))}"
        for owner, cores in holders[:3]
    )
    whom = (
        f"pod {slot.pod} container {slot.container}"
        if slot is not None
        else "a container no pod's assignment names"
    )
    return Rejected(
        f"kubelet offered {_ids_text(unit, ids)} of {resource} to {whom}, but kubelet's pod "
        f"resources show them held already ({owners}). kubelet keeps ids apart within one "
        "Neuron resource only, so it cannot see that these are the same cores; the neuron "
        "scheduler's annotations keep the pods it places apart, but not a pod placed without "
        f"it. {SCHEDULER_HINT}; the pod can run once the scheduler places it again (delete it; "
        "its controller recreates it)."
    )


def resource_of(unit: Unit) -> str:
    """The resource kubelet asks through when the caller does not say: the unit's first."""
    return NEURONCORE if unit is Unit.CORE else NEURON


def held_elsewhere(
    kubelet: KubeletView,
    slot: Slot | None,
    cores_per_device: int,
    resource: str,
    *,
    across: bool = False,
) -> int:
    """The cores (mask) kubelet's pod resources show in the containers of pods other than the
    slot's (of every pod without one): KubeletView.holders, together."""
    pod = slot.name_key if slot is not None else None
    mask = 0
    for cores in kubelet.holders(pod, cores_per_device, resource, across=across).values():
        mask |= cores
    return mask


def _match(
    view: NodeView,
    unit: Unit,
    ids: Sequence[int],
    cores_per_device: int,
    topology: Topology,
    handed_out: frozenset[tuple[str, str]],
    kubelet: KubeletView,
    unhealthy: int,
    resource: str,
) -> Match:
    """Whose container `ids` are for, by the annotations and kubelet's admission."""
    wanted = set(ids)
    exact = [(slot, holding) for slot, holding in view.slots(unit) if set(slot.ids) == wanted]

    def fresh(item: tuple[Slot, AnnotatedPod]) -> bool:
        slot, holding = item
        return (
            holding.pending and not slot.allocated and (slot.uid, slot.container) not in handed_out
        )

    def first(item: tuple[Slot, AnnotatedPod]) -> OrderKey:
        return item[0].order(unit, kubelet)

    waiting = sorted((item for item in exact if fresh(item)), key=first)
    if waiting:
        slot, holding = waiting[0]
        if len({s.uid for s, _ in waiting}) > 1:
            log.warning(
                "%s are annotated for more than one pending pod (%s); giving them to %s",
                _ids_text(unit, ids),
                ", ".join(sorted({loggable(s.pod) for s, _ in waiting})),
                loggable(slot.pod),
            )
        return Matched(slot, holding, again=False)
    if exact:
        slot, holding = min(exact, key=first)
        return Matched(slot, holding, again=True)
    partial = _in_progress(view, unit, wanted, handed_out, kubelet)
    if partial is not None:
        return partial

    mask = cores_of(unit, ids, cores_per_device)
    instead = _substitute(view, unit, ids, mask, topology, handed_out, kubelet)
    if instead is not None:
        return instead
    admitting = _admitting(view, unit, len(ids), handed_out, kubelet)
    if len({(s.uid, s.container) for s, _ in admitting}) == 1:
        slot, holding = admitting[0]
        across = held_elsewhere(kubelet, slot, cores_per_device, resource, across=True)
        return _cannot_substitute(view, unit, ids, mask, topology, slot, holding, unhealthy, across)
    clashes = [h for h in view.holdings if h.core_mask & mask]
    if clashes:
        owners = "; ".join(
            f"{h.pod} holds {_ids_text(Unit.CORE, mask_ids(h.core_mask & mask))}"
            for h in clashes[:3]
        )
        return Rejected(
            f"kubelet offered {_ids_text(unit, ids)}, which match no pod's assignment on this "
            f"node and overlap cores the neuron scheduler gave to other pods ({owners}). "
            f"{SCHEDULER_HINT}"
        )
    if not obeys_topology(topology, unit, ids):
        shape = (
            "contiguous cores on connected devices"
            if unit is Unit.CORE
            else "an allowed set of connected devices"
        )
        return Rejected(
            f"kubelet offered {_ids_text(unit, ids)}, which are not {shape} on "
            f"{topology.instance_type} ({topology.kind.value} of {topology.devices} devices x "
            f"{topology.cores_per_device} cores), and no pod on this node was assigned them. "
            f"{SCHEDULER_HINT}"
        )
    return Unclaimed(
        f"{_ids_text(unit, ids)} match no pod's assignment; accepted because they obey the "
        f"{topology.kind.value} rule of {topology.instance_type} and nobody else holds them"
    )


def failed_among(
    unit: Unit, annotated: Sequence[int], unhealthy: int, cores_per_device: int
) -> tuple[int, ...]:
    """The failed devices (`unhealthy`, a mask) among ids in `unit`: why kubelet did not offer
    them."""
    if unit is Unit.CORE:
        devices: Iterable[int] = devices_of_cores(annotated, cores_per_device)
    else:
        devices = annotated
    return tuple(d for d in sorted(set(devices)) if unhealthy >> d & 1)


def _cannot_substitute(
    view: NodeView,
    unit: Unit,
    ids: Sequence[int],
    mask: int,
    topology: Topology,
    slot: Slot,
    holding: AnnotatedPod,
    unhealthy: int,
    across: int = 0,
) -> Rejected:
    """The container kubelet is admitting gets ids that are not its annotated ones and cannot
    stand in for them: say why it did not get its own, and what is wrong with these. `across`:
    the cores (mask) other pods hold through other resources than kubelet's."""
    failed = failed_among(unit, slot.ids, unhealthy, topology.cores_per_device)
    if failed:
        cause = (
            f"kubelet did not offer them: device {format_ids(list(failed))} failed (this device "
            "plugin reports it unhealthy, so kubelet offers it to nobody)"
        )
    elif across & cores_of(unit, slot.ids, topology.cores_per_device):
        cause = "other pods' containers hold them through another Neuron resource"
    else:
        cause = "kubelet still counted them as in use and did not offer them"
    problems = []
    others = [h for h in view.holdings if h.uid != holding.uid and h.core_mask & mask]
    if others:
        owners = "; ".join(
            f"{h.pod} holds {_ids_text(Unit.CORE, mask_ids(h.core_mask & mask))}"
            for h in others[:3]
        )
        problems.append(f"overlap cores the neuron scheduler gave to other pods ({owners})")
    if not obeys_topology(topology, unit, ids):
        shape = "contiguous cores on connected devices" if unit is Unit.CORE else "connected"
        problems.append(f"are not {shape} on {topology.instance_type} ({topology.kind.value})")
    return Rejected(
        f"pod {slot.pod} container {slot.container} was annotated {_ids_text(unit, slot.ids)} "
        f"by the neuron scheduler, which it cannot have: {cause}. kubelet then chose "
        f"{_ids_text(unit, ids)}, which {' and '.join(problems) or 'cannot be used'} (the "
        "device plugin prefers a legal set of what kubelet offers when there is one). The pod "
        "can run once the scheduler places it again (delete it; its controller recreates it)."
    )


def _in_progress(
    view: NodeView,
    unit: Unit,
    wanted: set[int],
    handed_out: frozenset[tuple[str, str]],
    kubelet: KubeletView,
) -> Matched | None:
    """The pod kubelet is in the middle of admitting, when the ids lie within its assignment.

    kubelet allocates all containers of one pod before the next pod, and app containers reuse
    their init containers' ids in an order of its own (string-sorted), so their requests need not
    equal a slice. A pod with some containers already served is the one being admitted.
    """
    found: list[Matched] = []
    for holding in view.holdings:
        if not holding.pending or holding.unit is not unit:
            continue
        served = holding.allocated_containers | {c for u, c in handed_out if u == holding.uid}
        if not served or not wanted <= {i for s in holding.slots for i in s.ids}:
            continue
        left = [s for s in holding.slots if not s.allocated and s.container not in served]
        if left:
            slot = min(left, key=lambda s: (len(s.ids) != len(wanted), s.order(unit, kubelet)))
            found.append(Matched(slot, holding, again=False))
    return found[0] if len(found) == 1 else None


def _admitting(
    view: NodeView,
    unit: Unit,
    size: int,
    handed_out: AbstractSet[tuple[str, str]],
    kubelet: KubeletView,
) -> list[tuple[Slot, AnnotatedPod]]:
    """The slots of `size` that kubelet's pod resources show it admitting now: pending pods'
    first, then containers of admitted pods that kubelet allocates again at container start."""
    found = [
        (slot, holding)
        for slot, holding in view.slots(unit)
        if len(slot.ids) == size
        and (slot.uid, slot.container) not in handed_out
        and slot.stage(unit, kubelet) is Stage.ADMITTING
    ]
    return sorted(
        found,
        key=lambda item: (
            not (item[1].pending and not item[0].allocated),
            item[0].order(unit, kubelet),
        ),
    )


def _substitute(
    view: NodeView,
    unit: Unit,
    ids: Sequence[int],
    mask: int,
    topology: Topology,
    handed_out: frozenset[tuple[str, str]],
    kubelet: KubeletView,
) -> Matched | None:
    """The one container kubelet is admitting, given ids other than its annotated ones because
    kubelet did not offer those; None unless the new ids are legal and no other pod's."""
    admitting = _admitting(view, unit, len(ids), handed_out, kubelet)
    if len({(s.uid, s.container) for s, _ in admitting}) != 1:
        return None
    slot, holding = admitting[0]
    others = 0
    for other in view.holdings:
        if other.uid != holding.uid:
            others |= other.core_mask
    if others & mask or not obeys_topology(topology, unit, ids):
        return None
    pending = holding.pending and not slot.allocated
    return Matched(slot, holding, again=not pending, substitute=True)


@dataclass(frozen=True, slots=True)
class Preference:
    """The ids to steer kubelet to for one container."""

    ids: tuple[int, ...]
    slot: Slot | None  # whose annotated slice they are, or the container kubelet is admitting
    withheld: bool = False  # kubelet is admitting `slot` but does not offer its annotated ids


def preferred_ids(
    view: NodeView,
    unit: Unit,
    available: Sequence[int],
    must_include: Sequence[int],
    size: int,
    cores_per_device: int,
    topology: Topology,
    taken: Iterable[tuple[str, str]] = (),
    kubelet: KubeletView = UNREAD,
    resource: str | None = None,
) -> Preference:
    """The annotated slice of the container kubelet admits now (for `resource`; default: the
    unit's first); when it is not offered, another pod holds it through another resource, or no
    container can be named, a topology-valid choice that avoids everyone's ids."""
    resource = resource or resource_of(unit)
    offered = set(available)
    required = set(must_include)
    skip = set(taken)
    if kubelet.listed is not None:
        candidates = [slot for slot, _ in _admitting(view, unit, size, skip, kubelet)]
    else:
        candidates = sorted(
            (
                slot
                for slot, holding in view.slots(unit)
                if holding.pending
                and not slot.allocated
                and (slot.uid, slot.container) not in skip
                and len(slot.ids) == size
            ),
            key=lambda slot: slot.order(unit, kubelet),
        )
    for slot in candidates:
        elsewhere = held_elsewhere(kubelet, slot, cores_per_device, resource)
        free = not cores_of(unit, slot.ids, cores_per_device) & elsewhere
        if offered.issuperset(slot.ids) and required.issubset(slot.ids) and free:
            return Preference(tuple(slot.ids), slot)
        if kubelet.listed is not None and not (offered.issuperset(slot.ids) and free):
            # kubelet is admitting this very container and does not offer its ids, or another
            # pod holds them through another resource: any legal set of what it offers that
            # nobody holds, its own annotated ids among them.
            fallback = _fallback(
                view, unit, offered, required, size, cores_per_device, topology, slot.uid, elsewhere
            )
            return Preference(fallback, slot, withheld=True)
    elsewhere = held_elsewhere(kubelet, None, cores_per_device, resource)
    fallback = _fallback(
        view, unit, offered, required, size, cores_per_device, topology, avoid=elsewhere
    )
    return Preference(fallback, None)


def _fallback(
    view: NodeView,
    unit: Unit,
    offered: set[int],
    required: set[int],
    size: int,
    cores_per_device: int,
    topology: Topology,
    own: str = "",
    avoid: int = 0,
) -> tuple[int, ...]:
    """The best legal set of `size` among the offered ids that holds no other pod's ids; `own`:
    the uid of the pod being admitted, whose annotated ids are its to take; `avoid`: cores
    (mask) other pods hold that no annotation shows."""
    everything = range(topology.total_cores if unit is Unit.CORE else topology.devices)
    used = avoid | cores_of(unit, (i for i in everything if i not in offered), cores_per_device)
    for holding in view.holdings:
        if holding.uid != own:
            used |= holding.core_mask
    used &= ~cores_of(unit, required, cores_per_device)
    resource = resource_of(unit)
    if size >= 1:
        decision = allocate(topology, NodeState(used), NeuronRequest(resource, size))
        if isinstance(decision, Placement):
            chosen = decision.cores if unit is Unit.CORE else decision.devices
            if required.issubset(chosen) and offered.issuperset(chosen):
                return tuple(chosen)
    # Nothing clean fits: kubelet falls back to its own pick from `offered` anyway.
    rest = sorted(offered - required)
    return tuple(sorted(required)) + tuple(rest[: max(size - len(required), 0)])
