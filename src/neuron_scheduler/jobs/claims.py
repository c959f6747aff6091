"""A training job's claim on a node, persisted as one object per node (neuron-scheduler.io/v1alpha1,
kind UltraServerClaim, the name it had when only UltraServers had claims; cluster-scoped, named
after the node; the chart installs the CRD). Pure: to and from the API object.

Why an object of our own, one per node: creating an object whose name exists fails (409), so the
API server itself lets one job at most hold a node, whichever replica (or restarted replica)
writes, and a change conditioned on the resourceVersion it read cannot undo another's. A CRD of
our own keeps the extender's permission to exactly these objects (Leases would have needed write
access to every Lease of a namespace, kube-system's control-plane Leases among them; RBAC cannot
narrow it to a label), lets the API server check the fields (schema), and `kubectl get
ultraserverclaims` lists them with their job and phase. docs/training-jobs.md says more.

A claim is Pending from when the job's units are reserved until all its members are bound, and
ends if its job does nothing for `seconds` (renewTime is the last time kube-scheduler asked about
one of its members, or when the claim was made); Bound while any member runs; gone when the job
is. A claim the placement admission check makes for a Kueue workload (issue 48, docs/kueue.md)
names the workload (`workload`): it exists before any member does, so it lasts without members
while Pending, until `seconds` after it was made (the check ends it at once if Kueue evicts the
workload). A claim made by preemption (issue 40) lists the pods evicted for it (`victims`, by
uid) and the jobs evicted whole (`victim_jobs`: a member of one may have bound while the claim
was written, and is then evicted too) while it is Pending, so whichever replica leads next
finishes evicting them, and the claim does not end while they are still leaving.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from neuron_scheduler.jobs.members import MAX_GANG, JobKey
from neuron_scheduler.kube.objects import ClaimMeta, ClaimSpec, JobClaim
from neuron_scheduler.kube.reading import epoch

MANAGED_BY = {"app.kubernetes.io/managed-by": "neuron-scheduler"}
PENDING = "Pending"
BOUND = "Bound"
MAX_NAME = 253
MAX_VICTIMS = 1024  # pods one preemption may evict (a job's members at most, MAX_GANG)
MAX_UID = 128
MAX_JOB_TEXT = 63 + 1 + MAX_NAME  # namespace/name


class ClaimError(ValueError):
    """An UltraServerClaim that is not one we could have written."""


@dataclass(frozen=True, slots=True)
class NodeClaim:
    node: str
    job: JobKey
    config: int  # the job's node config: units of 4, 2 or 1 nodes
    size: int  # the job's members
    phase: str  # PENDING or BOUND
    renewed: float  # wall clock: when the job last did something (renewTime)
    seconds: int  # a Pending claim ends this long after `renewed`
    scheduler: str = ""  # the schedulerName of the job's members: whose extender tends it
    version: str = ""  # the object's resourceVersion ("" until written)
    uid: str = ""  # the object's (a claim created again for the node has another)
    victims: tuple[str, ...] = ()  # pods evicted for the job by preemption (uids), while Pending
    victim_jobs: tuple[JobKey, ...] = ()  # the jobs evicted whole for it, while Pending
    created: float = 0.0  # wall clock: when the object was made (0: not known)
    slots: int = 1  # the job's members this node takes (more than 1: members take part of it)
    # Kueue's Workload (uid) the placement check claimed the node for ("": none): while Pending,
    # the claim waits for the members the workload's admission will make, until it expires.
    workload: str = ""

    @property
    def job_text(self) -> str:
        return f"{self.job[0]}/{self.job[1]}"

    def expired(self, now: float) -> bool:
        return self.phase == PENDING and self.renewed + self.seconds <= now

    def awaits_members(self, now: float) -> bool:
        """A Pending claim made for an admitted Kueue workload, within its time: it lasts
        without members (they come once Kueue starts the workload)."""
        return bool(self.workload) and self.phase == PENDING and not self.expired(now)


def to_object(claim: NodeClaim) -> JobClaim:
    renewed = datetime.fromtimestamp(claim.renewed, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return JobClaim(
        metadata=ClaimMeta(
            name=claim.node, uid=claim.uid, resourceVersion=claim.version, labels=MANAGED_BY
        ),
        spec=ClaimSpec(
            node=claim.node,
            namespace=claim.job[0],
            job=claim.job[1],
            config=claim.config,
            size=claim.size,
            slots=claim.slots,
            phase=claim.phase,
            scheduler=claim.scheduler,
            renewTime=renewed,
            seconds=claim.seconds,
            victims=list(claim.victims),
            victimJobs=[f"{namespace}/{name}" for namespace, name in claim.victim_jobs],
            workload=claim.workload,
        ),
    )


def from_object(found: JobClaim) -> NodeClaim:
    """ClaimError for anything we could not have written (read from the API: untrusted; the
    CRD's schema checks the same, where the cluster has ours)."""
    meta, spec = found.metadata, found.spec
    if not all(0 < len(v) <= MAX_NAME for v in (spec.node, spec.namespace, spec.job)):
        raise ClaimError(f"claim {meta.name}: node, namespace and job must be names")
    if spec.node != meta.name:
        raise ClaimError(f"claim {meta.name} names node {spec.node!r}, not its own")
    if spec.config not in (1, 2, 4) or not 1 <= spec.size <= MAX_GANG:
        raise ClaimError(
            f"claim {meta.name}: config {spec.config!r} or size {spec.size!r} out of range"
        )
    if not 1 <= spec.slots <= MAX_GANG or (spec.config > 1 and spec.slots != 1):
        raise ClaimError(f"claim {meta.name}: slots {spec.slots!r} out of range")
    if spec.phase not in (PENDING, BOUND):
        raise ClaimError(f"claim {meta.name}: phase {spec.phase!r} is neither Pending nor Bound")
    if not 1 <= spec.seconds <= 86400 or len(spec.scheduler) > MAX_NAME:
        raise ClaimError(f"claim {meta.name}: seconds {spec.seconds!r} or scheduler out of range")
    try:
        renewed = datetime.fromisoformat(spec.renewTime.replace("Z", "+00:00"))
    except ValueError:
        raise ClaimError(f"claim {meta.name}: renewTime {spec.renewTime[:40]!r}") from None
    if renewed.tzinfo is None:
        raise ClaimError(f"claim {meta.name}: renewTime {spec.renewTime[:40]!r} has no zone")
    if len(spec.victims) > MAX_VICTIMS or any(not 0 < len(v) <= MAX_UID for v in spec.victims):
        raise ClaimError(f"claim {meta.name}: more than {MAX_VICTIMS} victims, or one no uid")
    if len(spec.workload) > MAX_UID:
        raise ClaimError(f"claim {meta.name}: workload {spec.workload[:40]!r} is no uid")
    if len(spec.victimJobs) > MAX_VICTIMS:
        raise ClaimError(f"claim {meta.name}: more than {MAX_VICTIMS} victim jobs")
    victim_jobs = []
    for text in spec.victimJobs:
        namespace, _, name = text.partition("/")
        if len(text) > MAX_JOB_TEXT or not namespace or not name or "/" in name:
            raise ClaimError(f"claim {meta.name}: victim job {text[:80]!r} is no namespace/name")
        victim_jobs.append((namespace, name))
    return NodeClaim(
        spec.node,
        (spec.namespace, spec.job),
        spec.config,
        spec.size,
        spec.phase,
        renewed.timestamp(),
        spec.seconds,
        spec.scheduler,
        meta.resourceVersion,
        meta.uid,
        tuple(spec.victims),
        tuple(victim_jobs),
        epoch(meta.creationTimestamp),  # the API server's own: 0 when unreadable
        spec.slots,
        spec.workload,
    )
