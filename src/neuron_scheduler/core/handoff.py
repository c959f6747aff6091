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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from neuron_scheduler.core.allocation import Placement, counted
from neuron_scheduler.core.ids import (
    comma_ids,
    cores_of_devices,
    devices_of_cores,
    format_ids,
    ids_mask,
)
from neuron_scheduler.core.resources import RESOURCE_UNITS, NeuronRequest, Unit
from neuron_scheduler.core.topology import MAX_CORES, Topology

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


# Any pod may carry these annotations, so they are read as untrusted: no id list longer than the
# largest node could hold, no id beyond it, before anything is built from them.
_MAX_ID_TEXT = MAX_CORES * 5  # "1023," per id
_MAX_CONTAINER_TEXT = 64 * 1024
_CONTAINER_SLICES = msgspec.json.Decoder(dict[str, str])


def _parse(text: str, key: str) -> tuple[int, ...]:
    if len(text) > _MAX_ID_TEXT:
        raise AnnotationError(f"{key} is {len(text)} characters long: more ids than any node has")
    try:
        ids = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise AnnotationError(f"{key}={_quoted(text)} is not a list of ids") from None
    if any(not 0 <= i < MAX_CORES for i in ids):
        raise AnnotationError(f"{key}={_quoted(text)} has ids outside 0-{MAX_CORES - 1}")
    if len(set(ids)) != len(ids):
        raise AnnotationError(f"{key}={_quoted(text)} repeats ids")
    return ids


def _quoted(text: str) -> str:
    return repr(text) if len(text) <= 60 else repr(text[:57] + "...")


def misfit(found: Assignment, topology: Topology) -> str | None:
    """Why these ids cannot be ones this node gave out (ids beyond its devices or cores, more
    than it has, cores that are not the devices', ids, cores and devices that do not name the
    same, a container handed ids that are not the pod's), or None when they can."""
    cores, devices = found.cores, found.devices
    if len(cores) > topology.total_cores or len(devices) > topology.devices:
        return (
            f"{len(devices)} devices and {len(cores)} cores are more than {topology.instance_type} "
            f"has ({topology.devices} devices, {topology.total_cores} cores)"
        )
    beyond = [c for c in cores if c >= topology.total_cores]
    if beyond:
        return f"cores {format_ids(beyond)} do not exist on {topology.instance_type}"
    beyond = [d for d in devices if d >= topology.devices]
    if beyond:
        return f"devices {format_ids(beyond)} do not exist on {topology.instance_type}"
    per_device = topology.cores_per_device
    owners = set(devices_of_cores(cores, per_device))
    if not owners <= set(devices):
        return f"cores {format_ids(list(cores))} are not on devices {format_ids(list(devices))}"
    # What a pod is counted as holding (its cores) must be what its containers are handed (the
    # ids, and each container's slice of them): ours, upstream's and the device plugin's
    # corrections always are; ids that say otherwise would let one device go to two pods.
    unit = RESOURCE_UNITS[found.resource]
    if unit is Unit.DEVICE:
        same = set(found.ids) == set(devices) and set(cores) == set(
            cores_of_devices(devices, per_device)
        )
    else:
        same = set(found.ids) == set(cores) and set(devices) == owners
    if not same:
        return (
            f"{IDS} {format_ids(list(found.ids))}, {CORES} {format_ids(list(cores))} and {DEVS} "
            f"{format_ids(list(devices))} do not name the same {unit.value}s"
        )
    sliced = {i for part in found.containers.values() for i in part}
    if not sliced <= set(found.ids):
        extra = format_ids(sorted(sliced - set(found.ids)))
        return f"containers are given ids {extra} that are not the pod's"
    return None


def beyond_request(found: Assignment, request: NeuronRequest) -> str | None:
    """Why these ids hold more than the pod asks for, or None. Any user who may create pods can
    write these annotations, on a pod set on a node or left pending: ids for more devices or
    cores than the pod requests would take them from everyone else (a whole node, with a
    one-core request) while it lives, and ours never give a pod more than it asks for."""
    unit = request.unit
    if RESOURCE_UNITS[found.resource] is not unit:
        return f"ids of {found.resource} on a pod that requests {request.describe()}"
    held = len(found.devices) if unit is Unit.DEVICE else len(found.cores)
    if held <= request.count:
        return None
    return f"ids for {counted(held, unit)}, more than the pod's {request.describe()}"


