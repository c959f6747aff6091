"""Why a pending pod is not placed: each Neuron node's answer, from the extender's own rules.
Pure: a fed ledger and the pod go in, a diagnosis comes out.

Per node, in the order kube-scheduler and the extender apply them: a node whose Neuron capacity
cannot be right is unusable; the pod's own nodeSelector, required node affinity and tolerations
keep it off others (kube-scheduler filters those before asking the extender); then the allocator
decides on the node as the pod sees it (blocks held for pods nominated by preemption count
against it unless their priority is lower); on the nodes it fits, the extender's node filter
(the training-job rule: a training job's members go where its claim is) has the last word.
Where the refusal can be resolved, it says what would have to be freed: the pods holding the
cheapest allowed block, whatever their priority (what blocks it), and what the preempt verb
would evict for this pod's priority (core/eviction, with the same view of the node as the verb;
disruption budgets are not read here).

A pod with scheduling gates is held back by whoever set them (Kueue, until it admits the pod's
Workload): kube-scheduler does not try it, and the extender reserves, plans and asks for nothing
for it. The diagnosis names the gates (for Kueue's, its Workload and LocalQueue) and gives each
node's answer as it would be once they are gone.

A pod that no node fits while some have its count free is stranded by fragmentation: the case
kube-scheduler's preemption cannot help on 1.36 and consolidation is for. Then the diagnosis
says what consolidation does for it: the plan in flight (its pod's annotation), or what a plan
would move now (extender/loops/movers, disruption budgets not read), or why nothing may move;
and what capacity requests do for it (docs/autoscaling.md): the placeholder asking the
autoscaler for a node, the block held on a node that came, or what would be asked for.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from neuron_scheduler.core.allocation import Placement, Policy, Refusal, allocate
from neuron_scheduler.core.capacity import whole_node
from neuron_scheduler.core.catalog import CapacityError, Catalog
from neuron_scheduler.core.consolidation import fits_by_count
from neuron_scheduler.core.eviction import Eviction, Occupant, plan_eviction
from neuron_scheduler.core.handoff import AnnotationError, beyond_request, misfit
from neuron_scheduler.core.health import HealthError
from neuron_scheduler.core.ids import format_ids
from neuron_scheduler.core.planrecord import PlanKind
from neuron_scheduler.core.resources import RESOURCE_UNITS, NeuronRequest, RequestError
from neuron_scheduler.core.topology import Topology, TopologyKind
from neuron_scheduler.extender.loops.movers import Admits, anywhere, plan_for
from neuron_scheduler.extender.loops.requesting import asked_type
from neuron_scheduler.extender.state.budgets import DisruptionBudgets
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.extender.state.members import member_fit
from neuron_scheduler.extender.state.movability import Movability, gang_of
from neuron_scheduler.extender.state.placeholders import Placeholders
from neuron_scheduler.extender.state.plans import Plans
from neuron_scheduler.jobs.members import MembershipError, member_of
from neuron_scheduler.jobs.network import closeness_of
from neuron_scheduler.jobs.placement import Occupancy, Shortfall, UnitPlacement, job_progress, plan
from neuron_scheduler.jobs.units import NodeConfigError, pod_node_config
from neuron_scheduler.kube.nodefit import why_not
from neuron_scheduler.kube.objects import Node, Pod
from neuron_scheduler.kube.reading import (
    Gating,
    assignment,
    gated,
    gating,
    neuron_request,
    node_topology,
    unhealthy_devices,
)
from neuron_scheduler.live.fleet import JSON_VERSION
from neuron_scheduler.live.workloadstatus import WorkloadReport, report_json

# Above every PriorityClass value (int32): every pod on the node counts as evictable.
ANY_PRIORITY = 2**31


class NotPending(ValueError):
    """A pod `why` has nothing to say about: bound, finished, or asking for no Neuron resource."""


class Verdict(StrEnum):
    FITS = "fits"  # its devices fit now: it waits for something else
    UNIT_RULE = "unit_rule"  # its devices fit, but the training-job unit rule keeps it off
    BLOCKED = "blocked"  # pods (or held blocks) are in the way
    NEVER = "never"  # no amount of freeing helps: a size the node does not allow, too big
    EXCLUDED = "excluded"  # its own nodeSelector, affinity or tolerations keep it off
    UNUSABLE = "unusable"  # the node's Neuron capacity cannot be right


ORDER = list(Verdict)


@dataclass(frozen=True, slots=True)
class Freeing:
    """Pods whose leaving frees an allowed block, and the block."""

    pods: tuple[str, ...]  # namespace/name, by first id held on the node
    holders: tuple[str, ...]  # those of them holding ids in the block
    unknown: tuple[str, ...]  # those whose ids are unknown: their size must go somewhere
    devices: tuple[int, ...]
    cores: tuple[int, ...]
    where: str  # "row 2", "rows 0-1", or "" when the ids say it all


@dataclass(frozen=True, slots=True)
class NodeDiagnosis:
    node: str
    instance_type: str
    verdict: Verdict
    reason: str
    placement: Placement | None = None  # FITS: what it would get
    blocking: Freeing | None = None  # BLOCKED: the cheapest pods to free, any priority
    preemption: Freeing | None = None  # BLOCKED: what the preempt verb would evict for it
    by_count: bool = False  # BLOCKED: its count is free here, in no allowed block


@dataclass(frozen=True, slots=True)
class Diagnosis:
    pod: str
    request: NeuronRequest | None
    request_error: str | None  # a request no node can serve as written
    priority: int
    scheduler: str
    nominated_node: str
    nodes: tuple[NodeDiagnosis, ...]  # the closest to fitting first
    other_nodes: int  # nodes with no Neuron resources (never candidates)
    consolidation: str = ""  # when stranded by fragmentation: its plan, or what one would do
    capacity: str = ""  # when stranded: the node asked for, held, or that would be asked for
    # A member of a training job: its job's claim and members bound, or why it has no claim.
    job: str = ""
    # Its scheduling gates (Kueue's, with its Workload and LocalQueue): kube-scheduler does not
    # try it, and the extender does nothing for it, until they are gone.
    gating: Gating | None = None
    # For a pod gated by Kueue: what its Workload says (quota, admission checks), when `why`
    # read it (diagnose does no I/O).
    workload: WorkloadReport | None = None

    def count(self, verdict: Verdict) -> int:
        return sum(1 for n in self.nodes if n.verdict is verdict)

    @property
    def stranded(self) -> tuple[str, ...]:
        """The nodes with its count free in no allowed block, when none fits it: it waits only
        for fragmentation (the case for consolidation)."""
        if self.count(Verdict.FITS) or self.count(Verdict.UNIT_RULE):
            return ()
        return tuple(n.node for n in self.nodes if n.by_count)


def failed_devices_of(pod: Pod, node: Node, catalog: Catalog) -> tuple[int, ...]:
    """The devices among a bound pod's annotated ids that its node's device plugin reports
    failed: it runs on without them. Empty when either cannot be read."""
    try:
        resolved = node_topology(node, catalog)
        if resolved is None:
            return ()
        topology = resolved.topology
        failed = unhealthy_devices(node, topology)
        found = assignment(pod, topology.cores_per_device) if failed else None
        request = neuron_request(pod) if found is not None else None
    except (CapacityError, HealthError, AnnotationError, RequestError):
        return ()
    # Ids the ledger and the device plugin would not use (any pod's creator may write them).
    if (
        found is None
        or request is None
        or misfit(found, topology) is not None
        or beyond_request(found, request) is not None
    ):
        return ()
    return tuple(d for d in found.devices if failed >> d & 1)


def on_failed_devices_text(pod: Pod, failed: tuple[int, ...]) -> str:
    return (
        f"pod {pod.key} runs on node {pod.spec.nodeName} with failed device "
        f"{format_ids(list(failed))} (its device plugin reports it unhealthy; the pod keeps "
        'running without it: docs/operations.md, "When a device fails")'
    )


def pending_request(pod: Pod) -> NeuronRequest | None:
    """The pod's Neuron request when `why` can answer for it; None when the request can never be
    served as written (the diagnosis says why). NotPending otherwise."""
    if pod.spec.nodeName:
        raise NotPending(f"pod {pod.key} is not pending: it is bound to node {pod.spec.nodeName}")
    if pod.finished:
        raise NotPending(f"pod {pod.key} is not pending: it has {pod.status.phase.lower()}")
    try:
        request = neuron_request(pod)
    except RequestError:
        return None
    if request is None:
        names = ", ".join(sorted(RESOURCE_UNITS))
        if pod.spec.resourceClaims:  # the DRA path: the commands say what our driver publishes
            raise NotPending(f"pod {pod.key} requests no Neuron resources ({names})")
        raise NotPending(
            f"pod {pod.key} requests no Neuron resources ({names}); neuron-scheduler has no part "
            "in placing it"
        )
    return request


def diagnose(
    ledger: Ledger,
    pod: Pod,
    other_nodes: int = 0,
    policy: Policy = Policy.BEST_FIT,
    occupancy: Occupancy | None = None,
    plans: Plans | None = None,
    movability: Movability | None = None,
    placeholders: Placeholders | None = None,
    catalog: Catalog | None = None,
    now: float = 0.0,
) -> Diagnosis:
    """Every Neuron node's answer for the pod (the ledger and the occupancy hold the cluster,
    this pod too; with `plans` and `movability`, what consolidation does for it; with
    `placeholders` and `catalog` too, what capacity requests do; `now`: wall clock, for how
    long a training job's claim has held its units)."""
    request = pending_request(pod)
    error = None
    if request is None:
        try:
            neuron_request(pod)
        except RequestError as problem:
            error = str(problem)
    nodes: list[NodeDiagnosis] = []
    if request is not None:
        claimant = Claimant.of(pod, request)
        for name in sorted({*ledger.nodes, *ledger.unusable}):
            nodes.append(_node(ledger, pod, claimant, request, name, policy))
    if occupancy is not None:
        nodes = _unit_rule(ledger, occupancy, pod, nodes, policy)
    nodes.sort(key=_closeness)
    diagnosis = Diagnosis(
        pod=pod.key,
        request=request,
        request_error=error,
        priority=pod.spec.priority or 0,
        scheduler=pod.spec.schedulerName,
        nominated_node=pod.status.nominatedNodeName,
        nodes=tuple(nodes),
        other_nodes=other_nodes,
        job=_job(occupancy, pod, now) if occupancy is not None else "",
        gating=gating(pod),
    )
    if diagnosis.gating is not None:
        # Not pending for the extender: no claim, plan or node asked for until the gates go.
        return dataclasses.replace(diagnosis, job=_gated_job(pod))
    if request is None or plans is None or movability is None:
        return diagnosis
    active = plans.plans.get(pod.metadata.uid)
    if active is not None and not active.ended and active.record.kind is PlanKind.CAPACITY:
        held = f"held for it: {active.record.summary}, until it is bound"
        return dataclasses.replace(diagnosis, capacity=held)
    admits = anywhere if occupancy is None else _unit_admits(UnitPlacement(occupancy))
    # Every node it may go to where pods are in the way, not only those with its count free:
    # moving one pod off a node may free a block there (extender/loops/movers).
    blocked = tuple(
        n.node for n in diagnosis.nodes if n.verdict is Verdict.BLOCKED and admits(pod, n.node)
    )
    if active is not None and not active.ended:  # (its own plan's places count against it)
        text = f"a plan is in flight: evicting {active.record.summary}"
    elif diagnosis.stranded:
        text = _consolidation(ledger, pod, request, blocked, movability, policy, admits)
    else:
        return diagnosis
    capacity = ""
    if diagnosis.stranded and placeholders is not None and catalog is not None:
        types = {n.instance_type for n in diagnosis.nodes if n.node in blocked and n.instance_type}
        capacity = _capacity(pod, request, placeholders, catalog, types, policy, text)
    return dataclasses.replace(diagnosis, consolidation=text, capacity=capacity)


