"""What Kubernetes objects mean for Neuron placement: a pod's request, a node's topology and
capacity, and our annotations on a bound pod. Pure."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime

from neuron_scheduler.core import health
from neuron_scheduler.core.catalog import CapacityError, Catalog, Resolved
from neuron_scheduler.core.handoff import Assignment
from neuron_scheduler.core.handoff import decode as decode_annotations
from neuron_scheduler.core.quantity import whole_quantity
from neuron_scheduler.core.resources import (
    NEURON,
    NEURONCORE,
    NEURONDEVICE,
    RESOURCE_UNITS,
    NeuronRequest,
    RequestError,
    pod_request,
)
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.kube.objects import Container, Node, Pod

SIDECAR = "Always"  # an init container's restartPolicy that makes it a sidecar


def _neuron_counts(container: Container) -> dict[str, int]:
    # Extended resources must have requests == limits; limits alone imply requests.
    merged = {**container.resources.requests, **container.resources.limits}
    return {
        name: whole_quantity(value, f"container {container.name!r} {name}")
        for name, value in merged.items()
        if name in RESOURCE_UNITS
    }


# neuron_request's answers by what it reads (each container's name, requests and limits): one
# pod is read half a dozen times while it is scheduled (filter, prioritize, bind, each watch
# event), and a workload's pods ask alike, so reading the quantities again was a visible share of
# the extender's CPU per pod (issue 50). Only small shapes are kept, and at most `_KEPT` of them.
_known_requests: dict[object, NeuronRequest | None] = {}
_KEPT = 512
_KEPT_CONTAINERS = 8
_KEPT_ENTRIES = 8  # requests and limits of one container


def _shape(containers: tuple[Container, ...]) -> tuple[object, ...] | None:
    """What neuron_request reads of these containers, as a key; None when too large to keep."""
    if len(containers) > _KEPT_CONTAINERS:
        return None
    shape = []
    for container in containers:
        resources = container.resources
        if len(resources.requests) + len(resources.limits) > _KEPT_ENTRIES:
            return None
        shape.append(
            (
                container.name,
                container.restartPolicy,
                tuple(resources.requests.items()),
                tuple(resources.limits.items()),
            )
        )
    return tuple(shape)


def neuron_request(pod: Pod) -> NeuronRequest | None:
    """The pod's Neuron request, None without one; RequestError when it cannot be served."""
    spec = pod.spec
    apps, inits = _shape(spec.containers), _shape(spec.initContainers)
    key = (apps, inits) if apps is not None and inits is not None else None
    if key is not None:
        try:
            return _known_requests[key]
        except KeyError:
            pass
    init_counts = [_neuron_counts(c) for c in spec.initContainers]
    app_counts = [_neuron_counts(c) for c in spec.containers]
    request = pod_request(app_counts, init_counts)
    sidecar = next(
        (
            c.name
            for c, counts in zip(spec.initContainers, init_counts, strict=True)
            if c.restartPolicy == SIDECAR and any(counts.values())
        ),
        None,
    )
    if sidecar is not None and request is not None:
        kinds = [c.restartPolicy == SIDECAR for c in spec.initContainers]
        held = _held_with_sidecars(kinds, init_counts, app_counts, request.resource)
        raise SidecarRequest(sidecar, request, held)
    if key is not None:
        if len(_known_requests) >= _KEPT:
            _known_requests.clear()
        _known_requests[key] = request
    return request


class SidecarRequest(RequestError):
    """A sidecar (an init container with restartPolicy: Always) asks for Neuron resources.
    Never placed; `held` is what such a pod placed anyway holds, as kubelet and kube-scheduler
    count it: a sidecar's devices are its own for the pod's whole life, beside the app
    containers', not reused as a finished init container's."""

    def __init__(self, container: str, request: NeuronRequest, held: NeuronRequest) -> None:
        super().__init__(
            f"init container {container!r} is a sidecar (restartPolicy: Always) and requests "
            f"{request.resource}: kubelet keeps a sidecar's devices beside the app containers' "
            "for the pod's whole life, which neither the scheduler's count nor its annotations "
            "can say; request Neuron resources in app containers, or in init containers that "
            "run to completion"
        )
        self.held = held


