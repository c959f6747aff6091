"""The placement admission check's question: can every pod set of a Kueue workload that has its
quota be placed now, and where? No I/O (extender/loops/admitting writes the answer).

Each pod set's pods are read as they will be once admitted (kube.kueue.pod_of: the template, its
flavors' node labels and tolerations, the labels its framework's controller adds). Then:

- the pod sets of a training job (jobs.members: gang annotations, framework labels) get whole
  units for all the job's members, planned exactly as the reservation loop plans for a job whose
  members wait (jobs.placement.plan: UltraServers, else nodes of their own, close in the network);
- every other pod gets a block: the allocator's placement on one node its spec and flavor admit,
  pod after pod, each on the state the earlier ones leave, best score first (kube-scheduler takes
  the best-scored node too); where Kueue's topology assignment pins pods to a domain (a node, at
  the hostname level), only there.

Both are decided on the nodes as they will be once the pods terminating there are gone (Kueue's
own preemption evicts by deleting pods with their grace period: what it frees is the preemptor's
to hold), and both see every block other pods hold (nominations, consolidation plans, other
admitted workloads): nothing held for someone else is taken.

When one pod cannot be placed, the answer says why in the allocator's words: "3 devices fit by
count on 2 nodes of flavor inf2, but no node has 3 contiguous free (inf2-a: needs 3 contiguous
devices; largest free contiguous run is 1 device ...)".
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    Policy,
    Refusal,
    allocate,
    counted,
    free_devices,
)
from neuron_scheduler.core.ids import format_ids
from neuron_scheduler.core.resources import NeuronRequest, RequestError, Unit
from neuron_scheduler.extender.state.kueuepods import PodMeta
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.extender.state.members import FitMemo, member_fit
from neuron_scheduler.jobs.members import (
    JobKey,
    Member,
    MembershipError,
    framework_labels,
    member_of,
)
from neuron_scheduler.jobs.network import HOSTNAME, closeness_of
from neuron_scheduler.jobs.placement import (
    AtomsMemo,
    Occupancy,
    Planned,
    Shortfall,
    job_text,
    never_fits,
    plan,
    unit_kind,
)
from neuron_scheduler.jobs.units import NodeConfigError, pod_node_config
from neuron_scheduler.kube.kueue import (
    Domain,
    KueueError,
    PodSetAssignment,
    Workload,
    domains,
    pod_of,
    readable,
)
from neuron_scheduler.kube.nodefit import NodeFacts, why_not
from neuron_scheduler.kube.objects import Pod, Toleration
from neuron_scheduler.kube.reading import neuron_request

MAX_SHOWN = 6  # blocks or nodes named in a message


@dataclass(frozen=True, slots=True)
class Block:
    """A block held for one pod of a pod set: `cores` on `node`."""

    pod_set: str
    node: str
    request: NeuronRequest
    cores: int
    devices: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class JobUnits:
    """The units a training job of the workload gets (its claim, written for the workload)."""

    job: JobKey
    size: int
    planned: Planned
    scheduler: str


@dataclass(frozen=True, slots=True)
class Placed:
    blocks: tuple[Block, ...]
    jobs: tuple[JobUnits, ...]
    text: str  # what the check's message says (where its pods go)

    @property
    def pods(self) -> int:
        return len(self.blocks) + sum(j.size for j in self.jobs)


@dataclass(frozen=True, slots=True)
class NotPlaced:
    reason: str
    never: bool = False  # no node as the nodes are now could ever take it
    wait: bool = False  # not decided yet (a flavor or the quota not known): the check stays Pending


@dataclass
class _PodSet:
    name: str
    pod: Pod
    request: NeuronRequest
    count: int
    flavor: str
    assignment: PodSetAssignment
    member: Member | None = None
    domains: list[Domain] = field(default_factory=list)


def place(
    workload: Workload,
    flavors: dict[str, tuple[dict[str, str], list[Toleration]]],
    ledger: Ledger,
    occupancy: Occupancy,
    policy: Policy,
    scheduler_names: Collection[str],
    pods: Callable[[str], PodMeta | None] = lambda uid: None,
) -> Placed | NotPlaced:
    """Where every pod of the workload goes now, or why it cannot. `flavors`: each
    ResourceFlavor's node labels and tolerations, by name; `pods`: the labels and annotations of
    a pod Kueue's pod integration manages, by uid (its Workload's templates carry none)."""
    try:
        readable(workload)
        sets = _pod_sets(workload, flavors, scheduler_names, pods)
    except _Unplaceable as stopped:
        return stopped.answer
    except KueueError as error:
        return NotPlaced(f"the Workload cannot be read: {error}", never=True)
    members = [s for s in sets if s.member is not None]
    jobs = sorted({s.member.job for s in members if s.member is not None})
    if len(jobs) > 1:
        shown = ", ".join(job_text(j) for j in jobs[:MAX_SHOWN])
        return NotPlaced(f"its pod sets are members of {len(jobs)} training jobs ({shown})", True)
    units: list[JobUnits] = []
    if jobs:
        planned = _units(jobs[0], members, ledger, occupancy, policy)
        if isinstance(planned, NotPlaced):
            return planned
        units.append(planned)
    taken = {n for u in units for n in u.planned.nodes}
    if jobs:
        taken |= occupancy.claimed(jobs[0])
    blocks: list[Block] = []
    extra: dict[str, int] = {}
    for pod_set in sets:
        if pod_set.member is not None:
            continue
        refused = _blocks(pod_set, ledger, occupancy, policy, taken, extra, blocks)
        if refused is not None:
            return refused
    return Placed(tuple(blocks), tuple(units), _text(blocks, units))


class _Unplaceable(Exception):
    def __init__(self, answer: NotPlaced) -> None:
        self.answer = answer


def _pod_sets(
    workload: Workload,
    flavors: dict[str, tuple[dict[str, str], list[Toleration]]],
    scheduler_names: Collection[str],
    pods: Callable[[str], PodMeta | None],
) -> list[_PodSet]:
    """The workload's pod sets that ask for Neuron devices and go to a scheduler this extender
    serves, read as their pods will be (the rest are not ours to place)."""
    admission = workload.status.admission
    if admission is None:
        raise _Unplaceable(NotPlaced("Kueue has not reserved its quota yet", wait=True))
    assigned = {a.name: a for a in admission.podSetAssignments}
    owner = workload.metadata.controller
    # Plain pods and pod groups: the Workload is owned by its pods, which carry the metadata.
    found_meta = [
        m
        for ref in workload.metadata.ownerReferences
        if ref.kind == "Pod" and (m := pods(ref.uid)) is not None
    ]
    found: list[_PodSet] = []
    for pod_set in workload.spec.podSets:
        assignment = assigned.get(pod_set.name)
        if assignment is None:
            raise _Unplaceable(NotPlaced(f"pod set {pod_set.name} has no assignment", wait=True))
        count = pod_set.count if assignment.count is None else assignment.count
        if not 0 <= count <= pod_set.count:
            raise KueueError(f"pod set {pod_set.name} admitted with {count} pods")
        if count == 0:
            continue
        names = sorted(set(assignment.flavors.values()))
        labels: dict[str, str] = {}
        tolerations: list[Toleration] = []
        for name in names:
            if name not in flavors:
                raise _Unplaceable(
                    NotPlaced(
                        f"ResourceFlavor {name[:63]} is not known to the extender yet", wait=True
                    )
                )
            node_labels, flavor_tolerations = flavors[name]
            labels.update(node_labels)
            tolerations += flavor_tolerations
        own = (
            framework_labels(owner.apiVersion, owner.kind, owner.name, pod_set.name)
            if owner is not None
            else {}
        )
        if found_meta and not pod_set.template.metadata.labels:
            own = {**found_meta[0].labels, **own}
            pod = pod_of(workload, pod_set, labels, tolerations, own, found_meta[0].annotations)
        else:
            pod = pod_of(workload, pod_set, labels, tolerations, own)
        try:
            request = neuron_request(pod)
        except RequestError as error:
            raise _Unplaceable(NotPlaced(f"pod set {pod_set.name}: {error}", never=True)) from None
        if request is None or pod.spec.schedulerName not in scheduler_names:
            continue
        try:
            member = member_of(pod)
        except MembershipError as error:
            raise _Unplaceable(NotPlaced(f"pod set {pod_set.name}: {error}", never=True)) from None
        flavor = assignment.flavors.get(request.resource) or (names[0] if names else "")
        found.append(_PodSet(pod_set.name, pod, request, count, flavor, assignment, member))
        if assignment.topologyAssignment is not None:
            found[-1].domains = domains(assignment.topologyAssignment)
            if sum(d.count for d in found[-1].domains) != count:
                raise KueueError(
                    f"pod set {pod_set.name}'s topology assignment places other counts"
                )
    return found


# --- training jobs: whole units -------------------------------------------------------------------


def _units(
    job: JobKey, sets: list[_PodSet], ledger: Ledger, occupancy: Occupancy, policy: Policy
) -> JobUnits | NotPlaced:
    """The job's units, as the reservation loop plans them for a job whose members wait (its
    first pod set's pod stands for every member)."""
    if occupancy.unavailable:
        return NotPlaced(occupancy.unavailable, wait=True)
    first = sets[0]
    member = first.member
    assert member is not None
    try:
        config = pod_node_config(first.pod)
    except NodeConfigError as error:
        return NotPlaced(str(error), never=True)
    counted_members = sum(s.count for s in sets)
    size = member.size or (occupancy.pod_groups.get(job) if member.pod_group else None)
    size = size or counted_members
    fit = member_fit(ledger, first.pod, policy, FitMemo(), leaving_gone=True)
    closeness = closeness_of(first.pod)
    opened: AtomsMemo = {}
    chosen = plan(occupancy, job, config, size, fit, closeness, opened)
    if isinstance(chosen, Shortfall):
        cannot = never_fits(occupancy, job, config, size, fit, closeness, opened)
        return NotPlaced((cannot or chosen).reason, never=cannot is not None)
    # What the workload's claim will hold: the reservation loop lets go of the job's other claims.
    nodes = occupancy.kept_beside(job, chosen.nodes)
    for pod_set in sets:
        pinned = [d for d in pod_set.domains if d.selector and d.selector[-1][0] == HOSTNAME]
        outside = [d.selector[-1][1] for d in pinned if d.selector[-1][1] not in nodes]
        if outside:
            shown = ", ".join(sorted(outside)[:MAX_SHOWN])
            return NotPlaced(
                f"Kueue's topology assignment pins members of job {job_text(job)} to {shown}, "
                f"which are not among the units the job can have now "
                f"({', '.join(sorted(nodes)[:MAX_SHOWN])})"
            )
    return JobUnits(job, size, chosen, first.pod.spec.schedulerName)