def _capacity(
    pod: Pod,
    request: NeuronRequest,
    placeholders: Placeholders,
    catalog: Catalog,
    types: set[str],
    policy: Policy,
    consolidation: str,
) -> str:
    """The node asked for (its placeholder), or what a capacity request would ask for."""
    asked = placeholders.for_pod(pod.metadata.uid)
    if asked:
        first = asked[0]
        assert first.asked is not None
        return (
            f"a node of {first.asked.instance_type} is asked of the cluster's autoscaler "
            f"(placeholder {first.key}, asked {time.time() - first.asked.asked:.0f}s ago)"
        )
    if consolidation.startswith("a plan "):
        return ""  # consolidation can help: no node is asked for
    topology = asked_type(catalog, pod, request, types, policy)
    if topology is None:
        return (
            f"no instance type it may go to ({', '.join(sorted(types)) or 'none'}) holds "
            "its block: no node would be asked for"
        )
    whole = whole_node(topology, request)
    return (
        f"a capacity request would ask the cluster's autoscaler for a node of "
        f"{topology.instance_type} (a placeholder asking for {whole} {request.resource}), "
        "when scheduler.capacityRequests.mode is on and consolidation has no plan for it "
        "(docs/autoscaling.md)"
    )


def _consolidation(
    ledger: Ledger,
    pod: Pod,
    request: NeuronRequest,
    nodes: tuple[str, ...],
    movability: Movability,
    policy: Policy,
    admits: Admits,
) -> str:
    gang = gang_of(pod)
    if gang:
        return f"none: it is {gang} (a job moves whole, not done yet)"
    planned = plan_for(
        ledger,
        movability,
        DisruptionBudgets(),
        pod,
        request,
        nodes,
        policy,
        admits=admits,
    )
    if planned.move is not None:
        names = ", ".join(movability.pods[uid].key for uid in planned.move.victims)
        devices = format_ids(list(planned.move.block.devices))
        return (
            f"a plan would evict {names} from node {planned.move.node} to free devices "
            f"{devices} (disruption budgets not read here)"
        )
    reasons = "; ".join(f"{r.node}: {r.reason}" for r in planned.refusals[:3])
    return f"no pods may be moved: {reasons}"