def _held_with_sidecars(
    sidecars: list[bool],
    init_counts: list[dict[str, int]],
    app_counts: list[dict[str, int]],
    resource: str,
) -> NeuronRequest:
    """kube-scheduler's count (and kubelet's): the app containers and every sidecar together,
    or a regular init container with the sidecars started before it, whichever is more."""
    before = most = 0
    for sidecar, counts in zip(sidecars, init_counts, strict=True):
        count = counts.get(resource, 0)
        if sidecar:
            before += count
        else:
            most = max(most, before + count)
    apps = sum(counts.get(resource, 0) for counts in app_counts)
    return NeuronRequest(resource, max(most, apps + before))


def held_request(pod: Pod) -> NeuronRequest | None:
    """What a pod placed on a node holds there: its request, or, with a sidecar asking for
    Neuron resources (never placed by us, but bound before, or by another scheduler), what
    kubelet gave it. RequestError when it cannot be read at all."""
    try:
        return neuron_request(pod)
    except SidecarRequest as sidecar:
        return sidecar.held


def servable_request(pod: Pod) -> NeuronRequest | None:
    """The pod's Neuron request, or None when it has none or asks for one no node can serve
    (`neuron_request` raises RequestError then; views that only weigh pods skip those)."""
    try:
        return neuron_request(pod)
    except RequestError:
        return None


def node_capacity(node: Node, source: str = "capacity") -> tuple[int | None, int | None]:
    """(devices, cores) the node advertises; None where it advertises nothing. CapacityError
    when a value is not a whole number, or `neuron` and `neurondevice` disagree."""
    values = node.status.capacity if source == "capacity" else node.status.allocatable
    try:
        counts = {
            name: whole_quantity(values[name], f"{source} {name}")
            for name in (NEURON, NEURONDEVICE, NEURONCORE)
            if name in values
        }
    except RequestError as error:
        raise CapacityError(str(error), "unreadable") from error
    devices = counts.get(NEURON) or counts.get(NEURONDEVICE)
    other = counts.get(NEURONDEVICE)
    if devices and other and other != devices:
        # Zero is a resource whose plugin is gone (kubelet keeps it at 0), not a disagreement.
        raise CapacityError(
            f"advertises {NEURON}: {devices} but {NEURONDEVICE}: {other}", "inconsistent"
        )
    return devices or None, counts.get(NEURONCORE) or None


def node_topology(node: Node, catalog: Catalog) -> Resolved | None:
    """The node's Neuron topology; None for a node that advertises no Neuron resources.
    CapacityError when what it advertises cannot be right (the node is then unusable)."""
    devices, cores = node_capacity(node)
    if not devices and not cores:
        return None
    return catalog.resolve(node.instance_type, devices, cores)


def unhealthy_devices(node: Node, topology: Topology) -> int:
    """The node's failed devices (a mask), as its device plugin publishes them (core/health).
    HealthError when the annotation cannot be this node's."""
    return health.decode(node.metadata.annotations.get(health.UNHEALTHY_DEVICES), topology.devices)


def held_by_others(node: Node, topology: Topology, unhealthy: int = 0) -> int:
    """Cores the node does not offer (capacity above allocatable) beyond those of the known
    `unhealthy` devices: devices whose failure was not published, or reserved.

    We do not know which ids those are, so they are kept free in count, like pods placed by
    another scheduler. Allocatable that cannot be read or exceeds capacity withholds nothing."""
    try:
        alloc_devices, alloc_cores = node_capacity(node, "allocatable")
    except CapacityError:
        return 0
    missing = 0
    if alloc_cores is not None:
        missing = max(missing, topology.total_cores - alloc_cores)
    if alloc_devices is not None:
        missing = max(missing, (topology.devices - alloc_devices) * topology.cores_per_device)
    missing -= unhealthy.bit_count() * topology.cores_per_device
    return min(max(missing, 0), topology.total_cores)


def assignment(pod: Pod, cores_per_device: int | None) -> Assignment | None:
    """Our annotations on a bound pod, when they are for the node it is bound to."""
    found = decode_annotations(pod.metadata.annotations, cores_per_device)
    if found is None or found.node not in ("", pod.spec.nodeName):
        # No NEURON_NODE: written by the upstream extension, which only annotates at bind.
        return None
    return found


def unschedulable(pod: Pod) -> bool:
    """kube-scheduler (or whoever writes it) found no node for the pod: what autoscalers act on."""
    return any(
        c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
        for c in pod.status.conditions
    )


