"""What kubelet says each container holds, from its pod resources API (v1 `List` on
<kubelet root dir>/pod-resources/kubelet.sock).

kubelet's Allocate names no pod, but pod resources does: it lists every active pod with the device
ids each of its containers got, per resource. Only our resources are kept, and the answer is
bounded like anything read from outside: ids must be ours (non-negative integers, no repeats,
no more than a node has), names must be Kubernetes names.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc

from neuron_scheduler.core.topology import MAX_CORES
from neuron_scheduler.deviceplugin.admission import KubeletView
from neuron_scheduler.deviceplugin.matching import kubelet_ids
from neuron_scheduler.deviceplugin.podresources.v1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

# kubelet runs at most a few hundred pods; an answer beyond these is not one we act on.
MAX_PODS = 4096
MAX_CONTAINERS = 256
MAX_NAME = 253
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
CALL_SECONDS = 5.0

PodKey = tuple[str, str]  # namespace, name
# container -> resource -> ids, for one pod.
ContainerIds = dict[str, dict[str, tuple[int, ...]]]


class HoldingsError(Exception):
    """kubelet's pod resources API could not be read; the message says why."""


@dataclass(frozen=True, slots=True)
class KubeletHoldings:
    """One `List` answer: each pod's containers and the ids of our resources they hold. A pod
    listed twice (an old and a new pod of the same name, both still active) is `ambiguous`: none
    of its entries is kept in `pods`, and `shadowed` has what its entries hold together."""

    pods: dict[PodKey, ContainerIds] = field(default_factory=dict)
    ambiguous: frozenset[PodKey] = frozenset()
    skipped: tuple[str, ...] = ()  # what was left out and why
    shadowed: dict[PodKey, dict[str, frozenset[int]]] = field(default_factory=dict)


def kubelet_view(held: KubeletHoldings, batch: frozenset[str] = frozenset()) -> KubeletView:
    """What a `List` answer tells about kubelet's admission: a name it lists twice is an old and
    a new pod, listed with no ids known, and what they hold together is `shadowed`."""
    listed = {**held.pods, **{key: {} for key in held.ambiguous}}
    return KubeletView(listed, batch, held.shadowed)


class HoldingsReader(Protocol):
    async def read(self) -> KubeletHoldings: ...


def _name_ok(name: str) -> bool:
    return 0 < len(name) <= MAX_NAME


def holdings_of(pods: Iterable[api_pb2.PodResources], resources: frozenset[str]) -> KubeletHoldings:
    """The answer's ids for `resources`, bounded and checked."""
    found: dict[PodKey, ContainerIds] = {}
    every: dict[PodKey, list[ContainerIds]] = {}
    ambiguous: set[PodKey] = set()
    skipped: list[str] = []
    for count, pod in enumerate(pods):
        if count >= MAX_PODS:
            skipped.append(f"pods beyond the first {MAX_PODS}")
            break
        key = (pod.namespace, pod.name)
        if not (_name_ok(pod.namespace) and _name_ok(pod.name)):
            skipped.append("a pod with an unusable name")
            continue
        containers = _containers(pod, resources, skipped)
        if key in every:
            ambiguous.add(key)
            found.pop(key, None)
        else:
            every[key] = []
            if containers is not None:
                found[key] = containers
        if containers is not None:
            every[key].append(containers)
    shadowed = {key: _together(every[key]) for key in ambiguous}
    return KubeletHoldings(found, frozenset(ambiguous), tuple(skipped), shadowed)


def _together(entries: Iterable[ContainerIds]) -> dict[str, frozenset[int]]:
    """Resource -> every id the containers of these entries hold."""
    ids: dict[str, set[int]] = {}
    for containers in entries:
        for resources in containers.values():
            for resource, held in resources.items():
                ids.setdefault(resource, set()).update(held)
    return {resource: frozenset(held) for resource, held in ids.items()}


def _containers(
    pod: api_pb2.PodResources, resources: frozenset[str], skipped: list[str]
) -> ContainerIds | None:
    where = f"{pod.namespace}/{pod.name}"
    if len(pod.containers) > MAX_CONTAINERS:
        skipped.append(f"{where}: {len(pod.containers)} containers")
        return None
    containers: ContainerIds = {}
    for container in pod.containers:
        if not _name_ok(container.name) or container.name in containers:
            skipped.append(f"{where}: a container with an unusable or repeated name")
            return None
        held: dict[str, list[str]] = {}
        total = 0
        for devices in container.devices:
            if devices.resource_name not in resources:
                continue
            total += len(devices.device_ids)
            if total > MAX_CORES:
                skipped.append(f"{where} container {container.name}: more ids than any node has")
                return None
            # One entry per id when the plugin reports topology: gather them.
            held.setdefault(devices.resource_name, []).extend(devices.device_ids)
        parsed: dict[str, tuple[int, ...]] = {}
        for resource, raw in held.items():
            ids = kubelet_ids(raw)
            if ids is None:
                skipped.append(f"{where} container {container.name}: ids that are not ours")
                return None
            parsed[resource] = tuple(sorted(ids))
        containers[container.name] = parsed
    return containers


class SocketHoldings:
    """Reads kubelet's pod resources socket; a fresh channel per read, so a restarted kubelet
    (a new socket at the same path) is simply read again."""

    def __init__(self, socket: Path, resources: Iterable[str]) -> None:
        self.socket = socket
        self.resources = frozenset(resources)

    async def read(self) -> KubeletHoldings:
        if not self.socket.exists():
            raise HoldingsError(
                f"{self.socket} does not exist: is kubelet's pod-resources directory mounted?"
            )
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        async with grpc.aio.insecure_channel(f"unix://{self.socket}", options=options) as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            try:
                answer = await stub.List(api_pb2.ListPodResourcesRequest(), timeout=CALL_SECONDS)
            except grpc.aio.AioRpcError as error:
                raise HoldingsError(
                    f"List on {self.socket}: {error.code().name} {error.details()}"
                ) from error
        return holdings_of(answer.pod_resources, self.resources)