def _read_or_derive(
    annotations: Mapping[str, str],
    key: str,
    derive: Callable[[], tuple[int, ...]],
    derivable: bool,
) -> tuple[int, ...]:
    if key in annotations:
        return _parse(annotations[key], key)
    if not derivable:
        raise AnnotationError(f"{key} missing and cores per device unknown")
    return derive()


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
    annotations = {
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
    # The watch shows these on the pod next: what they decode to is known here.
    texts = tuple(map(annotations.get, _READ))
    if sum(len(text) for text in texts if text is not None) <= _MEMO_TEXT:
        _remember(
            texts,
            Assignment(
                node,
                request.resource,
                ids,
                placement.cores,
                placement.devices,
                slices,
                allocated=False,
            ),
        )
    return annotations


def removal() -> dict[str, None]:
    """A merge patch body's annotations that deletes our keys and nothing else."""
    return dict.fromkeys(OURS)


# The keys `decode` reads, which its memo is keyed by.
_READ = (IDS, RESOURCE_TYPE, CORES, DEVS, CONTAINER_IDS, NODE, ALLOCATED)
# The pod watch shows a pod's annotations again at each change of the pod (the bind's patch, the
# pod bound, each status change): a set is decoded once. Any pod may carry such a set, so only
# sets that name their cores and devices (ours always do: derived ones can be many times the
# text) and are short (ours for a whole trn2 node in cores: ~1,300 characters) are kept; what one
# of them decodes to is then at most ~20 KB, and the memo at most ~10 MB.
_MEMO_TEXT = 1536
_MEMO_SIZE = 512


def decode(
    annotations: Mapping[str, str], cores_per_device: int | None = None
) -> Assignment | None:
    """Our assignment from a pod's annotations; None when the pod has none of ours.

    `NEURON_CORES` is authoritative for which cores are held; when it is missing (a pod annotated by
    the upstream extension), cores are derived from `AWS_NEURON_IDS` and `cores_per_device`.
    The same annotations give the same Assignment, shared: its `containers` is not to be changed.
    """
    if IDS not in annotations:
        return None
    texts = tuple(map(annotations.get, _READ))
    if (
        CORES not in annotations
        or DEVS not in annotations
        or sum(len(text) for text in texts if text is not None) > _MEMO_TEXT
    ):
        return _decode(annotations, cores_per_device)
    found = _MEMO.pop(texts, None)
    if found is None:
        read = {key: text for key, text in zip(_READ, texts, strict=True) if text is not None}
        found = _decode(read, cores_per_device)
    _remember(texts, found)
    return found


# Decoded sets by their texts, least recently used first. With `NEURON_CORES` and `NEURON_DEVS`
# present (the only sets kept) the cores per device are never read, so they are not in the key.
# Every text decode reads is in the key: a pod's annotations can push others' out, never change
# what they decode to. Used from one thread (each process's event loop), unlike lru_cache it is
# not safe to share between threads.
_MEMO: dict[tuple[str | None, ...], Assignment] = {}


def _remember(texts: tuple[str | None, ...], found: Assignment) -> None:
    _MEMO.pop(texts, None)
    if len(_MEMO) >= _MEMO_SIZE:
        _MEMO.pop(next(iter(_MEMO)), None)
    _MEMO[texts] = found


def _decode(annotations: Mapping[str, str], cores_per_device: int | None) -> Assignment:
    resource = annotations.get(RESOURCE_TYPE) or "aws.amazon.com/neuron"
    if resource not in RESOURCE_UNITS:
        raise AnnotationError(f"{RESOURCE_TYPE}={resource!r} is not a Neuron resource")
    ids = _parse(annotations[IDS], IDS)
    unit = RESOURCE_UNITS[resource]
    # Derived only when the key is missing: `ids` may be many and large before they are checked.
    cores = _read_or_derive(
        annotations,
        CORES,
        lambda: ids if unit is Unit.CORE else cores_of_devices(ids, cores_per_device or 0),
        unit is Unit.CORE or bool(cores_per_device),
    )
    devices = _read_or_derive(
        annotations,
        DEVS,
        lambda: ids if unit is Unit.DEVICE else devices_of_cores(cores, cores_per_device or 1),
        unit is Unit.DEVICE or bool(cores_per_device),
    )
    containers: dict[str, tuple[int, ...]] = {}
    if CONTAINER_IDS in annotations:
        if len(annotations[CONTAINER_IDS]) > _MAX_CONTAINER_TEXT:
            raise AnnotationError(f"{CONTAINER_IDS} is too long")
        # Decoded to its one shape, which refuses a nested value where it starts: a generic
        # decode recursed into 64 KiB of "[" and raised RecursionError, which no reader of a
        # pod's annotations expects (one such pod failed every Allocate on its node).
        try:
            raw = _CONTAINER_SLICES.decode(annotations[CONTAINER_IDS])
        except msgspec.ValidationError:
            raise AnnotationError(f"{CONTAINER_IDS} must map container names to id lists") from None
        except msgspec.DecodeError:
            raise AnnotationError(f"{CONTAINER_IDS} is not JSON") from None
        containers = {k: _parse(v, CONTAINER_IDS) for k, v in raw.items()}
    return Assignment(
        node=annotations.get(NODE, ""),
        resource=resource,
        ids=ids,
        cores=cores,
        devices=devices,
        containers=containers,
        allocated=annotations.get(ALLOCATED, "false").lower() == "true",
    )
