"""UltraServer-aware placement of MPI job workers, for the extender's filter. No I/O (filter's
caller passes the time).

A worker pod is one labelled `training.kubeflow.org/job-name` and `training.kubeflow.org/job-role:
worker`; its node config (4, 2 or 1 nodes per unit) is the pod annotation
`neuron.amazonaws.com/ultraserver-node-config`, else a label of that name, else 4. A unit is the
set of nodes sharing `neuron.amazonaws.com/ultraserver-server-id-<config>` (config 1: one node).
On UltraServer nodes (those with `neuron.amazonaws.com/ultraserver-mode`) the rule is:

- a unit that holds (or is being filled by) workers of another job is closed to this job, in
  either job's config, so a 2-node job and a 4-node job never share an UltraServer;
- one worker of a job per node;
- a job fills the unit it started before it opens another (config 2 and 4), so a job of at most
  `config` workers lands in one unit and a larger one in whole units;
- a job that opens a unit gets one chosen for it (complete units first, then by server id) and
  holds a claim on it until its workers show up bound, because kube-scheduler asks about the next
  worker before the previous one's binding is visible.

Nodes without UltraServer labels are left alone: the Worker's nodeSelector picks the type.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.kube.objects import Node, Pod
from neuron_scheduler.kube.views import node_name, pod_uid, replace_all
from neuron_scheduler.ultraserver.labels import (
    DEFAULT_NODE_CONFIG,
    DEFAULT_SERVER_ID,
    JOB_NAME_LABEL,
    JOB_ROLE_LABEL,
    MODE_LABEL,
    NODE_CONFIG_KEY,
    WORKER_ROLE,
    NodeConfigError,
    parse_node_config,
    server_id_label,
)

JobKey = tuple[str, str]  # (namespace, job name)
UnitKey = tuple[int, str]  # (config, server id); config 1: (1, node name)
CLAIM_SECONDS = 120.0


def worker_job(pod: Pod) -> JobKey | None:
    labels = pod.metadata.labels
    name = labels.get(JOB_NAME_LABEL)
    if not name or labels.get(JOB_ROLE_LABEL) != WORKER_ROLE:
        return None
    return (pod.metadata.namespace, name)


def pod_node_config(pod: Pod) -> int:
    """The worker's node config; NodeConfigError names the annotation or label when it is bad."""
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
    node: str
    job: JobKey
    config: int


@dataclass(frozen=True, slots=True)
class Claim:
    unit: UnitKey
    until: float


