"""The pod annotations that hand the scheduler's choice to the device plugin. Pure.

Compatible with the upstream device plugin (`AWS_NEURON_IDS`, `NEURON_RESOURCE_TYPE`,
`NEURON_ALLOC_TIME`, `NEURON_ALLOCATED`), plus the seed diagrams' `NEURON_CORES` and
`NEURON_DEVS` so a person sees both views, plus two of ours:
- `NEURON_NODE`: the node the ids belong to. Ids only count while the pod is bound to that node,
  so an annotation written for node A never blocks devices on node B.
- `NEURON_CONTAINER_IDS`: JSON object, container name -> its slice of `AWS_NEURON_IDS`, in the
  pod's unit; the device plugin hands each container exactly its slice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.core.ids import comma_ids, cores_of_devices, devices_of_cores, ids_mask
from neuron_scheduler.core.resources import RESOURCE_UNITS, NeuronRequest, Unit

IDS = "AWS_NEURON_IDS"
RESOURCE_TYPE = "NEURON_RESOURCE_TYPE"
ALLOC_TIME = "NEURON_ALLOC_TIME"
ALLOCATED = "NEURON_ALLOCATED"
CORES = "NEURON_CORES"
DEVS = "NEURON_DEVS"
NODE = "NEURON_NODE"
CONTAINER_IDS = "NEURON_CONTAINER_IDS"
# Written by the device plugin for pods with several Neuron containers: those already served.
ALLOCATED_CONTAINERS = "NEURON_ALLOCATED_CONTAINERS"

# Every key this project writes: a patch that removes ours must name exactly these.
OURS = (
    IDS,
    RESOURCE_TYPE,
    ALLOC_TIME,
    ALLOCATED,
    CORES,
    DEVS,
    NODE,
    CONTAINER_IDS,
    ALLOCATED_CONTAINERS,
)


class AnnotationError(ValueError):
    """Annotations that are present but cannot be read: treated as 'ids unknown', never as free."""


@dataclass(frozen=True, slots=True)
class Assignment:
    """What the scheduler gave a pod, as read back from its annotations."""

    node: str
    resource: str
    ids: tuple[int, ...]  # in the resource's unit
    cores: tuple[int, ...]
    devices: tuple[int, ...]
    containers: dict[str, tuple[int, ...]]
    allocated: bool

    @property
    def core_mask(self) -> int:
        return ids_mask(self.cores)


def _parse(text: str, key: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise AnnotationError(f"{key}={text!r} is not a list of ids") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise AnnotationError(f"{key}={text!r} has negative or repeated ids")
    return ids


def split_per_container(
    ids: Sequence[int], request: NeuronRequest, containers: Sequence[str]
) -> dict[str, tuple[int, ...]]:
    """Consecutive slices of the pod's ids, in container order (the allocation is contiguous in
    that order, so each container's slice is itself contiguous)."""
    counts = request.per_container or (request.count,)
    slices: dict[str, tuple[int, ...]] = {}
    position = 0
    for name, count in zip(containers, counts, strict=False):
        if count:
            slices[name] = tuple(ids[position : position + count])
        position += count
    return slices


def encode(
    node: str,
    request: NeuronRequest,
    placement: Placement,
    containers: Sequence[str],
    now_ns: int,
) -> dict[str, str]:
    ids = placement.devices if request.unit is Unit.DEVICE else placement.cores
    slices = split_per_container(ids, request, containers)
    return {
        IDS: comma_ids(ids),
        RESOURCE_TYPE: request.resource,
        ALLOC_TIME: str(now_ns),
        ALLOCATED: "false",
        CORES: comma_ids(placement.cores),
        DEVS: comma_ids(placement.devices),
        NODE: node,
        CONTAINER_IDS: json.dumps(
            {name: comma_ids(part) for name, part in slices.items()}, separators=(",", ":")
        ),
    }


def removal() -> dict[str, None]:
    """A merge patch body's annotations that deletes our keys and nothing else."""
    return dict.fromkeys(OURS)


def decode(
    annotations: Mapping[str, str], cores_per_device: int | None = None
) -> Assignment | None:
    """Our assignment from a pod's annotations; None when the pod has none of ours.

    `NEURON_CORES` is authoritative for which cores are held; when it is missing (a pod annotated by
    the upstream extension), cores are derived from `AWS_NEURON_IDS` and `cores_per_device`.
    """
    if IDS not in annotations:
        return None
    resource = annotations.get(RESOURCE_TYPE) or "aws.amazon.com/neuron"
    if resource not in RESOURCE_UNITS:
        raise AnnotationError(f"{RESOURCE_TYPE}={resource!r} is not a Neuron resource")
    ids = _parse(annotations[IDS], IDS)
    unit = RESOURCE_UNITS[resource]
    if CORES in annotations:
        cores = _parse(annotations[CORES], CORES)
    elif unit is Unit.CORE:
        cores = ids
    elif cores_per_device:
        cores = cores_of_devices(ids, cores_per_device)
    else:
        raise AnnotationError(f"{CORES} missing and cores per device unknown")
    if DEVS in annotations:
        devices = _parse(annotations[DEVS], DEVS)
    elif unit is Unit.DEVICE:
        devices = ids
    elif cores_per_device:
        devices = devices_of_cores(cores, cores_per_device)
    else:
        raise AnnotationError(f"{DEVS} missing and cores per device unknown")
    containers: dict[str, tuple[int, ...]] = {}
    if CONTAINER_IDS in annotations:
        try:
            raw = json.loads(annotations[CONTAINER_IDS])
        except ValueError:
            raise AnnotationError(f"{CONTAINER_IDS} is not JSON") from None
        if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
            raise AnnotationError(f"{CONTAINER_IDS} must map container names to id lists")
        containers = {str(k): _parse(v, CONTAINER_IDS) for k, v in raw.items()}
    return Assignment(
        node=annotations.get(NODE, ""),
        resource=resource,
        ids=ids,
        cores=cores,
        devices=devices,
        containers=containers,
        allocated=annotations.get(ALLOCATED, "false").lower() == "true",
    )
