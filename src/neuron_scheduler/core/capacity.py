"""Capacity requests as the cluster sees them: the placeholder pod that asks an autoscaler for a
node, and the instance type it asks for. Pure.

A pod stranded by fragmentation fits an existing node by count, so an autoscaler (Karpenter,
cluster-autoscaler) adds no node for it (aws/karpenter-provider-aws#7265). A placeholder does what
the pod cannot: it asks for a whole node of the smallest instance type that can hold the pod's
block, so no existing node fits it by count and the autoscaler adds one. Its priority is the
lowest that still triggers a scale-up (cluster-autoscaler's `--expendable-pods-priority-cutoff`,
-10 by default; Karpenter ignores priority), its scheduler is one nobody serves (it is never
bound), and it lives in the extender's own namespace (no user's ResourceQuota counts or refuses
it). docs/autoscaling.md.

The placeholder carries `RECORD_ANNOTATION` (JSON): the pod it is for, the instance type, when it
was asked for and until when it waits. Read from the API, so untrusted: bounded, and anything
malformed is PlaceholderError (the leader then removes the placeholder).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from neuron_scheduler.core.allocation import NodeState, Placement, Policy, allocate
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import RESOURCE_UNITS, NeuronRequest, Unit
from neuron_scheduler.core.topology import MAX_CORES, Topology

# A placeholder has this label (its value: the extender that made it, `--capacity-owner`), this
# schedulerName (served by no scheduler) and no node. Nothing else is one.
PLACEHOLDER_LABEL = "neuron-scheduler.io/capacity-request"
PLACEHOLDER_SCHEDULER = "neuron-scheduler-capacity-request"
RECORD_ANNOTATION = "neuron-scheduler.io/capacity-request"
# The chart's PriorityClass: value -10, preemptionPolicy Never.
PRIORITY_CLASS = "neuron-scheduler-capacity-request"
PLACEHOLDER_PRIORITY = -10
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
MAX_TEXT = 320


class PlaceholderError(ValueError):
    """A placeholder's record this version cannot read."""


@dataclass(frozen=True, slots=True)
class Asked:
    """What one placeholder asks for, and for whom."""

    pod: str  # namespace/name of the pending pod
    uid: str  # its uid
    instance_type: str
    request: NeuronRequest  # the pending pod's
    asked: float  # wall clock
    until: float  # it is removed then, if no node came


class _Record(msgspec.Struct, forbid_unknown_fields=False):
    v: int
    pod: str
    uid: str
    instance_type: str
    resource: str
    count: int
    asked: float
    until: float


VERSION = 1


def encode(asked: Asked) -> str:
    return msgspec.json.encode(
        _Record(
            VERSION,
            asked.pod,
            asked.uid,
            asked.instance_type,
            asked.request.resource,
            asked.request.count,
            round(asked.asked, 3),
            round(asked.until, 3),
        )
    ).decode()


def decode(text: str) -> Asked:
    if len(text) > 4096:
        raise PlaceholderError("the record is over 4 KiB")
    try:
        raw = msgspec.json.decode(text, type=_Record)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as error:
        raise PlaceholderError(f"not a capacity request: {error}") from error
    if raw.v != VERSION:
        raise PlaceholderError(f"record version {raw.v}, not {VERSION}")
    if raw.resource not in RESOURCE_UNITS or not 0 < raw.count <= MAX_CORES:
        raise PlaceholderError(f"bad request {raw.resource[:40]}: {raw.count}")
    if not raw.until > raw.asked > 0:
        raise PlaceholderError("the record's times are not in order")
    for value in (raw.pod, raw.uid, raw.instance_type):
        if not value or len(value) > MAX_TEXT or not value.isprintable():
            raise PlaceholderError(f"bad name {value[:40]!r}")
    return Asked(
        raw.pod,
        raw.uid,
        raw.instance_type,
        NeuronRequest(raw.resource, raw.count),
        raw.asked,
        raw.until,
    )


def holds_block(topology: Topology, request: NeuronRequest, policy: Policy) -> bool:
    """An empty node of this topology has an allowed block for the request."""
    return isinstance(allocate(topology, NodeState(), request, policy), Placement)


def smallest_type(
    catalog: Catalog,
    request: NeuronRequest,
    candidates: Iterable[str],
    policy: Policy = Policy.BEST_FIT,
) -> Topology | None:
    """The smallest instance type among `candidates` (fewest devices, then cores, then name)
    whose empty node holds the request's block; None when none does. Types the catalog does not
    fix (switches, unknown names) are left out: their size is only known from a node."""
    found: list[Topology] = []
    for name in set(candidates):
        if not catalog.knows(name) or catalog.device_count(name) is None:
            continue
        topology = catalog.resolve(name).topology
        if holds_block(topology, request, policy):
            found.append(topology)
    if not found:
        return None
    return min(found, key=lambda t: (t.devices, t.total_cores, t.instance_type))


def whole_node(topology: Topology, request: NeuronRequest) -> int:
    """What a placeholder asks for, in the request's resource: the whole node, so no existing node
    with anything on it fits it by count."""
    return topology.devices if request.unit is Unit.DEVICE else topology.total_cores
