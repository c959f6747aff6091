"""Consolidation's planning over the ledger: which pending pods are stranded by fragmentation, and
which pods may move for one of them. No I/O: the extender's consolidation (extender/consolidating)
acts on the answer, `kubectl neuron why` shows it.

`Movability` is a view fed by the pod watch with what the ledger does not keep: each Neuron pod's
controller (a bare pod is never moved: nothing recreates it), its opt-out
(`neuron-scheduler.io/do-not-disrupt: "true"`), whether it is a training job's pod (every
framework the UltraServer rule knows: never moved for now, as a job moves only whole), and what
its replacement's node must admit (nodeSelector, required node affinity, tolerations; the
extender's node filters, such as the UltraServer claims, are asked through `admits`).

`stranded` says whether a pod waits only because of fragmentation: no node it may go to has an
allowed block for it, and some has its count free. `plan_for` then asks core/consolidation on each
such node (those not excluded by the caller: a plan already there, a cooldown), with the node as
the pod sees it (`Ledger.eviction_view`), each moved pod's replacement placed again on the nodes
it may go to as the cluster stands, and disruption budgets counted as preemption counts them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

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
from neuron_scheduler.extender.budgets import DisruptionBudgets
from neuron_scheduler.extender.ledger import Claimant, Ledger
from neuron_scheduler.extender.plugins import PodsOnly
from neuron_scheduler.kube.nodefit import why_not
from neuron_scheduler.kube.objects import Affinity, Pod, PodSpec, Toleration
from neuron_scheduler.kube.reading import servable_request
from neuron_scheduler.kube.views import pod_uid, replace_all
from neuron_scheduler.ultraserver.jobs import MembershipError, member_of

DO_NOT_DISRUPT = "neuron-scheduler.io/do-not-disrupt"
# Pods of jobs that run (and so would have to move) as a whole beyond the members `member_of`
# names (ultraserver/jobs.py): a launcher, and any pod of a JobSet or a LeaderWorkerSet.
GANG_LABELS = {
    "training.kubeflow.org/job-name": "a Kubeflow training job's pod",
    "jobset.sigs.k8s.io/jobset-name": "a JobSet's pod",
    "leaderworkerset.sigs.k8s.io/name": "a LeaderWorkerSet's pod",
}
GANG_TEXT = "(a gang job moves only whole, which consolidation does not do yet)"


def gang_of(pod: Pod) -> str:
    """What makes the pod part of a job that runs (and so moves) only whole, or "": a training
    job's member as the UltraServer rule knows them (every framework, ultraserver/jobs.py), or a
    pod of such a job that is no member (an MPI launcher, a JobSet's or LeaderWorkerSet's
    other pods)."""
    try:
        member = member_of(pod)
    except MembershipError:
        return "a training job's member (its job's size is unreadable)"
    if member is not None:
        return f"a member of {member.framework} job {member.text}"
    for label, what in GANG_LABELS.items():
        if label in pod.metadata.labels:
            return what
    return ""


# Whether the extender's node filters (the UltraServer rule) let a pod onto a node: consolidation
# plans neither for a node its pod would be refused on, nor a replacement's place there.
Admits = Callable[[Pod, str], bool]


def anywhere(pod: Pod, node: str) -> bool:
    """No node filter: every node admits every pod."""
    return True


MAX_NODES_TRIED = 32  # stranded nodes planned on per pending pod, fewest pods in the way first


@dataclass(frozen=True, slots=True)
class Facts:
    """What consolidation knows of one Neuron pod beyond the ledger."""

    key: str  # namespace/name
    namespace: str
    labels: Mapping[str, str]
    request: NeuronRequest
    priority: int
    owner: str  # its controller's uid; "" for a bare pod
    never: str  # why it is never moved; "" when it may be
    created: str  # RFC 3339
    bound: str  # its node; "" while pending
    placement: Pod = field(compare=False)  # its spec's node rules, for its replacement

    @classmethod
    def of(cls, pod: Pod, request: NeuronRequest) -> Facts:
        meta, spec = pod.metadata, pod.spec
        controller = meta.controller
        return cls(
            pod.key,
            meta.namespace,
            meta.labels,
            request,
            spec.priority or 0,
            controller.uid if controller is not None else "",
            never_moved(pod),
            meta.creationTimestamp or "",
            spec.nodeName,
            # Only what kube.nodefit reads: the rest of the pod is not kept.
            Pod(spec=_node_rules(spec.nodeSelector, spec.affinity, spec.tolerations)),
        )


def _node_rules(
    selector: dict[str, str], affinity: Affinity | None, tolerations: list[Toleration]
) -> PodSpec:
    return PodSpec(nodeSelector=selector, affinity=affinity, tolerations=tolerations)


def never_moved(pod: Pod) -> str:
    """Why consolidation never moves this pod, or "" when it may."""
    meta = pod.metadata
    if meta.annotations.get(DO_NOT_DISRUPT, "").lower() == "true":
        return f"opted out ({DO_NOT_DISRUPT})"
    gang = gang_of(pod)
    if gang:
        return f"{gang} {GANG_TEXT}"
    controller = meta.controller
    if controller is None:
        return "a bare pod (no controller recreates it)"
    if controller.kind == "DaemonSet":
        return "a DaemonSet's pod (recreated on the same node)"
    if controller.kind == "Node":
        return "a static pod"
    return ""


class Movability(PodsOnly):
    """A view of every unfinished Neuron pod's `Facts`, fed by the pod watch."""

    def __init__(self) -> None:
        self.pods: dict[str, Facts] = {}

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        replace_all(pods, pod_uid, self.apply_pod, self.pods, self.remove_pod)

    def apply_pod(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        if pod.finished:
            self.pods.pop(uid, None)
            return
        request = servable_request(pod)
        if request is None:
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = Facts.of(pod, request)

    def remove_pod(self, uid: str) -> None:
        self.pods.pop(uid, None)


@dataclass(frozen=True, slots=True)
class Stranded:
    """A pending pod that no node it may go to has an allowed block for, while these nodes have
    its count free."""

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
        if fits_by_count(entry.topology, ledger.state_for(claimant, name), request):
            by_count.append(name)
    return Stranded(tuple(sorted(by_count))) if by_count else None


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
    """The best move on `nodes` (where the pod is stranded), by core/consolidation's order,
    fewest pods first across nodes; pods in `busy` (another plan's victims) stay; replacements
    only go where `admits` lets them."""
    claimant = Claimant.of(pod, request)
    priority = pod.spec.priority or 0
    rooms = _rooms(ledger, movability, policy, admits)
    best: Move | None = None
    refusals: list[NoMove] = []
    for node in _by_blockers(ledger, claimant, nodes)[:MAX_NODES_TRIED]:
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


def _by_blockers(ledger: Ledger, claimant: Claimant, nodes: Sequence[str]) -> list[str]:
    """Nodes with the fewest pods first: the likeliest to need the fewest moves."""
    return sorted(nodes, key=lambda n: (len(ledger.pods_holding(n)), n))


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
        for name, entry in ledger.nodes.items():
            if name not in verdicts.fits and name != facts.bound:
                continue
            node_facts = ledger.facts.get(name)
            if node_facts is not None and why_not(facts.placement, node_facts) is not None:
                continue
            if not admits(facts.placement, name):  # (a replacement is of no training job)
                continue
            found.append(Room(name, entry.topology, ledger.state_for(claimant, name)))
        return found

    return rooms