def _unit_admits(units: UnitPlacement) -> Admits:
    """The training-job rule as consolidation's planner asks it (its claims are the snapshot's)."""
    return lambda pod, node: units.admits(pod, node, 0.0)


def _unit_rule(
    ledger: Ledger, occupancy: Occupancy, pod: Pod, nodes: list[NodeDiagnosis], policy: Policy
) -> list[NodeDiagnosis]:
    """The extender's node filter on the nodes the allocator lets the pod have: a training
    job's member goes only where its job's claim is (read from the UltraServerClaims); without one,
    why the reservation loop cannot make one now."""
    fits = [n.node for n in nodes if n.verdict is Verdict.FITS]
    try:
        member = member_of(pod)
        config = pod_node_config(pod)
    except (MembershipError, NodeConfigError):
        member = None
    if member is not None and not occupancy.complete(member.job) and not gated(pod):
        size = max(occupancy.size(member, member.job), 1)  # this pod, at least
        fit = member_fit(ledger, pod, policy)
        planned = plan(occupancy, member.job, config, size, fit, closeness_of(pod))
        occupancy.shortfalls[member.job] = (
            planned.reason
            if isinstance(planned, Shortfall)
            else f"job {member.text} fits now ({planned.where}): the extender reserves them "
            "for all its members at once, then they are retried"
        )
    _, refused = UnitPlacement(occupancy).filter(pod, fits, now=0.0)
    return [
        dataclasses.replace(n, verdict=Verdict.UNIT_RULE, reason=refused[n.node], placement=None)
        if n.node in refused
        else n
        for n in nodes
    ]


