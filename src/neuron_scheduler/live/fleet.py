"""The fleet as the extender's ledger sees it. Pure: a fed ledger goes in, values come out.

Per node: who holds which ids, what is free, the largest free block: what the allocator would still
give (`core.allocation.free_devices`, `largest_free_block`; the extender's metrics read the same),
so cores held by pods of unknown ids count against them. Per request size: how
many nodes the allocator would give one to now, and how many allow that size at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    Policy,
    check_request,
    free_devices,
    largest_free_block,
)
from neuron_scheduler.core.ids import devices_of_cores, mask_ids
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.extender.state.ledger import Ledger, Nomination, Unusable

# The request sizes the fleet summary asks about: every device count a torus allows (and 2, which
# rings and chains allow), and the usual core counts.
DEVICE_SIZES = (1, 2, 4, 8, 16)
CORE_SIZES = (1, 2, 4, 8, 16, 32)
SUMMARY_REQUESTS = tuple(NeuronRequest(NEURON, n) for n in DEVICE_SIZES) + tuple(
    NeuronRequest(NEURONCORE, n) for n in CORE_SIZES
)


JSON_VERSION = 1


@dataclass(frozen=True, slots=True)
class PodIds:
    """A pod's ids on its node, from our annotations."""

    pod: str  # namespace/name
    unit: Unit
    devices: tuple[int, ...]
    cores: tuple[int, ...]
    priority: int
    terminating: bool
    failed: tuple[int, ...] = ()  # its devices its node reports failed: it runs on without them

    @property
    def ids(self) -> tuple[int, ...]:
        """In the pod's unit, as its AWS_NEURON_IDS annotation."""
        return self.devices if self.unit is Unit.DEVICE else self.cores


@dataclass(frozen=True, slots=True)
class PodCount:
    """A pod whose ids are unknown (placed without neuron-scheduler, or annotations that could
    not be its own): its size stays held somewhere on the node."""

    pod: str
    unit: Unit
    count: int


@dataclass(frozen=True, slots=True)
class NodeView:
    name: str
    topology: Topology
    used_cores: int  # mask, as the allocator sees it (failed devices' cores included)
    unattributed_cores: int  # cores held somewhere without known ids (pods, withheld capacity)
    withheld_cores: int  # capacity the node does not offer beyond its failed devices
    unhealthy_devices: int  # mask: devices its device plugin reports failed; never free
    # Cores of failed devices that running pods still request: counted once more, in count, as
    # kube-scheduler counts them (part of unattributed_cores).
    failed_cores_requested: int
    pods: tuple[PodIds, ...]  # by first core
    unknown: tuple[PodCount, ...]
    # In use but no bound pod's: blocks held for pods nominated here, ids of binds in flight,
    # ids of pods set aside as they overlap another claim (listed in `unknown`) (failed devices
    # are not held: they are `unhealthy_devices`).
    held_cores: int
    nominated: tuple[str, ...]  # pods preemption nominated to this node, waiting for it
    planned: tuple[str, ...]  # what consolidation plans hold here: a pod's block, or a place
    warning: str | None  # e.g. an instance type the catalog does not know

    @property
    def state(self) -> NodeState:
        return NodeState(self.used_cores, self.unattributed_cores)

    @property
    def free_devices(self) -> int:
        return free_devices(self.topology, self.state)

    @property
    def free_cores(self) -> int:
        total = self.topology.total_cores
        return max(total - self.used_cores.bit_count() - self.unattributed_cores, 0)

    @property
    def largest_free_block(self) -> int:
        return largest_free_block(self.topology, self.state)


@dataclass(frozen=True, slots=True)
class Capacity:
    request: NeuronRequest
    now: int  # nodes the allocator would place one on now
    allowed: int  # nodes that allow this size at all (an empty one would take it)


@dataclass(frozen=True, slots=True)
class Fleet:
    nodes: tuple[NodeView, ...]
    unusable: tuple[tuple[str, Unusable], ...]
    capacity: tuple[Capacity, ...]
    other_nodes: int  # nodes that advertise no Neuron resources

    @property
    def fragmentation(self) -> float:
        """Share of free devices that a request could not get in one block with the others on
        their node (the simulator's definition): 0 when every node's free devices are one
        block."""
        free = sum(n.free_devices for n in self.nodes)
        stranded = sum(n.free_devices - n.largest_free_block for n in self.nodes)
        return stranded / free if free else 0.0


