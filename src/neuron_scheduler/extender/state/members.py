"""What the extender knows about a training job's member on UltraServer nodes, from the ledger: why
it cannot run on a node now, why it never can, the pods of no job there, and what preemption
would do for its job. No I/O. Read by filter and the preempt verb, the reservation loop, and the
views (status, why), so they all answer alike.
"""

from __future__ import annotations

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    Policy,
    Refusal,
    allocate,
    check_request,
)
from neuron_scheduler.core.resources import RequestError
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.kube.nodefit import why_not
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import epoch, neuron_request
from neuron_scheduler.ultraserver.jobs import Member
from neuron_scheduler.ultraserver.placement import Occupancy, Shortfall
from neuron_scheduler.ultraserver.preemption import Loose, Preemption, plan_preemption


def member_unusable(ledger: Ledger, pod: Pod, policy: Policy, node: str) -> str | None:
    """Why this member cannot run on the node now (its spec keeps it off, or its devices do
    not fit there), or None."""
    excluded = member_excluded(ledger, pod, node)
    if excluded is not None:
        return excluded
    entry = ledger.nodes[node]
    request = neuron_request(pod)  # (read without error by member_excluded)
    if request is None:
        return None
    state = ledger.state_for(Claimant.of(pod, request), node)
    decision = allocate(entry.topology, state, request, policy)
    if isinstance(decision, Placement):
        return None
    return ledger.failed_devices_refusal(node, request, decision).reason


def member_excluded(ledger: Ledger, pod: Pod, node: str) -> str | None:
    """Why this member can never run on the node, whatever runs there (its nodeSelector,
    affinity or tolerations, or devices the node's type cannot give), or None."""
    entry = ledger.nodes.get(node)
    if entry is None:
        return "not a usable Neuron node"
    facts = ledger.facts.get(node)
    excluded = why_not(pod, facts) if facts is not None else None
    if excluded is not None:
        return excluded
    try:
        request = neuron_request(pod)
    except RequestError as error:
        return str(error)
    refusal = check_request(entry.topology, request) if request is not None else None
    return refusal.reason if refusal is not None else None


def member_unfit(ledger: Ledger, pod: Pod, node: str) -> str | None:
    """Why this member could not run on the node even with every pod there gone: its spec keeps
    it off (`member_excluded`), or what the node does not offer (failed devices, capacity
    withheld) leaves no place for its devices; or None. Preemption takes only units whose
    every node passes: evicting a job for a node its members cannot use loses work for nothing
    (issue 39's failed devices)."""
    excluded = member_excluded(ledger, pod, node)
    if excluded is not None:
        return excluded
    entry = ledger.nodes[node]
    if not (entry.unhealthy_devices or entry.withheld_cores):
        return None  # (what fits its type, which member_excluded checked, fits it empty)
    request = neuron_request(pod)  # (read without error by member_excluded)
    if request is None:
        return None
    alone = NodeState(entry.unhealthy_cores, entry.withheld_cores)
    decision = allocate(entry.topology, alone, request)
    if isinstance(decision, Refusal):
        return ledger.failed_devices_refusal(node, request, decision).reason
    return None


def loose_pods(ledger: Ledger, occupancy: Occupancy, node: str) -> list[Loose]:
    """The pods of no job holding Neuron devices on the node, not leaving already."""
    return [
        Loose(uid, holding.priority, epoch(holding.started))
        for uid, holding in sorted(ledger.pods_holding(node).items())
        if uid not in occupancy.workers and not holding.terminating
    ]


def preemption_for(
    ledger: Ledger,
    occupancy: Occupancy,
    pod: Pod,
    member: Member,
    config: int,
    now: float,
) -> Preemption | Shortfall:
    """What preemption does for the member's whole job (ultraserver/preemption.py), at the
    member's priority, on units whose every node could take a member once every pod there is
    gone (`member_unfit`); `now`: wall clock."""
    size = max(occupancy.size(member, member.job), 1)
    return plan_preemption(
        occupancy,
        member.job,
        config,
        size,
        pod.spec.priority or 0,
        lambda node: loose_pods(ledger, occupancy, node),
        lambda node: member_unfit(ledger, pod, node),
        now,
        lambda node: member_excluded(ledger, pod, node),
    )
