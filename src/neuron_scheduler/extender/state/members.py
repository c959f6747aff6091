"""What the extender knows about a training job's member on Neuron nodes, from the ledger: why it
cannot run on a node now, how many of its job's members a node takes, why it never can, the pods
of no job there, and what preemption would do for its job. No I/O. Read by filter and the preempt
verb, the reservation loop, and the views (status, why), so they all answer alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    Policy,
    Refusal,
    allocate,
    check_request,
)
from neuron_scheduler.core.resources import RequestError
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.jobs.members import Member
from neuron_scheduler.jobs.network import closeness_of
from neuron_scheduler.jobs.placement import Fit, Occupancy, Shortfall
from neuron_scheduler.jobs.preemption import Loose, Preemption, plan_preemption
from neuron_scheduler.kube.nodefit import placement_kind, why_not
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import epoch, neuron_request


def _state(ledger: Ledger, claimant: Claimant, node: str, leaving_gone: bool) -> NodeState:
    """The node as the claimant sees it; `leaving_gone`: with the pods already terminating taken
    out (their grace period ends them)."""
    if leaving_gone:
        return ledger.eviction_view(claimant, node)[0]
    return ledger.state_for(claimant, node)


def member_unusable(
    ledger: Ledger, pod: Pod, policy: Policy, node: str, leaving_gone: bool = False
) -> str | None:
    """Why this member cannot run on the node now (its spec keeps it off, or its devices do
    not fit there), or None; `leaving_gone`: once the pods terminating there are gone."""
    excluded = member_excluded(ledger, pod, node)
    if excluded is not None:
        return excluded
    entry = ledger.nodes[node]
    request = neuron_request(pod)  # (read without error by member_excluded)
    if request is None:
        return None
    state = _state(ledger, Claimant.of(pod, request), node, leaving_gone)
    decision = allocate(entry.topology, state, request, policy)
    if isinstance(decision, Placement):
        return None
    return ledger.failed_devices_refusal(node, request, decision).reason


def member_room(
    ledger: Ledger, pod: Pod, policy: Policy, node: str, most: int, leaving_gone: bool = False
) -> int:
    """How many of the member's job's members (each asking what it asks) the node takes now, up
    to `most`: blocks placed one after another on what is free there, so contiguity counts (a
    ring with devices 0-3 and 8-11 free takes two 4-device members, never three)."""
    entry = ledger.nodes.get(node)
    request = neuron_request(pod)
    if entry is None or request is None:
        return 0
    state = _state(ledger, Claimant.of(pod, request), node, leaving_gone)
    return _blocks(entry.topology, state, pod, most, policy)


def member_empty_room(ledger: Ledger, pod: Pod, node: str, most: int) -> int:
    """How many members the node would take with nothing else on it (its failed devices and
    what it withholds still count), up to `most`."""
    entry = ledger.nodes.get(node)
    if entry is None or neuron_request(pod) is None:
        return 0
    alone = NodeState(entry.unhealthy_cores, entry.withheld_cores)
    return _blocks(entry.topology, alone, pod, most, Policy.BEST_FIT)


def _blocks(topology: Topology, state: NodeState, pod: Pod, most: int, policy: Policy) -> int:
    request = neuron_request(pod)
    count = 0
    while request is not None and count < most:
        decision = allocate(topology, state, request, policy)
        if not isinstance(decision, Placement):
            break
        state = state.with_used(decision.core_mask)
        count += 1
    return count


@dataclass
class FitMemo:
    """Answers already worked out, by node and kind of member (kube.nodefit.placement_kind: its
    request and every spec field that decides where it may go): within one step of the
    reservation loop the ledger does not change, and jobs of one kind ask alike."""

    usable: dict[tuple[str, bytes], str | None] = field(default_factory=dict)
    excluded: dict[tuple[str, bytes], str | None] = field(default_factory=dict)
    room: dict[tuple[str, bytes, bool], tuple[int, int]] = field(default_factory=dict)


def member_fit(
    ledger: Ledger,
    pod: Pod,
    policy: Policy,
    memo: FitMemo | None = None,
    leaving_gone: bool = False,
) -> Fit:
    """The planner's questions about the member (jobs.placement.Fit), answered from the ledger,
    each once per node and kind (`memo`: shared by several members' plans); `leaving_gone`: as
    the nodes will be once the pods terminating there are gone (the placement check's view of
    what Kueue's preemption frees)."""
    memo = memo if memo is not None else FitMemo()
    kind = placement_kind(pod)

    def why_not(node: str) -> str | None:
        key = (node, kind)
        if key not in memo.usable:
            memo.usable[key] = member_unusable(ledger, pod, policy, node, leaving_gone)
        return memo.usable[key]

    def never(node: str) -> str | None:
        key = (node, kind)
        if key not in memo.excluded:
            memo.excluded[key] = member_excluded(ledger, pod, node)
        return memo.excluded[key]

    def room(node: str, most: int, empty: bool = False) -> int:
        # Kept as (found, asked for): a count below what was asked for is every block there is.
        key = (node, kind, empty)
        found, asked = memo.room.get(key, (0, 0))
        if asked < most and found == asked:
            found = (
                member_empty_room(ledger, pod, node, most)
                if empty
                else member_room(ledger, pod, policy, node, most, leaving_gone)
            )
            memo.room[key] = (found, most)
        return min(found, most)

    return Fit(why_not, room, never, lambda node, most: room(node, most, True), kind)


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
    policy: Policy = Policy.BEST_FIT,
) -> Preemption | Shortfall:
    """What preemption does for the member's whole job (jobs/preemption.py), at the member's
    priority, on units whose every node could take a member once every pod there is gone
    (`member_unfit`), within the network domain it requires; `now`: wall clock."""
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
        member_fit(ledger, pod, policy),
        closeness_of(pod),
    )
