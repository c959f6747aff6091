"""A job's claim on UltraServer nodes, persisted as one coordination.k8s.io/v1 Lease per node.
Pure: to and from the Lease object.

Why a Lease per node: creating an object of a name that exists fails (409), so the API server
itself lets one job at most hold a node, whichever replica (or restarted replica) writes; a
change conditioned on the resourceVersion it read cannot undo another's. Leases need no CRD in
the cluster, are small (a node, a job, a few numbers), and `kubectl get leases -l
neuron-scheduler.io/claim` lists them with their job as HOLDER. docs/ultraserver.md says more.

A claim is Pending from when the job's units are reserved until all its members are bound, and
ends if its job does nothing for `seconds` (no member filtered or bound: renewTime); Bound while
any member runs; gone when the job is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime

from neuron_scheduler.kube.objects import Lease, LeaseMeta, LeaseSpec
from neuron_scheduler.ultraserver.jobs import MAX_GANG, JobKey

CLAIM_LABEL = "neuron-scheduler.io/claim"  # its value: the kind of claim
ULTRASERVER = "ultraserver"
CLAIM_ANNOTATION = "neuron-scheduler.io/claim"  # the claim, as JSON
MANAGED_BY = {"app.kubernetes.io/managed-by": "neuron-scheduler"}
PENDING = "Pending"
BOUND = "Bound"
NAME_PREFIX = "neuron-claim-"
MAX_NAME = 253


class ClaimError(ValueError):
    """A Lease with our label that is not a claim we could have written."""


@dataclass(frozen=True, slots=True)
class NodeClaim:
    node: str
    job: JobKey
    config: int  # the job's node config: units of 4, 2 or 1 nodes
    size: int  # the job's members
    phase: str  # PENDING or BOUND
    renewed: float  # wall clock: when the job last did something (the Lease's renewTime)
    seconds: int  # a Pending claim ends this long after `renewed`
    scheduler: str = ""  # the schedulerName of the job's members: whose extender tends it
    version: str = ""  # the Lease's resourceVersion ("" until written)
    uid: str = ""  # the Lease's (a Lease created again for the node has another)

    @property
    def job_text(self) -> str:
        return f"{self.job[0]}/{self.job[1]}"

    def expired(self, now: float) -> bool:
        return self.phase == PENDING and self.renewed + self.seconds <= now


def lease_name(node: str) -> str:
    name = NAME_PREFIX + node
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:16]
    return f"{name[: MAX_NAME - 17]}-{digest}"


def to_lease(claim: NodeClaim, namespace: str) -> Lease:
    renewed = datetime.fromtimestamp(claim.renewed, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    details = {
        "node": claim.node,
        "namespace": claim.job[0],
        "job": claim.job[1],
        "config": claim.config,
        "size": claim.size,
        "phase": claim.phase,
        "scheduler": claim.scheduler,
    }
    return Lease(
        metadata=LeaseMeta(
            name=lease_name(claim.node),
            namespace=namespace,
            resourceVersion=claim.version,
            labels={**MANAGED_BY, CLAIM_LABEL: ULTRASERVER},
            annotations={CLAIM_ANNOTATION: json.dumps(details, separators=(",", ":"))},
        ),
        spec=LeaseSpec(
            holderIdentity=claim.job_text,
            leaseDurationSeconds=claim.seconds,
            renewTime=renewed,
        ),
    )


def from_lease(lease: Lease) -> NodeClaim:
    """ClaimError for anything we could not have written (read from the API: untrusted)."""
    meta = lease.metadata
    text = meta.annotations.get(CLAIM_ANNOTATION, "")
    if not text or len(text) > 4096:
        raise ClaimError(f"Lease {meta.name}: no {CLAIM_ANNOTATION} annotation we could read")
    try:
        details = json.loads(text)
    except ValueError as error:
        raise ClaimError(f"Lease {meta.name}: {CLAIM_ANNOTATION} is not JSON: {error}") from None
    if not isinstance(details, dict):
        raise ClaimError(f"Lease {meta.name}: {CLAIM_ANNOTATION} is not an object")
    node, namespace, job = details.get("node"), details.get("namespace"), details.get("job")
    config, size, phase = details.get("config"), details.get("size"), details.get("phase")
    scheduler = details.get("scheduler", "")
    if not isinstance(scheduler, str) or len(scheduler) > 253:
        raise ClaimError(f"Lease {meta.name}: scheduler {scheduler!r} is not a name")
    if not all(isinstance(v, str) and 0 < len(v) <= 253 for v in (node, namespace, job)):
        raise ClaimError(f"Lease {meta.name}: node, namespace and job must be names")
    assert isinstance(node, str) and isinstance(namespace, str) and isinstance(job, str)
    if lease_name(node) != meta.name:
        raise ClaimError(f"Lease {meta.name} claims node {node!r}, which is not its own")
    if config not in (1, 2, 4) or not isinstance(size, int) or not 1 <= size <= MAX_GANG:
        raise ClaimError(f"Lease {meta.name}: config {config!r} or size {size!r} out of range")
    if phase not in (PENDING, BOUND):
        raise ClaimError(f"Lease {meta.name}: phase {phase!r} is neither {PENDING} nor {BOUND}")
    seconds = lease.spec.leaseDurationSeconds
    if not isinstance(seconds, int) or not 1 <= seconds <= 86400:
        raise ClaimError(f"Lease {meta.name}: leaseDurationSeconds {seconds!r} out of range")
    try:
        renewed = datetime.fromisoformat((lease.spec.renewTime or "").replace("Z", "+00:00"))
    except ValueError:
        raise ClaimError(f"Lease {meta.name}: renewTime {lease.spec.renewTime!r}") from None
    return NodeClaim(
        node,
        (namespace, job),
        config,
        size,
        phase,
        renewed.timestamp(),
        seconds,
        scheduler,
        meta.resourceVersion,
        meta.uid,
    )
