"""Consolidation's planning over the ledger: which pending pods are stranded by fragmentation, and
which pods may move for one of them. No I/O: the leader's consolidation
(extender/loops/consolidating) acts on the answer, `kubectl neuron why` shows it.

What may move, and where a replacement may go, is the pod watch's view `Movability`
(extender/state/movability); the extender's node filters, such as training jobs' claims, are asked
through `admits`.

`stranded` says whether a pod waits only because of fragmentation: no node it may go to has an
allowed block for it, and some has its count free. `plan_for` then asks core/consolidation on
every node it may go to where freeing can help (not only those with its count free: moving one
replica off a node with 3 free devices frees 4 there), except those the caller excludes (a plan
already there, a cooldown), with the node as the pod sees it (`Ledger.eviction_view`), each moved
pod's replacement placed again on the nodes it may go to as the cluster stands, and disruption
budgets counted as preemption counts them. The best move over all of them wins, so a node that
needs one move beats one that has the count free but needs two.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from neuron_scheduler.core.allocation import Placement, Policy
from neuron_scheduler.core.consolidation import (
    DEFAULT_MAX_VICTIMS,
    Move,
    Mover,
    NoMove,
    Room,
    fits_by_count,
    plan_move,
)
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.extender.state.budgets import DisruptionBudgets
from neuron_scheduler.extender.state.ledger import REFUSED, Claimant, Ledger
from neuron_scheduler.extender.state.movability import Movability
from neuron_scheduler.kube.nodefit import why_not
from neuron_scheduler.kube.objects import Pod

# Whether the extender's node filters (the training-job rule) let a pod onto a node: consolidation
# plans neither for a node its pod would be refused on, nor a replacement's place there.
Admits = Callable[[Pod, str], bool]


def anywhere(pod: Pod, node: str) -> bool:
    """No node filter: every node admits every pod."""
    return True


# Nodes planned on per pending pod, those with the most free first (the fewest moves needed).
MAX_NODES_TRIED = 32


@dataclass(frozen=True, slots=True)
class Stranded:
    """A pending pod that no node it may go to has an allowed block for, while `by_count` have
    its count free. `nodes`: every node it may go to where moving pods could free a block for it
    (its size is allowed there and no held block of higher priority is all that stands in the
    way), `by_count` among them."""

    by_count: tuple[str, ...]
    nodes: tuple[str, ...]


def stranded(
    ledger: Ledger,
    pod: Pod,
    request: NeuronRequest,
    policy: Policy,
    admits: Admits = anywhere,
) -> Stranded | None:
    """None when some node it may go to has a block for it now, or none has its count free
    (then it waits for room, or for preemption, not for consolidation). Nodes `admits` keeps
    it off (claimed for a training job) count neither way."""
    claimant = Claimant.of(pod, request)
    verdicts = ledger.fill_verdicts(ledger.nodes, request, policy, claimant)
    by_count = []
    nodes = []
    for name, decision in verdicts.decisions.items():
        facts = ledger.facts.get(name)
        if facts is not None and why_not(pod, facts) is not None:
            continue
        if not admits(pod, name):
            continue
        if isinstance(decision, Placement):
            return None
        entry = ledger.nodes.get(name)
        if entry is None or decision.unresolvable:
            continue
        nodes.append(name)
        if fits_by_count(entry.topology, ledger.state_for(claimant, name), request):
            by_count.append(name)
    if not by_count:
        return None
    return Stranded(tuple(sorted(by_count)), tuple(sorted(nodes)))


@dataclass(frozen=True, slots=True)
class Planned:
    """The best move for a stranded pod, or why there is none on each node tried."""

    move: Move | None
    refusals: tuple[NoMove, ...]


def plan_for(
    ledger: Ledger,
    movability: Movability,
    budgets: DisruptionBudgets,
    pod: Pod,
    request: NeuronRequest,
    nodes: Sequence[str],
    policy: Policy = Policy.BEST_FIT,
    max_victims: int = DEFAULT_MAX_VICTIMS,
    busy: Collection[str] = (),
    admits: Admits = anywhere,
) -> Planned:
    """The best move on `nodes` (those it may go to: `Stranded.nodes`), by core/consolidation's
    order, fewest pods first across nodes; pods in `busy` (another plan's victims) stay;
    replacements only go where `admits` lets them."""
    claimant = Claimant.of(pod, request)
    priority = pod.spec.priority or 0
    rooms = _rooms(ledger, movability, policy, admits)
    best: Move | None = None
    refusals: list[NoMove] = []
    for node in _most_free_first(ledger, claimant, nodes)[:MAX_NODES_TRIED]:
        entry = ledger.nodes.get(node)
        if entry is None:
            continue
        base, occupants = ledger.eviction_view(claimant, node)
        movers = {}
        for uid, occupant in occupants.items():
            facts = movability.pods.get(uid)
            if facts is None:  # (not listed yet): it stays where it is
                movers[uid] = Mover(occupant, request, ledger.pod_key(uid), "not known yet")
                continue
            never = facts.never or ("another plan's victim" if uid in busy else "")
            movers[uid] = Mover(occupant, facts.request, facts.key, never)
        violations = _violations(movability, budgets)
        answer = plan_move(
            node,
            entry.topology,
            base,
            request,
            priority,
            movers,
            rooms,
            violations,
            max_victims,
            policy,
        )
        if isinstance(answer, NoMove):
            refusals.append(answer)
        elif best is None or (answer.key, answer.node) < (best.key, best.node):
            best = answer
    return Planned(best, tuple(refusals))


def _most_free_first(ledger: Ledger, claimant: Claimant, nodes: Sequence[str]) -> list[str]:
    """Nodes with the most cores free (as the pod sees them) first, then the fewest pods: the
    likeliest to need the fewest moves."""

    def order(node: str) -> tuple[int, int, str]:
        entry = ledger.nodes.get(node)
        state = ledger.state_for(claimant, node)
        used = state.used_cores.bit_count() + state.unattributed_cores
        free = (entry.topology.total_cores if entry else 0) - used
        return (-free, len(ledger.pods_holding(node)), node)

    return sorted(nodes, key=order)


def _violations(
    movability: Movability, budgets: DisruptionBudgets
) -> Callable[[Sequence[str]], int]:
    def count(victims: Sequence[str]) -> int:
        found = [movability.pods.get(uid) for uid in victims]
        return budgets.violations([(f.namespace, f.labels) for f in found if f is not None])

    return count


def _rooms(
    ledger: Ledger, movability: Movability, policy: Policy, admits: Admits = anywhere
) -> Callable[[str, NeuronRequest], Iterable[Room]]:
    """Where a moved pod's replacement may go: nodes its spec admits that fit its request now,
    as a pod of its priority finds them (every hold counted), and the node it leaves."""

    def rooms(uid: str, request: NeuronRequest) -> Iterable[Room]:
        facts = movability.pods.get(uid)
        if facts is None:
            return []
        claimant = Claimant(priority=facts.priority)
        verdicts = ledger.fill_verdicts(ledger.nodes, request, policy, claimant)
        found = []
        marks = verdicts.marks
        for name, entry in ledger.nodes.items():
            if marks.get(name, REFUSED) < 0 and name != facts.bound:
                continue
            node_facts = ledger.facts.get(name)
            if node_facts is not None and why_not(facts.placement, node_facts) is not None:
                continue
            if not admits(facts.placement, name):  # (a replacement is of no training job)
                continue
            found.append(Room(name, entry.topology, ledger.state_for(claimant, name)))
        return found

    return rooms