def _job(occupancy: Occupancy, pod: Pod, now: float) -> str:
    """For a member of a training job: how far its claim is (members bound of its size, the
    units it holds), or why it has none (what `_unit_rule` worked out, "can never run here"
    included), even when every node is full and no node reaches the unit rule."""
    try:
        member = member_of(pod)
    except MembershipError:
        return ""
    if member is None:
        return ""
    return job_progress(occupancy, member.job, now) or occupancy.shortfalls.get(member.job, "")


def _gated_job(pod: Pod) -> str:
    """For a gated member of a training job: that nothing is reserved for its job yet."""
    try:
        member = member_of(pod)
    except MembershipError:
        return ""
    if member is None:
        return ""
    return (
        f"job {member.text}: nothing is reserved for it while its members are gated; once the "
        "gates are removed, the extender reserves UltraServer units for all its members at once"
    )


def _closeness(node: NodeDiagnosis) -> tuple[int, int, str]:
    """Fits first, then the fewest pods to free, then the rest by verdict; by name within."""
    pods = len(node.blocking.pods) if node.blocking else sys.maxsize
    return (ORDER.index(node.verdict), pods, node.node)


def _node(
    ledger: Ledger,
    pod: Pod,
    claimant: Claimant,
    request: NeuronRequest,
    name: str,
    policy: Policy,
) -> NodeDiagnosis:
    unusable = ledger.unusable.get(name)
    entry = ledger.nodes.get(name)
    if unusable is not None or entry is None:
        reason = unusable.reason if unusable else "not read"
        return NodeDiagnosis(
            name, "", Verdict.UNUSABLE, f"node is unusable for Neuron pods: {reason}"
        )
    topology = entry.topology
    instance_type = topology.instance_type
    facts = ledger.facts.get(name)
    excluded = why_not(pod, facts) if facts is not None else None
    if excluded is not None:
        return NodeDiagnosis(name, instance_type, Verdict.EXCLUDED, excluded)
    decision = allocate(topology, ledger.state_for(claimant, name), request, policy)
    if isinstance(decision, Refusal):
        decision = ledger.failed_devices_refusal(name, request, decision)
    if isinstance(decision, Placement):
        return NodeDiagnosis(
            name,
            instance_type,
            Verdict.FITS,
            f"devices {format_ids(list(decision.devices))} are free for it",
            placement=decision,
        )
    if decision.unresolvable:
        return NodeDiagnosis(name, instance_type, Verdict.NEVER, decision.reason)
    held = ledger.hold_reason(claimant, name, request, policy)
    base, occupants = ledger.eviction_view(claimant, name)
    blocking = plan_eviction(topology, base, request, ANY_PRIORITY, occupants, policy=policy)
    preemption = plan_eviction(
        topology, base, request, pod.spec.priority or 0, occupants, policy=policy
    )
    return NodeDiagnosis(
        name,
        instance_type,
        Verdict.BLOCKED,
        held or decision.reason,
        blocking=_freeing(ledger, topology, occupants, blocking),
        preemption=_freeing(ledger, topology, occupants, preemption),
        by_count=fits_by_count(topology, ledger.state_for(claimant, name), request),
    )


