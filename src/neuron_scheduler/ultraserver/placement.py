"""UltraServer placement of training jobs, all or nothing: what the extender's filter admits, and
which units a job's reservation takes. No I/O (the extender's reservation loop writes the claims
this reads: extender/loops/reserving.py).

A member is a pod of a training job (`ultraserver.jobs`: MPIJob, PyTorchJob, JobSet, Kubeflow
Trainer, LeaderWorkerSet, the Workload API's PodGroup, or our annotation), one per node. Its node
config (4, 2 or 1 nodes per unit) is the pod annotation `neuron.amazonaws.com/ultraserver-node-
config`, else a label of that name, else 4. A unit is the set of nodes sharing
`neuron.amazonaws.com/ultraserver-server-id-<config>` (config 1: one node). On UltraServer nodes
(those with `neuron.amazonaws.com/ultraserver-mode`):

- a job's members go only to nodes its claim holds (`claims`, persisted: one UltraServerClaim per
  node), one member per node;
- a job gets its claim when units for all its members are free together (`plan`): complete
  units, none holding or claimed for another job (in either job's config, so a 2-node job and a
  4-node job never share an UltraServer), every node able to take a member; then all at once.
  Until then nothing is reserved and its members are refused with the reason
  ("needs 2 free UltraServers of 4 nodes, 1 free");
- a member that comes back (its pod deleted, its node drained) returns to a node of its job's
  claim; if none can take it, it waits and the rest of the job keeps its nodes;
- members fill one unit of the claim before the next, so a job that never becomes whole holds
  as few units as it can once its claim ends;
- a job whose size needs more units than there are with nodes its members could ever run on
  (its nodeSelector, affinity, tolerations, the devices it asks for) can never run here, and its
  members are refused with that;
- a job of higher priority may take units from whole jobs of lower priority
  (ultraserver/preemption.py).

Nodes without UltraServer labels are left alone: the pod's nodeSelector picks the type.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec

from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.resources import RequestError
from neuron_scheduler.kube.objects import Node, Pod, PodGroup, UltraServerClaim
from neuron_scheduler.kube.reading import epoch, gated, neuron_request
from neuron_scheduler.kube.views import node_name, pod_uid, replace_all
from neuron_scheduler.ultraserver.claims import ClaimError, NodeClaim, from_object
from neuron_scheduler.ultraserver.jobs import MAX_GANG, JobKey, Member, MembershipError, member_of
from neuron_scheduler.ultraserver.labels import (
    DEFAULT_NODE_CONFIG,
    DEFAULT_SERVER_ID,
    MODE_LABEL,
    NODE_CONFIG_KEY,
    NodeConfigError,
    parse_node_config,
    server_id_label,
)

UnitKey = tuple[int, str]  # (config, server id); config 1: (1, node name)
log = logging.getLogger(__name__)
CLAIM_SECONDS = 120.0

# Why the waker hears of nodes (extender/loops/waking): a claim was made (its job's members may go
# there now) or ended (other jobs may plan for the nodes).
CLAIM_MADE = "claim_made"
CLAIM_ENDED = "claim_ended"


def pod_node_config(pod: Pod) -> int:
    """The member's node config; NodeConfigError names the annotation or label when it is bad."""
    annotations, labels = pod.metadata.annotations, pod.metadata.labels
    if NODE_CONFIG_KEY in annotations:
        return parse_node_config(annotations[NODE_CONFIG_KEY], f"annotation {NODE_CONFIG_KEY}")
    if NODE_CONFIG_KEY in labels:
        return parse_node_config(labels[NODE_CONFIG_KEY], f"label {NODE_CONFIG_KEY}")
    return DEFAULT_NODE_CONFIG


def job_text(job: JobKey) -> str:
    return f"{job[0]}/{job[1]}"


@dataclass(frozen=True, slots=True)
class Worker:
    """A member bound (or being bound) to a node, with what preemption weighs it by."""

    node: str
    job: JobKey
    config: int
    priority: int = 0
    started: float = 0.0  # seconds since the epoch: status.startTime, else creation (0: unknown)


@dataclass(frozen=True, slots=True)
class Pending:
    """A member not bound yet: what the planner reserves for."""

    pod: Pod
    member: Member
    config: int


