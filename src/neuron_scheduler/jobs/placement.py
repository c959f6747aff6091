"""Training jobs, all or nothing, in whole units, close in the network: what the extender's
filter admits, and which units a job's claim takes. No I/O (the extender's reservation loop
writes the claims this reads: extender/loops/reserving.py).

A member is a pod of a training job that asks for Neuron devices (`jobs.members`: MPIJob,
PyTorchJob, JobSet, Kubeflow Trainer, LeaderWorkerSet, the Workload API's PodGroup, or our
annotation). A unit (`jobs.units`) is an UltraServer of the member's node config (4, 2 or 1
nodes, one member per node) where the nodes carry the UltraServer labels, else one Neuron node,
which takes as many members as it has room for (a member asking 8 of 16 devices: two). On every
Neuron node:

- a job's members go only to nodes its claim holds (`claims`, persisted: one object per node),
  as many as the claim gives each node (its slots);
- a job gets its claim when units for all its members are free together (`plan`): complete
  units, none holding or claimed for another job (in either job's config, so a 2-node job and a
  4-node job never share an UltraServer), every node able to take its members now; then all at
  once, chosen close in the network (`jobs.network`: a domain the job asks for, else the fewest
  network domains, best fit). Until then nothing is reserved and its members are refused with the
  reason ("needs 2 free UltraServers of 4 nodes, 1 free");
- a member that comes back (its pod deleted, its node drained) returns to a node of its job's
  claim; if none can take it, it waits and the rest of the job keeps its nodes;
- members whose framework gives them an index take the claim's nodes in network order, so
  consecutive ranks sit in the same domain;
- members fill one unit of the claim before the next, so a job that never becomes whole holds
  as few units as it can once its claim ends;
- a job whose size needs more units than there are with nodes its members could ever run on
  (its nodeSelector, affinity, tolerations, the devices it asks for) can never run here, and its
  members are refused with that;
- a job of higher priority may take units from whole jobs of lower priority
  (jobs/preemption.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import msgspec

from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.core.catalog import CapacityError
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.resources import RequestError
from neuron_scheduler.jobs.claims import ClaimError, NodeClaim, from_object
from neuron_scheduler.jobs.members import (
    MAX_GANG,
    JobKey,
    Member,
    MembershipError,
    Rank,
    member_of,
    rank_of,
)
from neuron_scheduler.jobs.network import (
    EKS_LEVELS,
    HOSTNAME,
    Atom,
    Closeness,
    choose,
    closeness_of,
    depth_of,
    holds,
    network_order,
    place_of,
)
from neuron_scheduler.jobs.units import (
    DEFAULT_NODE_CONFIG,
    DEFAULT_SERVER_ID,
    MODE_LABEL,
    NodeConfigError,
    pod_node_config,
    server_id_label,
)
from neuron_scheduler.kube.objects import JobClaim, Node, Pod, PodGroup
from neuron_scheduler.kube.reading import epoch, gated, held_request, neuron_request, node_capacity
from neuron_scheduler.kube.views import node_name, pod_uid, replace_all

UnitKey = tuple[int, str]  # (config, server id); config 1: (1, node name)
log = logging.getLogger(__name__)
CLAIM_SECONDS = 120.0
MAX_TOLD_FITS = 10_000  # jobs remembered as told they fit now (beyond: not told otherwise later)

# Why the waker hears of nodes (extender/loops/waking): a claim was made (its job's members may go
# there now) or ended (other jobs may plan for the nodes).
CLAIM_MADE = "claim_made"
CLAIM_ENDED = "claim_ended"


def claims_absent(why: str) -> str:
    """What `Occupancy.unavailable` says when claims cannot be kept (`why`: "not served", the
    cluster has no UltraServerClaim CRD; or the extender may not list them)."""
    return (
        f"job claims are not available ({why}): no training job is placed on UltraServer "
        "nodes, and on other nodes jobs are placed pod by pod (not all or nothing); install the "
        "chart's UltraServerClaim CRD (scheduler.ultraserver.installCRD)"
    )


def _neuron_node(node: Node) -> bool:
    """Whether the node advertises Neuron devices or cores (one advertising what cannot be
    read counts: the ledger refuses it to every member, and says why)."""
    try:
        devices, cores = node_capacity(node)
    except CapacityError:
        return True
    return bool(devices or cores)


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
    rank: Rank | None = None  # where its framework's index puts it among the job's members


@dataclass(frozen=True, slots=True)
class Pending:
    """A member not bound yet: what the planner reserves for."""

    pod: Pod
    member: Member
    config: int


@dataclass
class Occupancy:
    """Neuron nodes by unit, members by node and job, claims by node: a view the
    extender's watches feed (nodes, pods, UltraServerClaims, PodGroups), and a reserver bind tells
    about a member it is placing (kube-scheduler asks about the next member before this
    binding is visible in the watch)."""

    # Every Neuron node -> config -> its unit's id (config 1: the node; 2 and 4: UltraServer
    # server ids, on UltraServer nodes).
    servers: dict[str, dict[int, str]] = field(default_factory=dict)
    ultraservers: set[str] = field(default_factory=set)  # the nodes with UltraServer labels
    levels: tuple[str, ...] = EKS_LEVELS  # the topology levels (node-label keys, broadest first)
    places: dict[str, tuple[str, ...]] = field(default_factory=dict)  # node -> its place
    members: dict[UnitKey, set[str]] = field(default_factory=dict)
    workers: dict[str, Worker] = field(default_factory=dict)  # pod uid -> worker
    on_node: dict[str, dict[str, Worker]] = field(default_factory=dict)
    pending: dict[str, Pending] = field(default_factory=dict)  # pod uid -> unbound member
    claims: dict[str, NodeClaim] = field(default_factory=dict)  # node -> its job's claim
    by_job: dict[JobKey, set[str]] = field(default_factory=dict)  # job -> its claimed nodes
    pod_groups: dict[JobKey, int] = field(default_factory=dict)  # PodGroup -> gang minCount
    # Why a job has no claim yet (the planner's last word), for its members' refusals.
    shortfalls: dict[JobKey, str] = field(default_factory=dict)
    # Jobs whose members filter's first refusal told they fit now (their claim is on its way):
    # when the reservation loop finds otherwise, it tells them (kube-scheduler asks again only on
    # a cluster event, and its event on them keeps the word it heard).
    told_fits: set[JobKey] = field(default_factory=set)
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
        ultra = MODE_LABEL in labels
        if ultra or _neuron_node(node):
            ids[1] = name
        if ultra:
            for config in (2, 4):
                value = labels.get(server_id_label(config), "").strip().lower()
                if value and value != DEFAULT_SERVER_ID:
                    ids[config] = value
        place = place_of(labels, self.levels)
        known = (self.servers.get(name), name in self.ultraservers, self.places.get(name))
        if known == (ids or None, ultra and bool(ids), place if ids else None):
            return
        self.remove_node(name)
        if ids:
            self.servers[name] = ids
            self.places[name] = place
            if ultra:
                self.ultraservers.add(name)
            for config, server in ids.items():
                self.members.setdefault((config, server), set()).add(name)
        self._changed()

    def remove_node(self, name: str) -> None:
        self.ultraservers.discard(name)
        self.places.pop(name, None)
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
        # A bound member counts by what it holds there: one with a Neuron sidecar, never placed
        # by us but bound before, or by another scheduler, is still its job's (evicted with it).
        read = held_request if pod.spec.nodeName else neuron_request
        try:
            member = member_of(pod) if read(pod) is not None else None
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
        priority = pod.spec.priority or 0
        worker = Worker(node, member.job, config, priority, started, rank_of(pod, member))
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

    def apply_claim(self, found: JobClaim) -> None:
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

    def remove_claim(self, found: JobClaim) -> None:
        self.rejected.pop(found.metadata.name, None)
        self.release(found.metadata.name, found.metadata.uid)

    def replace_claims(self, listed: Iterable[JobClaim]) -> None:
        by_name = {found.metadata.name: found for found in listed}
        for node in [n for n in self.claims if n not in by_name]:
            self.release(node)
        for name in [n for n in self.rejected if n not in by_name]:
            del self.rejected[name]
        for found in by_name.values():
            self.apply_claim(found)

    def hold(self, claim: NodeClaim) -> None:
        """A claim written (or seen). The waker hears of the job's nodes once its claim is
        complete (before, it admits nobody), and of each node added to a complete claim or
        given more of its members."""
        known = self.claims.get(claim.node)
        if known == claim:
            return
        if known is not None and known.job != claim.job:
            self._unindex(known)
        was_complete = self.complete(claim.job)
        self.claims[claim.node] = claim
        self.by_job.setdefault(claim.job, set()).add(claim.node)
        self.shortfalls.pop(claim.job, None)
        self.told_fits.discard(claim.job)
        if self.on_freed is None or not self.complete(claim.job):
            return
        if not was_complete:
            self.on_freed(sorted(self.claimed(claim.job)), CLAIM_MADE)
        elif known is None or known.job != claim.job or claim.slots > known.slots:
            self.on_freed((claim.node,), CLAIM_MADE)  # (more slots: a member waits for one)

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

    def rules(self, node: str) -> bool:
        """Whether the training-job rule decides for members on this node: a Neuron node, and,
        while claims cannot be kept (`unavailable`), only an UltraServer node (members go pod
        by pod on the others, and kube-scheduler preempts for them node by node)."""
        return node in self.servers and (not self.unavailable or node in self.ultraservers)

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

    def kept_beside(self, job: JobKey, nodes: Iterable[str]) -> set[str]:
        """`nodes` (the job's plan) and the nodes whose claims the job keeps beside them: those
        of the units it holds whole, and of the units where it has members, even when such a
        unit is no longer whole (a node joined its UltraServer) and the plan goes elsewhere: let
        go, the members there would run outside any claim, and the job's claims would end with
        them. The reservation loop lets go of the rest."""
        kept = set(nodes)
        for unit in self.held_units(job):
            kept |= self.nodes_of(unit)
        for worker in self.job_workers(job):
            kept |= self.footprint(worker.node, worker.config)
        return kept

    def claimed_size(self, job: JobKey) -> int:
        """The members the job's claim was written for (the largest, while it grows)."""
        return max((self.claims[n].size for n in self.by_job.get(job, ())), default=0)

    def held_room(self, job: JobKey) -> int:
        """The members the units its claim holds whole take (their nodes' slots)."""
        return sum(
            self.claims[n].slots for unit in self.held_units(job) for n in self.nodes_of(unit)
        )

    def complete(self, job: JobKey) -> bool:
        """Whether the job's claim holds nodes for all the members it was written for (a claim
        being written, or one a crash left half written, admits nobody: all or nothing)."""
        if not self.by_job.get(job):
            return False
        return self.held_room(job) >= self.claimed_size(job)

    def ultra_claim(self, job: JobKey) -> bool:
        """Whether the job's claim holds UltraServer units (of 2 or 4 nodes) rather than
        nodes of their own."""
        return any(self.claims[n].config > 1 for n in self.by_job.get(job, ()))

    def slot_order(self, job: JobKey) -> list[str]:
        """The job's claimed nodes, each as often as its slots, in network order: the node the
        member of each rank goes to."""
        claimed = self.claimed(job)
        units = {n: unit[1] for n in claimed if (unit := self.unit(n, self.claims[n].config))}
        nodes = network_order(self.places, claimed, units)
        return [n for n in nodes for _ in range(self.claims[n].slots)]

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

    def job_nodes(self, job: JobKey, uid: str = "") -> dict[str, int]:
        """The job's members on each node (the pod `uid` not counted)."""
        found: dict[str, int] = {}
        for u, w in self.workers.items():
            if w.job == job and u != uid:
                found[w.node] = found.get(w.node, 0) + 1
        return found

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


def unit_kind(config: int, ultra: bool, count: int) -> str:
    """What a claim's units are called: UltraServers (of 4 nodes), UltraServer pairs, UltraServer
    nodes, or nodes."""
    plural = "s" if count != 1 else ""
    if ultra and config == 4:
        return f"UltraServer{plural}"
    if ultra and config == 2:
        return f"UltraServer pair{plural}"
    return f"{'UltraServer ' if ultra else ''}node{plural}"


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
    config = max(occupancy.claims[n].config for n in nodes)
    units = sorted({(occupancy.unit(n, config) or (config, n))[1] for n in nodes})
    shown = ", ".join(units[:6]) + (f" and {len(units) - 6} more" if len(units) > 6 else "")
    kind = unit_kind(config, occupancy.ultra_claim(job), len(units))
    created = [occupancy.claims[n].created for n in nodes if occupancy.claims[n].created]
    since = ""
    if created:
        first = min(created)
        stamp = datetime.fromtimestamp(first, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        since = f" since {stamp} ({max(0.0, now - first):.0f}s ago)"
    return f"job {job_text(job)} has {bound} of its {size} members, holding {kind} {shown}{since}"


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Why a job's units cannot be reserved now."""

    reason: str


def unit_words(config: int, count: int, free: str = "free ", ultra: bool = True) -> str:
    if ultra and config == 4:
        return f"{count} {free}UltraServer{'s' if count != 1 else ''} of 4 nodes"
    if ultra and config == 2:
        return f"{count} {free}UltraServer pair{'s' if count != 1 else ''} (2 nodes)"
    return f"{count} {free}{unit_kind(1, ultra, count)}"


def _one(node: str, most: int) -> int:
    return 1


@dataclass(frozen=True, slots=True)
class Fit:
    """What the planner asks about a job's members (its first waiting member stands for all)
    on each node: `usable(node)`, why a member cannot run there now (None: it can);
    `room(node, most)`, how many members (up to `most`) a node it can run on takes now;
    `excluded(node)`, why a member never can whatever runs there (None: it may); `empty_room(node,
    most)`, how many a node it may use takes with nothing else on it. An UltraServer node takes one
    member whatever its room (ultraserver-init gives each node one rank)."""

    usable: Callable[[str], str | None]
    room: Callable[[str, int], int] = _one
    excluded: Callable[[str], str | None] | None = None
    empty_room: Callable[[str, int], int] = _one
    kind: bytes | None = None  # members of one kind get the same answers (None: unknown)


# Units open to a new job (no member bound, no claim), by what decides them: its config, kind,
# UltraServer or not, now or empty; with the job size they were worked out for (a unit's room is
# counted up to it: a smaller job's is that room capped at its size). Shared by the jobs planned
# in one step.
AtomsMemo = dict[
    tuple[int, bytes, bool, bool], tuple[int, list[Atom[UnitKey]], list[Atom[UnitKey]]]
]


def _place(occupancy: Occupancy, nodes: Iterable[str]) -> tuple[str, ...]:
    """A unit's place: its first node's (an UltraServer's nodes share their network labels)."""
    return occupancy.places.get(min(nodes), ())


def _atoms(
    occupancy: Occupancy,
    job: JobKey,
    config: int,
    size: int,
    fit: Fit,
    ultra: bool,
    empty: bool = False,
    memo: AtomsMemo | None = None,
) -> tuple[list[Atom[UnitKey]], list[Atom[UnitKey]]]:
    """The units the job could take now (`empty`: that it may ever take, as if nothing ran
    there), each with the members it takes, and apart from them the units holding its own bound
    members (it keeps those first): UltraServer units of its config (`ultra`), else nodes of
    their own (plain Neuron nodes, and UltraServer nodes for a job of config 1). Units its claim
    holds whole are no candidates (their room counts already). `memo`: what a new job of the
    same kind found this step (a job with members or a claim works its own out)."""
    own = occupancy.job_nodes(job)
    key = (config, fit.kind or b"", ultra, empty)
    shared = memo is not None and fit.kind is not None and not own and job not in occupancy.by_job
    if not shared or memo is None:
        return _units_open(occupancy, job, config, size, fit, ultra, empty, own)
    if key not in memo or memo[key][0] < size:
        # Worked out for twice the size it was for, at least: jobs of growing sizes in one
        # step cost a few scans of the nodes, not one each.
        most = min(MAX_GANG, max(size, 2 * memo[key][0] if key in memo else size))
        memo[key] = (most, *_units_open(occupancy, job, config, most, fit, ultra, empty, own))
    _, atoms, kept = memo[key]
    return [a if a.room <= size else replace(a, room=size) for a in atoms], kept


def _units_open(
    occupancy: Occupancy,
    job: JobKey,
    config: int,
    size: int,
    fit: Fit,
    ultra: bool,
    empty: bool,
    own: dict[str, int],
) -> tuple[list[Atom[UnitKey]], list[Atom[UnitKey]]]:
    held = occupancy.held_units(job)
    atoms: list[Atom[UnitKey]] = []
    kept: list[Atom[UnitKey]] = []
    if ultra:
        for unit, nodes in occupancy.members.items():
            if unit[0] != config or config == 1 or len(nodes) != config:
                continue
            if unit in held and not empty:
                continue  # (as if empty, every unit counts)
            if not empty and occupancy.blocker(job, set(nodes)) is not None:
                continue
            if empty:
                if fit.excluded is not None and any(fit.excluded(n) for n in nodes):
                    continue
            elif any(n not in own and fit.usable(n) is not None for n in nodes):
                continue
            atom = Atom(unit, config, _place(occupancy, nodes), config, unit[1])
            (kept if nodes & own.keys() and not empty else atoms).append(atom)
        return atoms, kept
    for node in occupancy.servers:
        unit = (1, node)
        single_member = node in occupancy.ultraservers
        if (unit in held and not empty) or (single_member and config != 1):
            continue
        if empty:
            if fit.excluded is not None and fit.excluded(node) is not None:
                continue
            room = 1 if single_member else fit.empty_room(node, size)
        else:
            if occupancy.blocker(job, {node}) is not None:
                continue
            mine = own.get(node, 0)
            more = 0
            if fit.usable(node) is None:
                more = 1 if single_member else fit.room(node, max(1, size - mine))
            room = 1 if single_member and mine else mine + more
        if room > 0:
            atom = Atom(unit, room, occupancy.places.get(node, ()), 1, node)
            (kept if node in own and not empty else atoms).append(atom)
    return atoms, kept


def _held(occupancy: Occupancy, job: JobKey) -> list[Atom[UnitKey]]:
    """The units the job's claim holds whole, as atoms (their nodes' slots)."""
    found = []
    for unit in occupancy.held_units(job):
        nodes = occupancy.nodes_of(unit)
        room = sum(occupancy.claims[n].slots for n in nodes)
        found.append(Atom(unit, room, _place(occupancy, nodes), len(nodes), unit[1]))
    return found


def _grown(
    occupancy: Occupancy, job: JobKey, held: list[Atom[UnitKey]], size: int, fit: Fit
) -> list[Atom[UnitKey]]:
    """The held units again, plain nodes given more members where the claim holds too few and
    they can take more now: a job whose size is the members seen so far claims a node for one,
    and its next member belongs next to the first while that node has room (otherwise the node,
    the job's alone, would turn it away and the job wait for another). Only the members missing
    are added, nodes running the job's members first, then in network order."""
    missing = size - sum(a.room for a in held)
    if missing <= 0:
        return held
    own = occupancy.job_nodes(job)
    growable = [a for a in held if a.key[0] == 1 and a.key[1] not in occupancy.ultraservers]
    order = network_order(occupancy.places, [a.key[1] for a in growable])
    rank = {node: index for index, node in enumerate(order)}
    growable.sort(key=lambda a: (-own.get(a.key[1], 0), rank[a.key[1]]))
    grown: dict[UnitKey, Atom[UnitKey]] = {}
    for atom in growable:
        node = atom.key[1]
        if missing <= 0:
            break
        if fit.usable(node) is not None:
            continue
        mine = own.get(node, 0)
        # What the node takes now: its members bound, and room for more on what is free (slots
        # given but not taken yet are free cores still, so they are in that room).
        room = min(size, mine + fit.room(node, max(1, size - mine)))
        extra = min(missing, room - atom.room)
        if extra > 0:
            grown[atom.key] = replace(atom, room=atom.room + extra)
            missing -= extra
    return [grown.get(a.key, a) for a in held]


@dataclass(frozen=True, slots=True)
class Planned:
    """The nodes to claim for a job (with the members each takes), in network order, and how
    far apart they are."""

    slots: dict[str, int]
    config: int  # the units' (1: nodes of their own)
    span: str  # "1 topology.k8s.aws/network-node-layer-3 domain"

    @property
    def nodes(self) -> list[str]:
        return list(self.slots)

    @property
    def where(self) -> str:
        """ "on 4 nodes, 1 topology.k8s.aws/network-node-layer-3 domain" """
        count = len(self.slots)
        return f"on {count} node{'s' if count != 1 else ''}" + (
            f", {self.span}" if self.span else ""
        )


def plan(
    occupancy: Occupancy,
    job: JobKey,
    config: int,
    size: int,
    fit: Fit,
    closeness: Closeness | None = None,
    memo: AtomsMemo | None = None,
) -> Planned | Shortfall:
    """The nodes to claim for `job` so all `size` of its members have room (whole units, added
    to what it holds already), chosen close in the network (`jobs.network.choose`), or why not
    (with `fit.excluded`, saying so when it never can: see `never_fits`). A job of node config 2
    or 4 gets UltraServer units where they fit, else nodes of their own."""
    held = _held(occupancy, job)
    if sum(a.room for a in held) >= size:
        return Planned({}, config, "")
    grown = _grown(occupancy, job, held, size, fit)
    kinds = (True, False) if config > 1 else (False,)
    tried: list[tuple[bool, int, bool]] = []  # (ultra, members that fit, every unit takes one)
    for ultra in kinds:
        atoms, kept = _atoms(occupancy, job, config, size, fit, ultra, memo=memo)
        chosen = choose(atoms, size, occupancy.levels, closeness, [*grown, *kept])
        if chosen is not None:
            # New units, and held nodes whose claim gives more members than before.
            new = [a for a in chosen.atoms if a not in held]
            slots: dict[str, int] = {}
            units: dict[str, str] = {}
            for atom in new:
                nodes = sorted(occupancy.nodes_of(atom.key)) if ultra else [atom.key[1]]
                for node in nodes:
                    slots[node] = 1 if ultra and atom.key[0] > 1 else atom.room
                    units[node] = atom.key[1]
            ordered = network_order(occupancy.places, slots, units)
            # (UltraServer units only where some are new: a job that fell back to plain nodes
            # may grow one it holds in the UltraServer pass)
            kind = config if ultra and any(a.key[0] > 1 for a in new) else 1
            return Planned({n: slots[n] for n in ordered}, kind, chosen.span)
        rooms = [a.room for a in (*atoms, *kept)]
        # (a held node given more members: members that take part of a node)
        whole = all(r == 1 for r in rooms) and grown == held
        tried.append((ultra, sum(rooms), whole or ultra))
    never = never_fits(occupancy, job, config, size, fit, closeness, memo) if fit.excluded else None
    return never or _shortfall(occupancy, job, config, size, grown, tried, closeness)


def _shortfall(
    occupancy: Occupancy,
    job: JobKey,
    config: int,
    size: int,
    held: list[Atom[UnitKey]],
    tried: list[tuple[bool, int, bool]],
    closeness: Closeness | None,
) -> Shortfall:
    """Why the job fits nowhere now, in the words of the kind of unit with the most room for its
    members (UltraServers on a tie, where the fleet has units of its config). `held`: the units
    its claim holds, with what they can take now."""
    ultras = any(unit[0] == config for unit in occupancy.members) and config > 1
    ultra, fitting, whole = max(tried, key=lambda t: (t[1], t[0] == ultras))
    text = job_text(job)
    if closeness is not None and closeness.required:
        if depth_of(closeness.key, occupancy.levels) is None:
            return Shortfall(not_a_level(text, closeness, occupancy.levels))
        if fitting + sum(a.room for a in held) >= size:
            return Shortfall(
                f"job {text} requires its {size} members in one {closeness.key} domain "
                f"({closeness.source}): no domain has room for all of them now; nothing is "
                "reserved until one has"
            )
    more = " more" if held else ""
    need = size - sum(a.room for a in held)
    if ultra:
        units = math.ceil(need / config)
        return shortfall(job, config, size, units, fitting // config, bool(held))
    if whole:
        return Shortfall(
            f"job {text} needs {unit_words(1, need, ultra=False)}{more} for its {size} members, "
            f"{fitting} free; nothing is reserved until all of them fit"
        )
    return Shortfall(
        f"job {text} needs room for {need}{more} of its {size} members on nodes free of other "
        f"jobs, {fitting} fit now; nothing is reserved until all of them fit"
    )


def not_a_level(text: str, closeness: Closeness, levels: tuple[str, ...]) -> str:
    known = ", ".join((*levels, HOSTNAME))
    return (
        f"job {text} asks for {closeness.text}, which is none of this extender's topology "
        f"levels ({known}); its members wait: name one of them, or add the key to the "
        "extender's topology levels"
    )


def never_fits(
    occupancy: Occupancy,
    job: JobKey,
    config: int,
    size: int,
    fit: Fit,
    closeness: Closeness | None = None,
    memo: AtomsMemo | None = None,
) -> Shortfall | None:
    """Why the job can never run here, or None: even with nothing else running, the units its
    members could ever use (`fit.excluded`: from their spec and the devices they ask for) hold
    fewer than its members (within one domain of a required level)."""
    if fit.excluded is None:
        return None
    required = closeness if closeness is not None and closeness.required else None
    if required is not None and depth_of(required.key, occupancy.levels) is None:
        return None  # (refused for that, not as "never")
    best = (config > 1 and any(unit[0] == config for unit in occupancy.members), 0)
    for ultra in (True, False) if config > 1 else (False,):
        atoms, _ = _atoms(occupancy, job, config, size, fit, ultra, empty=True, memo=memo)
        if holds(atoms, size, occupancy.levels, required):
            return None
        total = sum(a.room for a in atoms)
        if total > best[1]:
            best = (ultra, total)
    ultra, admitted = best
    where = f" in one {required.key} domain" if required is not None else ""
    if ultra:
        needed, units = math.ceil(size / config), admitted // config
        return Shortfall(
            f"job {job_text(job)} can never run here: it needs "
            f"{unit_words(config, needed, '')}{where} for its {size} members, and {units} "
            f"{'has' if units == 1 else 'have'} nodes all of which its members may use (their "
            "nodeSelector, affinity, tolerations and the devices they ask for, on the nodes as "
            "they are now)"
        )
    return Shortfall(
        f"job {job_text(job)} can never run here: it needs room for its {size} members{where}, "
        f"and the nodes its members may use take {admitted} (their nodeSelector, affinity, "
        "tolerations and the devices they ask for, on the nodes as they are now)"
    )


def shortfall(job: JobKey, config: int, size: int, needed: int, free: int, more: bool) -> Shortfall:
    return Shortfall(
        f"job {job_text(job)} needs {unit_words(config, needed)}{' more' if more else ''} for "
        f"its {size} members, {free} free; nothing is reserved until all of them fit"
    )


NOBODY: JobKey = ("", "")  # a job of no members and no claim: what every new job is


def unreadable(occupancy: Occupancy, node: str) -> str:
    return (
        f"{_node_word(occupancy, node)} with an UltraServerClaim this extender cannot read "
        f"({occupancy.rejected[node]})"
    )


def _node_word(occupancy: Occupancy, node: str) -> str:
    return "UltraServer node" if node in occupancy.ultraservers else "node"


@dataclass
class UnitChoice:
    """Which candidate nodes a member may take."""

    passed: list[str]
    failed: dict[str, str]


def decide(
    occupancy: Occupancy,
    member: Member,
    config: int,
    candidates: list[str],
    uid: str = "",
    rank: Rank | None = None,
    usable: Callable[[str], str | None] | None = None,
) -> UnitChoice:
    """Which candidate nodes a member of `member.job` may take: the nodes of its job's claim with
    a slot free; every other Neuron node is refused with why. `uid`: the member's own pod, never
    in its own way (bind asks again about a pod it counts already); `rank`: where its index puts
    it (it goes to its rank's node while that node has room: `_by_rank`, asking `usable` about a
    rank's node that is not a candidate)."""
    job = member.job
    claimed = occupancy.claimed(job) if occupancy.complete(job) else set()
    own = occupancy.job_nodes(job, uid)
    decision = UnitChoice([], {})
    shown = ", ".join(sorted(claimed)[:4]) + (" ..." if len(claimed) > 4 else "")
    for name in candidates:
        if not occupancy.rules(name):
            decision.passed.append(name)  # not a Neuron node, or no claims: not ours to judge
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
                    f"job {job_text(job)} has no nodes reserved yet: they are reserved for all "
                    "its members at once"
                )
            )
        elif claim is not None and claim.job != job:
            decision.failed[name] = (
                f"{_node_word(occupancy, name)} reserved for job {claim.job_text}"
            )
        elif others:
            decision.failed[name] = f"runs a member of job {job_text(others[0])}"
        elif name in claimed and own.get(name, 0) >= occupancy.claims[name].slots:
            decision.failed[name] = (
                f"already runs a member of job {job_text(job)}"
                if occupancy.claims[name].slots == 1
                else f"already runs {own[name]} members of job {job_text(job)}, all its claim "
                "gives the node"
            )
        elif name in claimed:
            decision.passed.append(name)
        else:
            decision.failed[name] = (
                f"job {job_text(job)}'s members go to the nodes reserved for it ({shown})"
            )
    if not (claimed and _by_rank(occupancy, job, uid, rank, own, decision, usable)):
        _one_unit_at_a_time(occupancy, job, config, set(own), decision)
    return decision


def _by_rank(
    occupancy: Occupancy,
    job: JobKey,
    uid: str,
    rank: Rank | None,
    own: dict[str, int],
    decision: UnitChoice,
    usable: Callable[[str], str | None] | None,
) -> bool:
    """Members with an index take the claim's slots in network order (`slot_order`): a rank
    goes to the slot of its index plus the members known in the groups before its own (a
    PyTorchJob's master before its workers, a JobSet's earlier jobs), while that slot's node has
    room and can take it (a rank's node that cannot, say a failed device, does not hold it up:
    then any slot). Whether it narrowed the choice."""
    if rank is None:
        return False
    ahead = rank[1]
    for u, worker in occupancy.workers.items():
        if worker.job == job and u != uid:
            ahead += worker.rank is not None and worker.rank[0] < rank[0]
    for u, waiting in occupancy.pending.items():
        if waiting.member.job == job and u != uid:
            theirs = rank_of(waiting.pod, waiting.member)
            ahead += theirs is not None and theirs[0] < rank[0]
    slots = occupancy.slot_order(job)
    if ahead >= len(slots):
        return False
    node = slots[ahead]
    if own.get(node, 0) >= occupancy.claims[node].slots:
        return False  # taken (by a member without an index, or one that came back elsewhere)
    if node not in decision.passed and (usable is None or usable(node) is not None):
        return False
    reason = f"job {job_text(job)} places its ranks in network order: this member's goes to {node}"
    for name in [n for n in decision.passed if n != node and n in occupancy.servers]:
        decision.passed.remove(name)
        decision.failed[name] = reason
    return True


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

    def __init__(self, occupancy: Occupancy, fit: Callable[[Pod], Fit] | None = None) -> None:
        """`fit(pod)`: what the ledger says of the member on each node (why it cannot run there
        now, its room, why it never can), so the first refusal of a job without a claim says
        why it has none (the reservation loop says it after, and kube-scheduler retries a
        refused pod only on an event), and a rank's node is known to take it."""
        self.occupancy = occupancy
        self.fit = fit
        # Jobs whose members kube-scheduler asked about (the reservation loop renews their
        # claims and plans for them first), by the time of the last ask (filter's clock).
        self.asked: dict[JobKey, float] = {}

    def filter(self, pod: Pod, passed: list[str], now: float) -> tuple[list[str], dict[str, str]]:
        """Narrow the nodes that passed the device check; returns (passed, newly failed)."""
        servers = self.occupancy.servers
        if not servers or servers.keys().isdisjoint(passed):  # (in C: hundreds of names a call)
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
        fit = self.fit(pod) if self.fit is not None else None
        if not occupancy.complete(member.job):
            if member.job not in occupancy.shortfalls and fit is not None:
                reason, fits = self._why_no_claim(pod, member, config, fit)
                occupancy.shortfalls[member.job] = reason
                if fits and len(occupancy.told_fits) < MAX_TOLD_FITS:
                    occupancy.told_fits.add(member.job)
            if occupancy.on_change is not None:
                occupancy.on_change()  # the reservation loop plans for it
        decision = decide(
            occupancy,
            member,
            config,
            passed,
            pod.metadata.uid,
            rank_of(pod, member),
            fit.usable if fit is not None else None,
        )
        return decision.passed, decision.failed

    def _why_no_claim(self, pod: Pod, member: Member, config: int, fit: Fit) -> tuple[str, bool]:
        """(why the job has no claim, whether it fits now)."""
        size = max(self.occupancy.size(member, member.job), 1)
        planned = plan(self.occupancy, member.job, config, size, fit, closeness_of(pod))
        if isinstance(planned, Shortfall):
            return planned.reason, False
        return (
            f"job {member.text} fits now ({planned.where}): they are being reserved for all its "
            "members at once"
        ), True

    def _outsider(self, passed: list[str]) -> tuple[list[str], dict[str, str]]:
        """A pod of no job stays off the nodes claimed for a job (they wait for its members)."""
        claims, rejected = self.occupancy.claims, self.occupancy.rejected
        if not claims and not rejected:
            return passed, {}  # the usual case: no job holds a node (a filter names 500)
        failed = {
            n: f"{_node_word(self.occupancy, n)} reserved for job {claims[n].job_text}"
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
        decision = decide(
            self.occupancy, member, config, [node], pod.metadata.uid, rank_of(pod, member)
        )
        return node in decision.passed