# Kueue's keys on the pods it manages (sigs.k8s.io/kueue v0.17.0: apis/kueue/v1beta2,
# pkg/controller/constants, pkg/controller/jobs/pod/constants).
KUEUE_ADMISSION_GATE = "kueue.x-k8s.io/admission"  # until its workload is admitted
KUEUE_TOPOLOGY_GATE = "kueue.x-k8s.io/topology"  # until topology-aware scheduling pins it
KUEUE_GATES = (KUEUE_ADMISSION_GATE, KUEUE_TOPOLOGY_GATE)
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # its LocalQueue, in the pod's namespace
KUEUE_WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"  # set once the workload is admitted
KUEUE_PREBUILT_LABEL = "kueue.x-k8s.io/prebuilt-workload-name"
KUEUE_POD_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"  # a pod group's Workload is named so
MAX_GATES_SHOWN = 8
MAX_NAME = 253  # an object's name at most; longer values are cut (annotations are free text)


def gated(pod: Pod) -> bool:
    """The pod has a scheduling gate: kube-scheduler does not try to place it, and the extender
    does nothing for it (no claim, hold, plan, placeholder or wake) until every gate is gone.
    Under Kueue, the gate means its quota is not given yet: the pod is Kueue's, not ours."""
    return bool(pod.spec.schedulingGates)


@dataclass(frozen=True, slots=True)
class Gating:
    """What holds a gated pod back: its gates, and for Kueue's, its Workload and LocalQueue."""

    namespace: str  # the pod's, and so its Workload's and LocalQueue's
    gates: tuple[str, ...]  # the first MAX_GATES_SHOWN, in the pod's order
    more: int  # gates beyond those
    workload: str  # Kueue's Workload, "" when no gate is Kueue's
    queue: str  # its LocalQueue, "" when not Kueue's or the pod names none

    @property
    def text(self) -> str:
        """`scheduling gate G: Kueue's Workload ns/w in LocalQueue q is not admitted yet`."""
        gates = ", ".join(self.gates) + (f" and {self.more} more" if self.more else "")
        text = f"scheduling gate{'s' if len(self.gates) + self.more > 1 else ''} {gates}"
        if self.workload:
            queue = f" in LocalQueue {self.queue}" if self.queue else ""
            text += f": Kueue's Workload {self.namespace}/{self.workload}{queue}"
            if KUEUE_ADMISSION_GATE in self.gates:
                text += " is not admitted yet"
            else:
                text += " waits for its topology assignment"
        return text


def gating(pod: Pod) -> Gating | None:
    """Why a gated pod waits; None for a pod without gates."""
    names = [g.name for g in pod.spec.schedulingGates]
    if not names:
        return None
    kueue = any(name in KUEUE_GATES for name in names)
    labels = pod.metadata.labels
    return Gating(
        namespace=pod.metadata.namespace,
        gates=tuple(name[: 2 * MAX_NAME] for name in names[:MAX_GATES_SHOWN]),
        more=max(len(names) - MAX_GATES_SHOWN, 0),
        workload=kueue_workload(pod)[:MAX_NAME] if kueue else "",
        queue=labels.get(KUEUE_QUEUE_LABEL, "")[:MAX_NAME] if kueue else "",
    )


def kueue_workload(pod: Pod) -> str:
    """The name of Kueue's Workload for the pod, as Kueue v0.17.0 names it: the annotation it
    writes at admission; else a prebuilt workload's name; else the pod group's name; else a single
    pod's generated name (`pod-NAME-HASH`, pkg/controller/jobframework/workload_names.go, with
    the default feature gates)."""
    meta = pod.metadata
    for found in (
        meta.annotations.get(KUEUE_WORKLOAD_ANNOTATION),
        meta.labels.get(KUEUE_PREBUILT_LABEL),
        meta.labels.get(KUEUE_POD_GROUP_LABEL),
    ):
        if found:
            return found
    # sha1 of kind, group (core: empty), name and uid, each line-separated; the first 5 digits.
    digest = hashlib.sha1(f"Pod\n\n{meta.name}\n{meta.uid}".encode(), usedforsecurity=False)
    return f"{f'pod-{meta.name}'[:247]}-{digest.hexdigest()[:5]}"


def epoch(timestamp: str) -> float:
    """An API timestamp (RFC 3339) in seconds since the epoch; 0 (the oldest) when missing or
    unreadable."""
    if not timestamp:
        return 0.0
    try:
        return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