@dataclass
class Occupancy:
    """UltraServer nodes by unit, members by node and job, claims by node: a view the
    extender's watches feed (nodes, pods, UltraServerClaims, PodGroups), and a reserver bind tells
    about a member it is placing (kube-scheduler asks about the next member before this
    binding is visible in the watch)."""

    servers: dict[str, dict[int, str]] = field(default_factory=dict)  # node -> config -> id
    members: dict[UnitKey, set[str]] = field(default_factory=dict)
    workers: dict[str, Worker] = field(default_factory=dict)  # pod uid -> worker
    on_node: dict[str, dict[str, Worker]] = field(default_factory=dict)
    pending: dict[str, Pending] = field(default_factory=dict)  # pod uid -> unbound member
    claims: dict[str, NodeClaim] = field(default_factory=dict)  # node -> its job's claim
    by_job: dict[JobKey, set[str]] = field(default_factory=dict)  # job -> its claimed nodes
    pod_groups: dict[JobKey, int] = field(default_factory=dict)  # PodGroup -> gang minCount
    # Why a job has no claim yet (the planner's last word), for its members' refusals.
    shortfalls: dict[JobKey, str] = field(default_factory=dict)
    # Members counted from a bind's reservation that the watch has not shown bound yet.
    reserved: set[str] = field(default_factory=set)
    # Told which nodes' claims were made or ended (the waker); set by the wiring.
    on_freed: Callable[[Iterable[str], str], None] | None = None
    # Told when a job has pending members or lost its claim's nodes (the reservation loop).
    on_change: Callable[[], None] | None = None
    rejected: dict[str, str] = field(default_factory=dict)  # claim name -> why it is ignored
    # Why claims cannot be kept at all (the cluster has no UltraServerClaim CRD), or None.
    unavailable: str | None = None
    # Jobs kube-scheduler asked the preempt verb for (a member of each), by when (the verb's
    # clock): the reservation loop works out and carries out the preemption.
    preemption_asks: dict[JobKey, float] = field(default_factory=dict)

    # --- feeding: nodes ----------------------------------------------------------------------

    def apply_node(self, node: Node) -> None:
        name = node.metadata.name
        labels = node.metadata.labels
        ids: dict[int, str] = {}
        if MODE_LABEL in labels:
            ids[1] = name
            for config in (2, 4):
                value = labels.get(server_id_label(config), "").strip().lower()
                if value and value != DEFAULT_SERVER_ID:
                    ids[config] = value
        if self.servers.get(name) == (ids or None):
            return
        self.remove_node(name)
        if ids:
            self.servers[name] = ids
            for config, server in ids.items():
                self.members.setdefault((config, server), set()).add(name)
        self._changed()

    def remove_node(self, name: str) -> None:
        for config, server in self.servers.pop(name, {}).items():
            unit = self.members.get((config, server))
            if unit is not None:
                unit.discard(name)
                if not unit:
                    del self.members[(config, server)]

    def replace_nodes(self, nodes: Iterable[Node]) -> None:
        replace_all(nodes, node_name, self.apply_node, self.servers, self.remove_node)

    # --- feeding: pods -----------------------------------------------------------------------

    def apply_pod(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        if uid in self.reserved and not pod.spec.nodeName and not pod.finished:
            return  # the watch has not caught up with the bind in flight (it shows our patch)
        self.reserved.discard(uid)  # bound or gone: from now on the watch speaks for it
        try:
            member = member_of(pod) if neuron_request(pod) is not None else None
        except (MembershipError, RequestError):
            member = None
        if (
            member is None
            or pod.finished
            or pod.metadata.deletionTimestamp is not None
            or gated(pod)  # not pending (Kueue has not admitted its job): nothing is claimed
        ):
            self.remove_pod(uid)
            return
        try:
            config = pod_node_config(pod)
        except NodeConfigError:
            config = DEFAULT_NODE_CONFIG
        node = pod.spec.nodeName
        if not node:
            self._drop_worker(uid)
            known = self.pending.get(uid)
            self.pending[uid] = Pending(pod, member, config)
            if known is None:
                self._changed()
            return
        self.pending.pop(uid, None)
        started = epoch(pod.status.startTime or pod.metadata.creationTimestamp or "")
        worker = Worker(node, member.job, config, pod.spec.priority or 0, started)
        if self.workers.get(uid) == worker:
            return
        self._drop_worker(uid)
        self.workers[uid] = worker
        self.on_node.setdefault(node, {})[uid] = worker
        self._changed()

    def remove_pod(self, uid: str) -> None:
        self.reserved.discard(uid)
        gone = self.pending.pop(uid, None) is not None
        if self._drop_worker(uid) or gone:
            self._changed()

    def _drop_worker(self, uid: str) -> bool:
        worker = self.workers.pop(uid, None)
        if worker is None:
            return False
        here = self.on_node.get(worker.node, {})
        here.pop(uid, None)
        if not here:
            self.on_node.pop(worker.node, None)
        return True

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        known = {**dict.fromkeys(self.workers), **dict.fromkeys(self.pending)}
        replace_all(pods, pod_uid, self.apply_pod, known, self.remove_pod)

    # --- feeding: claims and PodGroups -------------------------------------------------------

    def apply_claim(self, found: UltraServerClaim) -> None:
        try:
            claim = from_object(found)
        except ClaimError as error:
            # Its node stays taken: someone claimed it, even if not as we would have.
            if found.metadata.name not in self.rejected:
                log.warning("%s; its node is kept out of every plan", loggable(error))
            self.rejected[found.metadata.name] = str(error)
            return
        self.rejected.pop(found.metadata.name, None)
        self.hold(claim)

    def remove_claim(self, found: UltraServerClaim) -> None:
        self.rejected.pop(found.metadata.name, None)
        self.release(found.metadata.name, found.metadata.uid)

    def replace_claims(self, listed: Iterable[UltraServerClaim]) -> None:
        by_name = {found.metadata.name: found for found in listed}
        for node in [n for n in self.claims if n not in by_name]:
            self.release(node)
        for name in [n for n in self.rejected if n not in by_name]:
            del self.rejected[name]
        for found in by_name.values():
            self.apply_claim(found)

    def hold(self, claim: NodeClaim) -> None:
        """A claim written (or seen). The waker hears of the job's nodes once its claim is
        complete (before, it admits nobody), and of each node added to a complete claim."""
        known = self.claims.get(claim.node)
        if known == claim:
            return
        if known is not None and known.job != claim.job:
            self._unindex(known)
        was_complete = self.complete(claim.job)
        self.claims[claim.node] = claim
        self.by_job.setdefault(claim.job, set()).add(claim.node)
        self.shortfalls.pop(claim.job, None)
        if self.on_freed is None or not self.complete(claim.job):
            return
        if not was_complete:
            self.on_freed(sorted(self.claimed(claim.job)), CLAIM_MADE)
        elif known is None or known.job != claim.job:
            self.on_freed((claim.node,), CLAIM_MADE)

    def _unindex(self, claim: NodeClaim) -> None:
        nodes = self.by_job.get(claim.job)
        if nodes is not None:
            nodes.discard(claim.node)
            if not nodes:
                del self.by_job[claim.job]

    def release(self, node: str, uid: str = "") -> None:
        """The claim on `node` ended (`uid`: only if it is still that object's: a delete the
        watch shows late must not end the claim written since)."""
        known = self.claims.get(node)
        if known is None or (uid and known.uid and known.uid != uid):
            return
        del self.claims[node]
        self._unindex(known)
        if self.on_freed is not None:
            self.on_freed((node,), CLAIM_ENDED)
        self._changed()

    def apply_pod_group(self, group: PodGroup) -> None:
        meta = group.metadata
        gang = group.spec.schedulingPolicy.gang
        key = (meta.namespace, meta.name)
        if gang is not None and 1 <= gang.minCount <= MAX_GANG:
            if self.pod_groups.get(key) != gang.minCount:
                self.pod_groups[key] = gang.minCount
                self._changed()
        else:
            self.pod_groups.pop(key, None)

    def remove_pod_group(self, group: PodGroup) -> None:
        self.pod_groups.pop((group.metadata.namespace, group.metadata.name), None)

    def replace_pod_groups(self, groups: Iterable[PodGroup]) -> None:
        self.pod_groups.clear()
        for group in groups:
            self.apply_pod_group(group)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # --- binds in flight ---------------------------------------------------------------------

    def reserve(self, pod: Pod, node: str, placement: Placement) -> None:
        """The member counts on `node` from now on, as if the watch had shown it bound there."""
        self.apply_pod(
            msgspec.structs.replace(pod, spec=msgspec.structs.replace(pod.spec, nodeName=node))
        )
        if pod.metadata.uid in self.workers:
            self.reserved.add(pod.metadata.uid)

    def unreserve(self, pod: Pod, node: str) -> None:
        """The bind to `node` did not happen: the pod is not a member there (unless the watch
        has shown it bound meanwhile: then the watch speaks for it)."""
        uid = pod.metadata.uid
        worker = self.workers.get(uid)
        if uid in self.reserved and worker is not None and worker.node == node:
            self._drop_worker(uid)
            self.reserved.discard(uid)
            self.apply_pod(pod)  # pending again

    # --- reading -----------------------------------------------------------------------------

    def unit(self, node: str, config: int) -> UnitKey | None:
        server = self.servers.get(node, {}).get(config)
        return (config, server) if server is not None else None

    def nodes_of(self, unit: UnitKey) -> set[str]:
        return self.members.get(unit, set())

    def footprint(self, node: str, config: int) -> set[str]:
        unit = self.unit(node, config)
        return self.nodes_of(unit) if unit else {node}

    def claimed(self, job: JobKey) -> set[str]:
        return set(self.by_job.get(job, ()))

    def held_units(self, job: JobKey) -> set[UnitKey]:
        """The units whose every node the job's claim holds."""
        claimed = self.claimed(job)
        units = set()
        for node in claimed:
            unit = self.unit(node, self.claims[node].config)
            if unit is not None and self.nodes_of(unit) <= claimed:
                units.add(unit)
        return units

    def claimed_size(self, job: JobKey) -> int:
        """The members the job's claim was written for (the largest, while it grows)."""
        return max((self.claims[n].size for n in self.by_job.get(job, ())), default=0)

    def complete(self, job: JobKey) -> bool:
        """Whether the job's claim holds nodes for all the members it was written for (a claim
        being written, or one a crash left half written, admits nobody: all or nothing)."""
        nodes = self.by_job.get(job)
        if not nodes:
            return False
        config = self.claims[next(iter(nodes))].config
        return len(self.held_units(job)) >= math.ceil(self.claimed_size(job) / config)

    def jobs(self) -> dict[JobKey, list[Pending]]:
        """Jobs with members waiting, each job's members oldest first."""
        found: dict[JobKey, list[Pending]] = {}
        for waiting in self.pending.values():
            found.setdefault(waiting.member.job, []).append(waiting)
        for members in found.values():
            members.sort(key=lambda p: (p.pod.metadata.creationTimestamp or "", p.pod.key))
        return found

    def job_workers(self, job: JobKey) -> list[Worker]:
        return [w for w in self.workers.values() if w.job == job]

    def size(self, member: Member, job: JobKey) -> int:
        """How many members the job has: its PodGroup's minCount, else what its pods say, else
        the members seen (bound and waiting)."""
        if member.pod_group is not None and job in self.pod_groups:
            return self.pod_groups[job]
        if member.size is not None:
            return member.size
        seen = sum(1 for w in self.workers.values() if w.job == job)
        return seen + sum(1 for p in self.pending.values() if p.member.job == job)

    def blocker(self, job: JobKey, area: set[str]) -> str | None:
        """Why another job keeps `job` out of these nodes (its members or its claim are on the
        same UltraServer in a way that overlaps), or None."""
        for _, claimed, other in self.others(job, area):
            if other is None:
                return "has an UltraServerClaim this extender cannot read"
            if claimed:
                return f"is reserved for job {job_text(other)}"
            return f"holds members of job {job_text(other)}"
        return None

    def others(self, job: JobKey, area: set[str]) -> Iterator[tuple[str, bool, JobKey | None]]:
        """What keeps `job` out of these nodes, node by node: another job's members (False) or
        claim (True) on the same UltraServer, in either job's node config, so that it overlaps
        (a 2-node job's pair inside a 4-node unit counts); None for a claim this extender cannot
        read."""
        near: set[str] = set()
        for name in area:
            for config in (1, 2, 4):
                near |= self.footprint(name, config)
        for name in sorted(near):
            for worker in self.on_node.get(name, {}).values():
                if worker.job != job and self.footprint(worker.node, worker.config) & area:
                    yield name, False, worker.job
            claim = self.claims.get(name)
            if claim is not None and claim.job != job and self.footprint(name, claim.config) & area:
                yield name, True, claim.job
            if name in self.rejected and name in area:
                yield name, True, None


def job_progress(occupancy: Occupancy, job: JobKey, now: float) -> str | None:
    """For a job whose claim holds more members than are bound: "job ns/x has 4 of its 8
    members, holding UltraServers b, c since ..." (`now`: wall clock); None otherwise."""
    nodes = occupancy.claimed(job)
    if not nodes:
        return None
    size = occupancy.claimed_size(job)
    bound = sum(1 for w in occupancy.job_workers(job) if w.node in nodes)
    if bound >= size:
        return None
    config = occupancy.claims[next(iter(nodes))].config
    units = sorted({(occupancy.unit(n, config) or (config, n))[1] for n in nodes})
    shown = ", ".join(units[:6]) + (f" and {len(units) - 6} more" if len(units) > 6 else "")
    kind = "UltraServer" if config == 4 else "UltraServer pair" if config == 2 else "node"
    created = [occupancy.claims[n].created for n in nodes if occupancy.claims[n].created]
    since = ""
    if created:
        first = min(created)
        stamp = datetime.fromtimestamp(first, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        since = f" since {stamp} ({max(0.0, now - first):.0f}s ago)"
    return (
        f"job {job_text(job)} has {bound} of its {size} members, holding {kind}"
        f"{'s' if len(units) != 1 else ''} {shown}{since}"
    )


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Why a job's units cannot be reserved now."""

    reason: str


def unit_words(config: int, count: int, free: str = "free ") -> str:
    if config == 4:
        return f"{count} {free}UltraServer{'s' if count != 1 else ''} of 4 nodes"
    if config == 2:
        return f"{count} {free}UltraServer pair{'s' if count != 1 else ''} (2 nodes)"
    return f"{count} {free}UltraServer node{'s' if count != 1 else ''}"


def never_fits(
    occupancy: Occupancy,
    job: JobKey,
    config: int,
    size: int,
    excluded: Callable[[str], str | None],
) -> Shortfall | None:
    """Why the job can never run here, or None: its size needs more units than there are with
    nodes its members could all run on, whatever runs there (`excluded(node)`: why a member
    never can, from its spec and the devices it asks for)."""
    needed = math.ceil(size / config)
    admitted = 0
    for unit, nodes in occupancy.members.items():
        if unit[0] == config and len(nodes) == config:
            admitted += all(excluded(n) is None for n in nodes)
            if admitted >= needed:
                return None
    return Shortfall(
        f"job {job_text(job)} can never run here: it needs {unit_words(config, needed, '')} for "
        f"its {size} members, and {admitted} {'has' if admitted == 1 else 'have'} nodes all of "
        "which its members may use (their nodeSelector, affinity, tolerations and the devices "
        "they ask for, on the nodes as they are now)"
    )


def plan(
    occupancy: Occupancy,
    job: JobKey,
    config: int,
    size: int,
    usable: Callable[[str], str | None],
    excluded: Callable[[str], str | None] | None = None,
) -> list[str] | Shortfall:
    """The nodes to claim for `job` so all `size` of its members have one (whole units, added
    to what it holds already), or why not (with `excluded`, saying so when it never can: see
    `never_fits`). `usable(node)`: why a member cannot run there now, or None. Units holding the
    job's own bound members come first, then the lowest server ids."""
    held_units = occupancy.held_units(job)
    needed = math.ceil(size / config) - len(held_units)
    if needed <= 0:
        return []
    own = {w.node for w in occupancy.job_workers(job)}
    free: list[tuple[int, str, UnitKey]] = []
    for unit, nodes in occupancy.members.items():
        if unit[0] != config or unit in held_units or len(nodes) != config:
            continue
        if occupancy.blocker(job, set(nodes)) is not None:
            continue
        if any(n not in own and usable(n) is not None for n in nodes):
            continue
        free.append((0 if nodes & own else 1, unit[1], unit))
    if len(free) < needed:
        never = never_fits(occupancy, job, config, size, excluded) if excluded else None
        return never or shortfall(job, config, size, needed, len(free), bool(held_units))
    chosen = [unit for _, _, unit in sorted(free)[:needed]]
    return sorted(n for unit in chosen for n in occupancy.nodes_of(unit))


def shortfall(job: JobKey, config: int, size: int, needed: int, free: int, more: bool) -> Shortfall:
    return Shortfall(
        f"job {job_text(job)} needs {unit_words(config, needed)}{' more' if more else ''} for "
        f"its {size} members, {free} free; nothing is reserved until all of them fit"
    )


NOBODY: JobKey = ("", "")  # a job of no members and no claim: what every new job is


def openings(
    occupancy: Occupancy, config: int, usable: Callable[[str], str | None]
) -> list[UnitKey]:
    """The units a job with no member and no claim yet could get now, lowest server id first:
    what `plan` would find for it, computed once for all such jobs alike."""
    found = []
    for unit, nodes in sorted(occupancy.members.items(), key=lambda item: item[0][1]):
        if unit[0] != config or len(nodes) != config:
            continue
        if occupancy.blocker(NOBODY, set(nodes)) is None and all(usable(n) is None for n in nodes):
            found.append(unit)
    return found


def unreadable(occupancy: Occupancy, node: str) -> str:
    return (
        f"UltraServer node with an UltraServerClaim this extender cannot read "
        f"({occupancy.rejected[node]})"
    )


@dataclass
class UnitChoice:
    """Which candidate nodes a member may take."""

    passed: list[str]
    failed: dict[str, str]


def decide(
    occupancy: Occupancy, member: Member, config: int, candidates: list[str], uid: str = ""
) -> UnitChoice:
    """Which candidate nodes a member of `member.job` may take: the free nodes of its job's
    claim; every other UltraServer node is refused with why. `uid`: the member's own pod, never
    in its own way (bind asks again about a pod it counts already)."""
    job = member.job
    claimed = occupancy.claimed(job) if occupancy.complete(job) else set()
    own = {w.node for u, w in occupancy.workers.items() if w.job == job and u != uid}
    decision = UnitChoice([], {})
    shown = ", ".join(sorted(claimed)[:4]) + (" ..." if len(claimed) > 4 else "")
    for name in candidates:
        if name not in occupancy.servers:
            decision.passed.append(name)  # not an UltraServer node: not ours to judge
            continue
        claim = occupancy.claims.get(name)
        others = [
            w.job for u, w in occupancy.on_node.get(name, {}).items() if w.job != job and u != uid
        ]
        if name in occupancy.rejected:
            decision.failed[name] = unreadable(occupancy, name)
        elif not claimed:
            # One reason for the job on every node, so kube-scheduler's event says it once.
            decision.failed[name] = (
                occupancy.unavailable
                or occupancy.shortfalls.get(job)
                or (
                    f"job {job_text(job)} has no UltraServer nodes reserved yet: they are reserved "
                    "for all its members at once"
                )
            )
        elif claim is not None and claim.job != job:
            decision.failed[name] = f"UltraServer node reserved for job {claim.job_text}"
        elif others:
            decision.failed[name] = f"runs a member of job {job_text(others[0])}"
        elif name in own:
            decision.failed[name] = f"already runs a member of job {job_text(job)}"
        elif name in claimed:
            decision.passed.append(name)
        else:
            decision.failed[name] = (
                f"job {job_text(job)}'s members go to the UltraServer nodes reserved for it "
                f"({shown})"
            )
    _one_unit_at_a_time(occupancy, job, config, own, decision)
    return decision


def _one_unit_at_a_time(
    occupancy: Occupancy, job: JobKey, config: int, own: set[str], decision: UnitChoice
) -> None:
    """Of the claim's nodes that passed, only those of one unit: the one with the most of the
    job's members already (then the lowest server id), so members fill a unit before the next
    and a job that never becomes whole leaves the others free once its claim ends. (A unit of
    config 1 is one node: nothing to fill.)"""
    if config == 1:
        return
    by_unit: dict[UnitKey, list[str]] = {}
    for name in decision.passed:
        unit = occupancy.unit(name, config)
        if unit is not None and name in occupancy.claims:
            by_unit.setdefault(unit, []).append(name)
    if len(by_unit) < 2:
        return
    members: dict[UnitKey, int] = {}
    for name in own:
        unit = occupancy.unit(name, config)
        if unit is not None:
            members[unit] = members.get(unit, 0) + 1
    first = min(by_unit, key=lambda unit: (-members.get(unit, 0), unit))
    for unit, names in by_unit.items():
        if unit == first:
            continue
        for name in names:
            decision.passed.remove(name)
            decision.failed[name] = (
                f"job {job_text(job)} fills UltraServer {first[1]} first (one unit at a time, "
                "so a job that never becomes whole holds as few as it can)"
            )


class UnitPlacement:
    """The extender's node filter: members go where their job's claim is."""

    outcome = "ultraserver_unit"  # the filter-outcome metric label for the nodes it fails

    def __init__(
        self,
        occupancy: Occupancy,
        unusable: Callable[[Pod, str], str | None] | None = None,
        excluded: Callable[[Pod, str], str | None] | None = None,
    ) -> None:
        """`unusable(pod, node)`: why the member cannot run on the node (the ledger's view), so
        the first refusal of a job without a claim says why it has none (the reservation loop
        says it after, and kube-scheduler retries a refused pod only on an event);
        `excluded(pod, node)`: why it never can (then it says the job can never run here)."""
        self.occupancy = occupancy
        self.unusable = unusable
        self.excluded = excluded
        # Jobs whose members kube-scheduler asked about (the reservation loop renews their
        # claims and plans for them first), by the time of the last ask (filter's clock).
        self.asked: dict[JobKey, float] = {}

    def filter(self, pod: Pod, passed: list[str], now: float) -> tuple[list[str], dict[str, str]]:
        """Narrow the nodes that passed the device check; returns (passed, newly failed)."""
        servers = self.occupancy.servers
        if not any(n in servers for n in passed):
            return passed, {}
        try:
            member = member_of(pod)
            if member is None:
                return self._outsider(passed)
            config = pod_node_config(pod)
        except (NodeConfigError, MembershipError) as error:
            return [n for n in passed if n not in servers], {
                n: str(error) for n in passed if n in servers
            }
        self.asked[member.job] = now
        if len(self.asked) > 10_000:
            del self.asked[next(iter(self.asked))]
        occupancy = self.occupancy
        if not occupancy.complete(member.job):
            if member.job not in occupancy.shortfalls and self.unusable is not None:
                occupancy.shortfalls[member.job] = self._why_no_claim(pod, member, config)
            if occupancy.on_change is not None:
                occupancy.on_change()  # the reservation loop plans for it
        decision = decide(occupancy, member, config, passed, pod.metadata.uid)
        return decision.passed, decision.failed

    def _why_no_claim(self, pod: Pod, member: Member, config: int) -> str:
        assert self.unusable is not None
        size = max(self.occupancy.size(member, member.job), 1)
        excluded = functools.partial(self.excluded, pod) if self.excluded else None
        planned = plan(
            self.occupancy,
            member.job,
            config,
            size,
            functools.partial(self.unusable, pod),
            excluded,
        )
        if isinstance(planned, Shortfall):
            return planned.reason
        return (
            f"job {member.text} fits on {len(planned)} UltraServer nodes now: they are being "
            "reserved for all its members at once"
        )

    def _outsider(self, passed: list[str]) -> tuple[list[str], dict[str, str]]:
        """A pod of no job stays off the nodes claimed for a job (they wait for its members)."""
        claims, rejected = self.occupancy.claims, self.occupancy.rejected
        failed = {
            n: f"UltraServer node reserved for job {claims[n].job_text}"
            if n in claims
            else unreadable(self.occupancy, n)
            for n in passed
            if n in claims or n in rejected
        }
        return ([n for n in passed if n not in failed], failed) if failed else (passed, {})

    def admits(self, pod: Pod, node: str, now: float) -> bool:
        """Whether `filter` would pass the pod on this node now."""
        if node not in self.occupancy.servers:
            return True
        try:
            member = member_of(pod)
            if member is None:
                return node not in self.occupancy.claims and node not in self.occupancy.rejected
            config = pod_node_config(pod)
        except (NodeConfigError, MembershipError):
            return False
        return node in decide(self.occupancy, member, config, [node], pod.metadata.uid).passed