# --- every other pod: a block -------------------------------------------------------------------


def _blocks(
    pod_set: _PodSet,
    ledger: Ledger,
    occupancy: Occupancy,
    policy: Policy,
    taken: set[str],
    extra: dict[str, int],
    blocks: list[Block],
) -> NotPlaced | None:
    """A block for each pod of the pod set, added to `blocks` (`extra`: the cores they take by
    node); why not, for the first pod that gets none."""
    parts: list[tuple[Domain | None, int]] = [(d, d.count) for d in pod_set.domains]
    parts = parts or [(None, pod_set.count)]
    placed = 0
    for domain, count in parts:
        candidates, excluded = _candidates(pod_set.pod, domain, ledger, occupancy, taken)
        decisions: dict[str, Refusal | Placement] = {}
        for _ in range(count):
            for node in candidates:
                if node not in decisions:
                    decisions[node] = _decide(ledger, node, pod_set.request, policy, extra)
            fits = [(d.score, n) for n, d in decisions.items() if isinstance(d, Placement)]
            if not fits:
                return _why_none(pod_set, placed, domain, decisions, excluded, ledger, extra)
            _, node = min(fits, key=lambda f: (-f[0], f[1]))  # the best score, then by name
            decision = decisions.pop(node)
            assert isinstance(decision, Placement)
            extra[node] = extra.get(node, 0) | decision.core_mask
            blocks.append(
                Block(pod_set.name, node, pod_set.request, decision.core_mask, decision.devices)
            )
            placed += 1
    return None