@dataclass
class Occupancy:
    """UltraServer nodes by unit and job workers by node: a view the extender's watches feed, and
    a reserver bind tells about a worker it is placing (kube-scheduler asks about the job's next
    worker before this binding is visible in the watch)."""

    servers: dict[str, dict[int, str]] = field(default_factory=dict)  # node -> config -> id
    members: dict[UnitKey, set[str]] = field(default_factory=dict)
    workers: dict[str, Worker] = field(default_factory=dict)  # pod uid -> worker
    on_node: dict[str, dict[str, Worker]] = field(default_factory=dict)
    claims: dict[tuple[JobKey, int], Claim] = field(default_factory=dict)
    # Workers counted from a bind's reservation that the watch has not shown bound yet.
    reserved: set[str] = field(default_factory=set)

    # --- feeding -----------------------------------------------------------------------------

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

    def remove_node(self, name: str) -> None:
        for config, server in self.servers.pop(name, {}).items():
            unit = self.members.get((config, server))
            if unit is not None:
                unit.discard(name)
                if not unit:
                    del self.members[(config, server)]

    def apply_pod(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        if uid in self.reserved and not pod.spec.nodeName and not pod.finished:
            return  # the watch has not caught up with the bind in flight (it shows our patch)
        self.reserved.discard(uid)  # bound or gone: from now on the watch speaks for it
        job = worker_job(pod)
        node = pod.spec.nodeName
        if job is None or not node or pod.finished:
            self.remove_pod(uid)
            return
        try:
            config = pod_node_config(pod)
        except NodeConfigError:
            config = DEFAULT_NODE_CONFIG
        worker = Worker(node, job, config)
        if self.workers.get(uid) == worker:
            return
        self.remove_pod(uid)
        self.workers[uid] = worker
        self.on_node.setdefault(node, {})[uid] = worker

    def remove_pod(self, uid: str) -> None:
        self.reserved.discard(uid)
        worker = self.workers.pop(uid, None)
        if worker is None:
            return
        here = self.on_node.get(worker.node, {})
        here.pop(uid, None)
        if not here:
            self.on_node.pop(worker.node, None)

    def replace_nodes(self, nodes: Iterable[Node]) -> None:
        replace_all(nodes, node_name, self.apply_node, self.servers, self.remove_node)

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        replace_all(pods, pod_uid, self.apply_pod, self.workers, self.remove_pod)

    # --- binds in flight ---------------------------------------------------------------------

    def reserve(self, pod: Pod, node: str, placement: Placement) -> None:
        """The worker counts on `node` from now on, as if the watch had shown it bound there."""
        self.apply_pod(
            msgspec.structs.replace(pod, spec=msgspec.structs.replace(pod.spec, nodeName=node))
        )
        if pod.metadata.uid in self.workers:
            self.reserved.add(pod.metadata.uid)

    def unreserve(self, pod: Pod, node: str) -> None:
        """The bind to `node` did not happen: the pod is not a worker there (unless the watch
        has shown it bound meanwhile: then the watch speaks for it)."""
        uid = pod.metadata.uid
        worker = self.workers.get(uid)
        if uid in self.reserved and worker is not None and worker.node == node:
            self.remove_pod(uid)

    # --- reading -----------------------------------------------------------------------------

    def unit(self, node: str, config: int) -> UnitKey | None:
        server = self.servers.get(node, {}).get(config)
        return (config, server) if server is not None else None

    def nodes_of(self, unit: UnitKey) -> set[str]:
        return self.members.get(unit, set())

    def footprint(self, worker: Worker) -> set[str]:
        unit = self.unit(worker.node, worker.config)
        return self.nodes_of(unit) if unit else {worker.node}


@dataclass
class UnitChoice:
    """Which candidate nodes a worker may take, and the unit its job opens (if any)."""

    passed: list[str]
    failed: dict[str, str]
    claim: UnitKey | None = None


def _label(unit: UnitKey) -> str:
    config, server = unit
    return f"node {server}" if config == 1 else f"{server_id_label(config)}={server}"


def decide(
    occupancy: Occupancy, job: JobKey, config: int, candidates: list[str], now: float
) -> UnitChoice:
    """Which candidate nodes a worker of `job` may take; claim: the unit the job opens."""
    claims = {k: c for k, c in occupancy.claims.items() if c.until > now}
    own_claim = claims.get((job, config))
    other_claims = [(k[0], c.unit) for k, c in claims.items() if k[0] != job]
    counts: dict[UnitKey, int] = {}
    own_nodes: set[str] = set()
    for worker in occupancy.workers.values():
        if worker.job == job:
            own_nodes.add(worker.node)
            unit = occupancy.unit(worker.node, config)
            if unit is not None:
                counts[unit] = counts.get(unit, 0) + 1
    if own_claim is not None:
        counts.setdefault(own_claim.unit, 0)
    open_units = {u for u, n in counts.items() if n < config} if config > 1 else set()

    decision = UnitChoice([], {})
    eligible: dict[str, UnitKey] = {}
    for name in candidates:
        if name not in occupancy.servers:
            decision.passed.append(name)  # not an UltraServer node: not ours to judge
            continue
        unit = occupancy.unit(name, config)
        if unit is None:
            decision.failed[name] = (
                f"UltraServer node without a unit for config {config} "
                f"({server_id_label(config)} missing or all zeros)"
            )
            continue
        area = occupancy.nodes_of(unit)
        blocker = _blocker(occupancy, job, area | {name}, other_claims)
        if blocker is not None:
            decision.failed[name] = f"UltraServer {_label(unit)} {blocker}"
            continue
        if name in own_nodes:
            decision.failed[name] = f"already runs a worker of job {job_text(job)}"
            continue
        if open_units:
            if unit not in open_units:
                first = min(open_units, key=lambda u: (-counts[u], u))
                decision.failed[name] = (
                    f"job {job_text(job)} fills UltraServer {_label(first)} first "
                    f"({counts[first]} of {config} workers there)"
                )
                continue
            decision.passed.append(name)
            continue
        if config > 1 and counts.get(unit, 0) >= config:
            decision.failed[name] = (
                f"UltraServer {_label(unit)} already holds {config} workers of job {job_text(job)}"
            )
            continue
        eligible[name] = unit
    if config == 1:
        decision.passed += list(eligible)
    elif eligible:
        chosen = min(
            set(eligible.values()),
            key=lambda u: (-min(len(occupancy.nodes_of(u)), config), u[1]),
        )
        for name, unit in eligible.items():
            if unit == chosen:
                decision.passed.append(name)
            else:
                decision.failed[name] = (
                    f"job {job_text(job)} starts on UltraServer {_label(chosen)} "
                    "(complete free units first, then by server id)"
                )
        decision.claim = chosen
    elif own_claim is not None and own_claim.unit in open_units:
        decision.claim = own_claim.unit  # keep holding it while its nodes are busy
    passed = set(decision.passed)
    decision.passed = [name for name in candidates if name in passed]
    return decision


def _blocker(
    occupancy: Occupancy,
    job: JobKey,
    area: set[str],
    other_claims: list[tuple[JobKey, UnitKey]],
) -> str | None:
    """Why another job keeps `job` out of these nodes, or None."""
    near: set[str] = set()
    for name in area:
        for config in (1, 2, 4):
            unit = occupancy.unit(name, config)
            near |= occupancy.nodes_of(unit) if unit else {name}
    for name in sorted(near):
        for worker in occupancy.on_node.get(name, {}).values():
            if worker.job != job and occupancy.footprint(worker) & area:
                return f"holds workers of job {job_text(worker.job)}"
    for other, unit in other_claims:
        if occupancy.nodes_of(unit) & area:
            return f"is being filled by job {job_text(other)}"
    return None


# Why the waker hears of a unit's nodes (extender.waking): a claim ended, its room is free again.
CLAIM_ENDED = "claim_ended"


class UnitPlacement:
    """The extender's node filter: the rule plus the claims it makes. Also a hold keeper: a claim
    that ends frees its unit for other jobs without any cluster event, so the waker asks when
    the next one ends (`seconds_to_next_expiry`) and ends it then (`expire`), and `on_freed`
    hears of the unit's nodes."""

    outcome = "ultraserver_unit"  # the filter-outcome metric label for the nodes it fails

    def __init__(
        self,
        occupancy: Occupancy,
        claim_seconds: float = CLAIM_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: the one filter's `now` is read from."""
        self.occupancy = occupancy
        self.claim_seconds = claim_seconds
        self.clock = clock
        self.on_freed: Callable[[Iterable[str], str], None] | None = None

    def filter(self, pod: Pod, passed: list[str], now: float) -> tuple[list[str], dict[str, str]]:
        """Narrow the nodes that passed the device check; returns (passed, newly failed)."""
        job = worker_job(pod)
        if job is None or not any(n in self.occupancy.servers for n in passed):
            return passed, {}
        try:
            config = pod_node_config(pod)
        except NodeConfigError as error:
            return [n for n in passed if n not in self.occupancy.servers], {
                n: str(error) for n in passed if n in self.occupancy.servers
            }
        decision = decide(self.occupancy, job, config, passed, now)
        if decision.claim is not None:
            self.occupancy.claims[(job, config)] = Claim(decision.claim, now + self.claim_seconds)
        self._expire(now)
        return decision.passed, decision.failed

    def admits(self, pod: Pod, node: str, now: float) -> bool:
        """Whether `filter` could pass the pod on this node now (claims untouched)."""
        job = worker_job(pod)
        if job is None or node not in self.occupancy.servers:
            return True
        try:
            config = pod_node_config(pod)
        except NodeConfigError:
            return False
        return node in decide(self.occupancy, job, config, [node], now).passed

    def seconds_to_next_expiry(self) -> float | None:
        claims = self.occupancy.claims
        return min(c.until for c in claims.values()) - self.clock() if claims else None

    def expire(self) -> None:
        self._expire(self.clock())

    def _expire(self, now: float) -> None:
        for key in [k for k, c in self.occupancy.claims.items() if c.until <= now]:
            claim = self.occupancy.claims.pop(key)
            if self.on_freed is not None:
                self.on_freed(sorted(self.occupancy.nodes_of(claim.unit)), CLAIM_ENDED)