def node_view(ledger: Ledger, name: str) -> NodeView:
    entry = ledger.nodes[name]
    topology = entry.topology
    state = ledger.state(name)
    pods: list[PodIds] = []
    unknown: list[PodCount] = []
    attributed = entry.unhealthy_cores
    failed = mask_ids(entry.unhealthy_devices)
    requested = 0
    aside = ledger.set_aside(name)
    for uid, holding in ledger.pods_holding(name).items():
        key = ledger.pod_key(uid)
        if holding.ours and not holding.cores >> topology.total_cores and uid not in aside:
            cores = tuple(mask_ids(holding.cores))
            devices = devices_of_cores(cores, topology.cores_per_device)
            unit = holding.unknown_unit
            on_failed = tuple(d for d in devices if d in failed)
            pods.append(
                PodIds(key, unit, devices, cores, holding.priority, holding.terminating, on_failed)
            )
            attributed |= holding.cores
            requested += (holding.cores & entry.unhealthy_cores).bit_count()
        else:
            unknown.append(PodCount(key, holding.unknown_unit, holding.unknown_count))
    nominated = sorted(
        ledger.pod_key(key) for key, n in ledger.holds() if n.node == name and not n.reason
    )
    planned = sorted(
        held_for(ledger, key, n) for key, n in ledger.holds() if n.node == name and n.reason
    )
    return NodeView(
        name=name,
        topology=topology,
        used_cores=state.used_cores,
        unattributed_cores=state.unattributed_cores,
        withheld_cores=entry.withheld_cores,
        unhealthy_devices=entry.unhealthy_devices,
        failed_cores_requested=requested,
        pods=tuple(sorted(pods, key=lambda p: (p.cores[:1], p.pod))),
        unknown=tuple(sorted(unknown, key=lambda p: p.pod)),
        held_cores=state.used_cores & ~attributed,
        nominated=tuple(nominated),
        planned=tuple(planned),
        warning=entry.warning,
    )


def held_for(ledger: Ledger, key: str, held: Nomination) -> str:
    """Whom a consolidation plan's hold is for: its pod (namespace/name), or `replacement of
    namespace/name` for a moved pod's place."""
    if held.owner:
        moved = held.reason.removeprefix("held for the replacement of ").split(" ", 1)[0]
        return f"replacement of {moved}"
    return ledger.pod_key(key)


def fleet_view(
    ledger: Ledger,
    names: Iterable[str] | None = None,
    other_nodes: int = 0,
    policy: Policy = Policy.BEST_FIT,
) -> Fleet:
    """The named nodes (default: every Neuron node, usable or not), in name order."""
    wanted = sorted(set(names) if names is not None else {*ledger.nodes, *ledger.unusable})
    usable = [n for n in wanted if n in ledger.nodes]
    capacity = []
    for request in SUMMARY_REQUESTS:
        verdicts = ledger.fill_verdicts(usable, request, policy)
        now = sum(1 for n in usable if isinstance(verdicts.decisions.get(n), Placement))
        allowed = sum(1 for n in usable if check_request(ledger.nodes[n].topology, request) is None)
        capacity.append(Capacity(request, now, allowed))
    return Fleet(
        nodes=tuple(node_view(ledger, n) for n in usable),
        unusable=tuple((n, ledger.unusable[n]) for n in wanted if n in ledger.unusable),
        capacity=tuple(capacity),
        other_nodes=other_nodes,
    )


def fleet_json(fleet: Fleet) -> dict[str, Any]:
    """What `status --json` prints: ids as lists, in the annotations' units. Its fields are
    documented in docs/operations.md; JSON_VERSION changes when one changes meaning or goes."""
    return {
        "version": JSON_VERSION,
        "nodes": [_node_json(n) for n in fleet.nodes],
        "unusable_nodes": [
            {"name": name, "code": u.code, "reason": u.reason} for name, u in fleet.unusable
        ],
        "summary": {
            "nodes": len(fleet.nodes),
            "unusable_nodes": len(fleet.unusable),
            "nodes_without_neuron": fleet.other_nodes,
            "devices": sum(n.topology.devices for n in fleet.nodes),
            "unhealthy_devices": sum(n.unhealthy_devices.bit_count() for n in fleet.nodes),
            "pods_on_unhealthy_devices": sum(1 for n in fleet.nodes for p in n.pods if p.failed),
            "free_devices": sum(n.free_devices for n in fleet.nodes),
            "cores": sum(n.topology.total_cores for n in fleet.nodes),
            "free_cores": sum(n.free_cores for n in fleet.nodes),
            "fragmentation": round(fleet.fragmentation, 4),
            "could_take_one_now": [
                {
                    "resource": c.request.resource,
                    "count": c.request.count,
                    "nodes_now": c.now,
                    "nodes_allowing": c.allowed,
                }
                for c in fleet.capacity
            ],
        },
    }


def _node_json(node: NodeView) -> dict[str, Any]:
    topology = node.topology
    held = mask_ids(node.held_cores)
    return {
        "name": node.name,
        "instance_type": topology.instance_type,
        "topology": topology.kind.value,
        "devices": topology.devices,
        "cores_per_device": topology.cores_per_device,
        "free_devices": node.free_devices,
        "free_cores": node.free_cores,
        "largest_free_block": node.largest_free_block,
        "unattributed_cores": node.unattributed_cores,
        "withheld_cores": node.withheld_cores,
        "unhealthy_devices": mask_ids(node.unhealthy_devices),
        "failed_cores_requested": node.failed_cores_requested,
        "pods": [
            {
                "pod": p.pod,
                "unit": p.unit.value,
                "ids": list(p.ids),
                "devices": list(p.devices),
                "cores": list(p.cores),
                "priority": p.priority,
                "terminating": p.terminating,
                "on_unhealthy_devices": list(p.failed),
            }
            for p in node.pods
        ],
        "ids_unknown": [
            {"pod": p.pod, "unit": p.unit.value, "count": p.count} for p in node.unknown
        ],
        "held": {
            "cores": held,
            "devices": list(devices_of_cores(held, topology.cores_per_device)),
            "nominated_pods": list(node.nominated),
            "consolidation": list(node.planned),
        },
        "warning": node.warning,
    }