def _candidates(
    pod: Pod, domain: Domain | None, ledger: Ledger, occupancy: Occupancy, taken: set[str]
) -> tuple[list[str], list[str]]:
    """The Neuron nodes the pod may go to (its spec, its flavor, the domain Kueue pinned it
    to), and why the others may not (one reason per node)."""
    nodes: list[str] = []
    why: list[str] = []
    for name in sorted(ledger.nodes):
        facts = ledger.facts.get(name)
        if facts is None:
            continue
        reason = _outside(facts, domain) or why_not(pod, facts)
        if reason is None and (name in taken or name in occupancy.rejected):
            reason = f"node {name} is reserved for a training job"
        elif reason is None and name in occupancy.claims and occupancy.rules(name):
            reason = f"node {name} is reserved for job {occupancy.claims[name].job_text}"
        if reason is None:
            nodes.append(name)
        else:
            why.append(reason)
    return nodes, why


def _outside(facts: NodeFacts, domain: Domain | None) -> str | None:
    if domain is None:
        return None
    for key, value in domain.selector:
        have = facts.labels.get(key, facts.name if key == HOSTNAME else None)
        if have != value:
            return f"node {facts.name} is outside the domain Kueue assigned ({domain.text})"
    return None


def _decide(
    ledger: Ledger, node: str, request: NeuronRequest, policy: Policy, extra: dict[str, int]
) -> Refusal | Placement:
    entry = ledger.nodes[node]
    return allocate(
        entry.topology, _soon(ledger, node, extra), request, policy, ledger.demand.weights
    )


