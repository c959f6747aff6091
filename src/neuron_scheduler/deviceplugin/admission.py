"""Which pod kubelet is admitting when it asks for ids: what its pod resources API says it has
taken in, else its own admission order. Pure.

GetPreferredAllocation and Allocate name no pod. kubelet (v1.36.3 source, pkg/kubelet) admits
pods on one path, HandlePodAdditions (kubelet.go:2832-2908), one pod after another, and asks the
device manager for each container's ids while it does (the topology manager's admit handler,
cm/topologymanager/scope.go:143-151: init containers, then app containers, in spec order). The
pods reach it three ways:

- Single additions. A running kubelet watches the pods bound to its node (config/apiserver.go:
  57-66, a Reflector into an UndeltaStore that pushes the whole store on each event), and
  podStorage.merge (config/config.go:177-248) passes on only pods it has not seen: each binding
  is an ADD of its own (kubelet.go:2708-2714), in the order the bindings reached the API server.
  Until kubelet admits a pod nothing else writes it, so its resourceVersion is still that of its
  binding: the lower goes first.
- The batch at kubelet start. The first list is one ADD of every pod bound to the node, sorted by
  creation time (kubelet.go:2835 `sort.Sort(sliceutils.PodsByCreationTime(pods))`,
  util/sliceutils/sliceutils.go:24-38); every pod bound later comes after it, one by one.
  creationTimestamp has whole seconds (apimachinery meta/v1/time_proto.go:39-49 drops the
  nanoseconds), the batch arrives in Go map order (client-go tools/cache/thread_safe_store.go:
  366-374), and sort.Sort keeps that order for ties in batches of up to 12 pods (Go 1.26
  src/sort/zsortinterface.go:61-74, insertion sort): pods created in the same second are
  admitted in an order no one can predict. The plugin takes the pods bound when it saw a new
  kubelet register as that batch (`KubeletView.batch`).
- After an admission failure. kubelet fails a pod it does not admit for good (kubelet.go:
  2872-2879, rejectPod) and drops it from its active pods (kubelet_pods.go:1144-1177): it is
  never "next" again. The one retry kubelet makes is at container start, for an admitted pod
  whose device record is missing (cm/devicemanager/manager.go:962-990, Allocate issued again):
  it asks for that container's ids again.

Pod resources answers the question directly. kubelet adds a pod to its pod manager just before
admitting it (kubelet.go:2842, before the admission at 2872); `List` answers from the active pods
of that pod manager (apis/podresources/server_v1.go:61-102; KubeletPodResourcesListUseActivePods
is on by default since 1.34), each container with the ids the device manager recorded for it,
which it does only once Allocate has answered (manager.go:933). The device manager holds no lock
while it calls the plugin (manager.go:890-902, 1042-1045), so the plugin can ask. While kubelet
asks, the pod it admits is the one it lists whose container holds no ids of ours yet; a pod later
in the same batch is not listed at all, and a rejected one no longer. Candidates rank by `Stage`,
then by kubelet's own order.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from neuron_scheduler.core.ids import core_mask_of_devices
from neuron_scheduler.core.resources import RESOURCE_UNITS, Unit
from neuron_scheduler.core.topology import MAX_CORES
from neuron_scheduler.kube.objects import Pod

# (namespace, name) -> container -> resource -> ids: one pod resources List answer, our resources.
Listing = Mapping[tuple[str, str], Mapping[str, Mapping[str, Sequence[int]]]]
# (namespace, name) -> resource -> ids: what the pods of a name kubelet lists twice hold together.
Shadowed = Mapping[tuple[str, str], Mapping[str, Iterable[int]]]

# Beyond any etcd revision or epoch second: what cannot be read ranks last.
UNRANKED = 1 << 63

# Stage, outside the start batch, creation second, binding version, bind time, pod, position.
OrderKey = tuple[int, int, int, int, int, str, int]


class Stage(enum.IntEnum):
    """Where a container stands in kubelet's admission, from pod resources; lower goes first."""

    ADMITTING = 0  # kubelet lists the pod, and the container holds none of our ids yet
    UNKNOWN = 1  # pod resources could not be read
    SERVED = 2  # the container already holds ids
    NOT_ADDED = 3  # kubelet has not taken the pod in yet (later in its batch, or not seen)


@dataclass(frozen=True, slots=True)
class Arrival:
    """When kubelet can have heard of a pod: what its order is made of."""

    namespace: str
    name: str
    created: int  # creationTimestamp, epoch seconds
    version: int  # resourceVersion: that of its binding while kubelet has not admitted it
    alloc_time: int  # NEURON_ALLOC_TIME, the extender's bind time: a last tie-break


def arrival(pod: Pod, alloc_time: int) -> Arrival:
    meta = pod.metadata
    return Arrival(
        meta.namespace, meta.name, _epoch(meta.creationTimestamp), version_rank(pod), alloc_time
    )


def version_rank(pod: Pod) -> int:
    """The resourceVersion as a number. resourceVersions are opaque to clients, but every API
    server backed by etcd gives revisions, which grow; anything else ranks last."""
    version = pod.metadata.resourceVersion
    if not (version.isascii() and version.isdigit()) or len(version) > 18:
        return UNRANKED
    return int(version)