def _freeing(
    ledger: Ledger,
    topology: Topology,
    occupants: Mapping[str, Occupant],
    eviction: Eviction | None,
) -> Freeing | None:
    if eviction is None:
        return None
    block = eviction.block
    mask = block.core_mask
    # In the order of their ids on the node (those of unknown ids last), as the map shows them.
    victims = sorted(
        eviction.victims, key=lambda uid: _first_core(occupants[uid].cores, ledger.pod_key(uid))
    )
    return Freeing(
        pods=tuple(ledger.pod_key(uid) for uid in victims),
        holders=tuple(ledger.pod_key(uid) for uid in victims if occupants[uid].cores & mask),
        unknown=tuple(ledger.pod_key(uid) for uid in victims if occupants[uid].unknown_cores),
        devices=tuple(sorted(block.devices)),
        cores=tuple(sorted(block.cores)),
        where=block_place(topology, block.devices),
    )


def _first_core(cores: int, key: str) -> tuple[int, str]:
    return ((cores & -cores).bit_length() - 1 if cores else sys.maxsize, key)


def block_place(topology: Topology, devices: tuple[int, ...] | list[int]) -> str:
    """Where a block is on a torus, when it is whole rows of the grid: `row 2`, `rows 0-1`."""
    if topology.kind is not TopologyKind.TORUS or not devices:
        return ""
    side = math.isqrt(topology.devices)
    if side < 2 or side * side != topology.devices:
        return ""
    rows = sorted({d // side for d in devices})
    if len(devices) != len(rows) * side:
        return ""
    if len(rows) == 1:
        return f"row {rows[0]}"
    if rows == list(range(rows[0], rows[-1] + 1)):
        return f"rows {rows[0]}-{rows[-1]}"
    return f"rows {format_ids(rows)}"


def freeing_text(freeing: Freeing, name: Callable[[str], str] = str) -> str:
    """`rows 2-3 (devices 8-15) are held by pods ns/x, ns/y` (`devices 3,5 ...` when the block is
    not whole rows), and the pods of unknown ids that must go too; `name` shows each pod's name."""
    devices = f"devices {format_ids(list(freeing.devices))}"
    block = f"{freeing.where} ({devices})" if freeing.where else devices
    if freeing.holders:
        text = f"{block} are held by pods {', '.join(name(p) for p in freeing.holders)}"
    else:
        text = f"{block} are free by id"
    if freeing.unknown:
        pods = ", ".join(name(p) for p in freeing.unknown)
        text += f"; pods {pods} (ids unknown) hold cores on the node that must be freed too"
    return text


def diagnosis_json(diagnosis: Diagnosis) -> dict[str, Any]:
    """What `why --json` prints (docs/operations.md)."""
    request = diagnosis.request
    return {
        "version": JSON_VERSION,
        "pod": diagnosis.pod,
        "request": (
            {"resource": request.resource, "count": request.count} if request is not None else None
        ),
        "request_error": diagnosis.request_error,
        "priority": diagnosis.priority,
        "scheduler": diagnosis.scheduler,
        "nominated_node": diagnosis.nominated_node or None,
        "summary": {v.value: diagnosis.count(v) for v in Verdict}
        | {"nodes_without_neuron": diagnosis.other_nodes},
        "nodes": [_node_json(n) for n in diagnosis.nodes],
        "stranded_by_fragmentation": list(diagnosis.stranded),
        "consolidation": diagnosis.consolidation or None,
        "capacity": diagnosis.capacity or None,
        "job": diagnosis.job or None,
        "scheduling_gates": _gating_json(diagnosis.gating),
        "kueue_workload_status": (
            report_json(diagnosis.workload) if diagnosis.workload is not None else None
        ),
    }


def _gating_json(found: Gating | None) -> dict[str, Any] | None:
    if found is None:
        return None
    return {
        "gates": list(found.gates),
        "more_gates": found.more,
        "kueue_workload": found.workload or None,
        "kueue_queue": found.queue or None,
    }


def _node_json(node: NodeDiagnosis) -> dict[str, Any]:
    def freeing(value: Freeing | None) -> dict[str, Any] | None:
        if value is None:
            return None
        return {
            "pods": list(value.pods),
            "holding_the_block": list(value.holders),
            "ids_unknown": list(value.unknown),
            "devices": list(value.devices),
            "cores": list(value.cores),
            "where": value.where or None,
        }

    placement = node.placement
    return {
        "node": node.node,
        "instance_type": node.instance_type or None,
        "verdict": node.verdict.value,
        "reason": node.reason,
        "placement": (
            {"devices": list(placement.devices), "cores": list(placement.cores)}
            if placement is not None
            else None
        ),
        "blocking": freeing(node.blocking),
        "preemption": freeing(node.preemption),
        "free_by_count": node.by_count,
    }
