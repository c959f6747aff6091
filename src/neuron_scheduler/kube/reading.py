"""What Kubernetes objects mean for Neuron placement: a pod's request, a node's topology and
capacity, and our annotations on a bound pod. Pure."""

from __future__ import annotations

from neuron_scheduler.core.catalog import Catalog, Resolved
from neuron_scheduler.core.handoff import Assignment
from neuron_scheduler.core.handoff import decode as decode_annotations
from neuron_scheduler.core.resources import (
    NEURON,
    NEURONCORE,
    NEURONDEVICE,
    RESOURCE_UNITS,
    NeuronRequest,
    RequestError,
    pod_request,
)
from neuron_scheduler.kube.objects import Container, Node, Pod


def quantity(value: str | int, what: str) -> int:
    """An extended-resource quantity; the API server only admits whole numbers for these."""
    if isinstance(value, int):
        return value
    text = value.strip()
    try:
        return int(text)
    except ValueError:
        pass
    suffixes = {"k": 10**3, "M": 10**6, "G": 10**9}
    if text[-1:] in suffixes and text[:-1].isdigit():
        return int(text[:-1]) * suffixes[text[-1]]
    raise RequestError(f"{what}: cannot read quantity {value!r} as a whole number")


def _neuron_counts(container: Container) -> dict[str, int]:
    # Extended resources must have requests == limits; limits alone imply requests.
    merged = {**container.resources.requests, **container.resources.limits}
    return {
        name: quantity(value, f"container {container.name!r} {name}")
        for name, value in merged.items()
        if name in RESOURCE_UNITS
    }


def neuron_request(pod: Pod) -> NeuronRequest | None:
    """The pod's Neuron request, None without one; RequestError when it cannot be served."""
    return pod_request(
        [_neuron_counts(c) for c in pod.spec.containers],
        [_neuron_counts(c) for c in pod.spec.initContainers],
    )


def node_capacity(node: Node, source: str = "capacity") -> tuple[int | None, int | None]:
    """(devices, cores) the node advertises; None where it advertises nothing."""
    values = node.status.capacity if source == "capacity" else node.status.allocatable
    devices: int | None = None
    for name in (NEURON, NEURONDEVICE):
        if name in values:
            try:
                devices = max(devices or 0, quantity(values[name], name))
            except RequestError:
                continue
    cores: int | None = None
    if NEURONCORE in values:
        try:
            cores = quantity(values[NEURONCORE], NEURONCORE)
        except RequestError:
            cores = None
    return devices, cores


def node_topology(node: Node, catalog: Catalog) -> Resolved | None:
    """The node's Neuron topology; None for a node that advertises no Neuron resources."""
    devices, cores = node_capacity(node)
    if not devices and not cores:
        return None
    return catalog.resolve(node.instance_type, devices or None, cores or None)


def held_by_others(node: Node, cores_per_device: int) -> int:
    """Cores the node does not offer (capacity above allocatable: unhealthy or reserved devices).

    We do not know which ids those are, so they are kept free in count, like pods placed by
    another scheduler."""
    cap_devices, cap_cores = node_capacity(node, "capacity")
    alloc_devices, alloc_cores = node_capacity(node, "allocatable")
    missing = 0
    if cap_cores is not None and alloc_cores is not None:
        missing = max(missing, cap_cores - alloc_cores)
    if cap_devices is not None and alloc_devices is not None:
        missing = max(missing, (cap_devices - alloc_devices) * cores_per_device)
    return max(missing, 0)


def assignment(pod: Pod, cores_per_device: int | None) -> Assignment | None:
    """Our annotations on a bound pod, when they are for the node it is bound to."""
    found = decode_annotations(pod.metadata.annotations, cores_per_device)
    if found is None or found.node not in ("", pod.spec.nodeName):
        # No NEURON_NODE: written by the upstream extension, which only annotates at bind.
        return None
    return found