def _epoch(stamp: str | None) -> int:
    try:
        return int(datetime.fromisoformat(stamp or "").timestamp())
    except ValueError:
        return UNRANKED


@dataclass(frozen=True, slots=True)
class KubeletView:
    """What the plugin knows of kubelet while it asks: its pod resources (None when they could not
    be read), the pods of its start batch (uids; the pods that were bound when the plugin saw
    it start), and the ids held under names kubelet lists twice (`listed` names them with no
    containers: which of the two holds what is unknown)."""

    listed: Listing | None = None
    batch: frozenset[str] = frozenset()
    shadowed: Shadowed = field(default_factory=dict)

    def holders(
        self,
        pod: tuple[str, str] | None,
        cores_per_device: int,
        resource: str,
        *,
        across: bool = False,
    ) -> dict[str, int]:
        """The cores (mask) that kubelet says the containers of each pod hold, in any of our
        resources, by "namespace/name"; empty when pod resources were not read.

        kubelet keeps ids apart within one resource only: device 0 given through `neuron` and
        cores 0 and 1 through `neuroncore` are, to it, unrelated. A pod placed without the
        scheduler has ids no annotation records, so this is the one place that knows them.
        What `pod`, the one kubelet admits for `resource`, holds through `resource` is its own
        and left out. `across`: only what is held through other resources than `resource`,
        which kubelet itself cannot see. A name listed twice counts whole: an older pod of that
        name still holds its ids."""
        if self.listed is None:
            return {}
        held: dict[str, int] = {}
        for key, containers in self.listed.items():
            mine = resource if across or key == pod else None
            mask = 0
            for resources in containers.values():
                mask |= cores_held(resources, cores_per_device, mine)
            if mask:
                held[f"{key[0]}/{key[1]}"] = mask
        for key, together in self.shadowed.items():
            mask = cores_held(together, cores_per_device, resource if across else None)
            if mask:
                name = f"{key[0]}/{key[1]}"
                held[name] = held.get(name, 0) | mask
        return held

    def stage(self, pod: Arrival, container: str, init: bool, unit: Unit) -> Stage:
        if self.listed is None:
            return Stage.UNKNOWN
        containers = self.listed.get((pod.namespace, pod.name))
        if containers is None:
            return Stage.NOT_ADDED
        # List leaves out init containers (server_v1.go:84-90): an init container is being served
        # while none of the pod's containers holds ids yet.
        held = (
            any(_holds(c, unit) for c in containers.values())
            if init
            else _holds(containers.get(container, {}), unit)
        )
        return Stage.SERVED if held else Stage.ADMITTING

    def order(
        self, pod: Arrival, uid: str, container: str, position: int, init: bool, unit: Unit
    ) -> OrderKey:
        """Sort key: the stage, then kubelet's order (its start batch first, by creation second;
        then single additions by binding), then bind time, pod, container position."""
        in_batch = uid in self.batch
        return (
            self.stage(pod, container, init, unit),
            0 if in_batch else 1,
            pod.created if in_batch else 0,
            pod.version,
            pod.alloc_time,
            f"{pod.namespace}/{pod.name}",
            position,
        )


# Nothing read from kubelet: its admission order alone, with no start batch.
UNREAD = KubeletView()


def cores_held(
    resources: Mapping[str, Iterable[int]], cores_per_device: int, leave_out: str | None = None
) -> int:
    """The cores (mask) that ids of our resources (but `leave_out`) stand for; ids no node has
    are left out, so that no answer can make a mask of any size."""
    cores = 0
    devices = 0
    for name, ids in resources.items():
        if name == leave_out:
            continue
        unit = RESOURCE_UNITS.get(name)
        for i in ids:
            if 0 <= i < MAX_CORES:
                if unit is Unit.CORE:
                    cores |= 1 << i
                elif unit is Unit.DEVICE:
                    devices |= 1 << i
    return cores | core_mask_of_devices(devices, cores_per_device)


def _holds(resources: Mapping[str, Sequence[int]], unit: Unit) -> bool:
    return any(ids for name, ids in resources.items() if RESOURCE_UNITS.get(name) is unit)


class WithheldCause(enum.StrEnum):
    """Why kubelet did not offer a container's annotated ids."""

    FAILED = "failed"  # one of them is on a device this plugin reports unhealthy
    RESTART = "restart"  # a restarted kubelet still counts a deleted pod's ids until its start
    IN_USE = "in_use"  # kubelet counted them as another pod's at that moment
    # Offered, but another pod's containers hold them through another resource (kubelet keeps
    # ids apart within one resource only); the plugin steered kubelet to other ids.
    HELD_ELSEWHERE = "held_elsewhere"


@dataclass(frozen=True, slots=True)
class Withheld:
    """kubelet gave a container other ids than its annotated ones without having offered those:
    what the correction's event says."""

    annotated: tuple[int, ...]
    offered: int | None = None  # how many ids kubelet offered, when it asked for a preference
    total: int | None = None  # of how many the plugin advertises
    cause: WithheldCause = WithheldCause.RESTART
    failed: tuple[int, ...] = ()  # the failed devices among them (cause FAILED)