def _soon(ledger: Ledger, node: str, extra: dict[str, int]) -> NodeState:
    """The node once its terminating pods are gone, with every block held there (for anyone)
    and the blocks this plan chose."""
    state, _ = ledger.eviction_view(Claimant(), node)
    return state.with_used(extra.get(node, 0))


def _free(ledger: Ledger, node: str, request: NeuronRequest, extra: dict[str, int]) -> int:
    entry = ledger.nodes[node]
    state = _soon(ledger, node, extra)
    if request.unit is Unit.DEVICE:
        return free_devices(entry.topology, state)
    total = entry.topology.total_cores
    return max(total - state.used_cores.bit_count() - state.unattributed_cores, 0)


def _why_none(
    pod_set: _PodSet,
    placed: int,
    domain: Domain | None,
    decisions: dict[str, Refusal | Placement],
    excluded: list[str],
    ledger: Ledger,
    extra: dict[str, int],
) -> NotPlaced:
    """Why the pod set's next pod gets no block, in the allocator's words."""
    request = pod_set.request
    need = counted(request.count, request.unit)
    count, name = pod_set.count, pod_set.name
    if count == 1:
        which = f"pod set {name}: its pod ({need})"
    elif placed == 0:
        which = f"pod set {name}: its {count} pods ({need} each)"
    else:
        which = f"pod set {name}: {count - placed} of its {count} pods ({need} each)"
    where = f"flavor {pod_set.flavor}" if pod_set.flavor else "its flavor"
    if domain is not None:
        where = f"the domain Kueue's topology assignment pins {domain.count} to ({domain.text})"
    refusals = {n: d for n, d in decisions.items() if isinstance(d, Refusal)}
    if not refusals:
        first = f" ({excluded[0]})" if excluded else ""
        return NotPlaced(f"{which}: no Neuron node of {where} takes it{first}", never=True)
    by_count = [n for n in refusals if not refusals[n].unresolvable]
    by_count = [n for n in by_count if _free(ledger, n, request, extra) >= request.count]
    if by_count:
        example, many = by_count[0], len(by_count)
        shape = f"{request.count} contiguous {request.unit.value}s" if request.count > 1 else need
        return NotPlaced(
            f"{which}: {need} fit by count on {many} node{'s' if many != 1 else ''} of {where}, "
            f"but no node has {shape} free ({example}: {refusals[example].reason})"
        )
    never = all(r.unresolvable for r in refusals.values())
    example = sorted(refusals)[0]
    return NotPlaced(
        f"{which}: no node of {where} has {need} free ({example}: {refusals[example].reason})",
        never=never,
    )


# --- the message ---------------------------------------------------------------------------------


def _text(blocks: list[Block], units: list[JobUnits]) -> str:
    parts: list[str] = []
    for job in units:
        planned = job.planned
        nodes = planned.nodes
        kind = unit_kind(planned.config, planned.config > 1, len(nodes))
        shown = ", ".join(nodes[:MAX_SHOWN]) + (" ..." if len(nodes) > MAX_SHOWN else "")
        where = f"{kind} {shown}" if nodes else "the units it holds already"
        parts.append(f"job {job_text(job.job)}: {job.size} members on {where}")
    by_set: dict[str, list[Block]] = {}
    for block in blocks:
        by_set.setdefault(block.pod_set, []).append(block)
    for name, held in by_set.items():
        shown = "; ".join(
            f"{b.node} devices {format_ids(list(b.devices))}" for b in held[:MAX_SHOWN]
        )
        more = f" and {len(held) - MAX_SHOWN} more" if len(held) > MAX_SHOWN else ""
        parts.append(
            f"pod set {name}: {len(held)} pod{'s' if len(held) != 1 else ''} on {shown}{more}"
        )
    return "; ".join(parts) if parts else "none of its pods asks this extender for Neuron devices"
