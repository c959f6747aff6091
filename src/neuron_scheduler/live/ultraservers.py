"""UltraServers as the extender sees them: each unit's nodes, which job holds or claims each, and
each job's claim (phase, members bound of its size, until when). Pure: a fed Occupancy goes in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.state.members import member_fit
from neuron_scheduler.jobs.claims import PENDING
from neuron_scheduler.jobs.network import closeness_of
from neuron_scheduler.jobs.placement import Occupancy, Shortfall, job_progress, job_text, plan
from neuron_scheduler.jobs.preemption import claim_victims


@dataclass(frozen=True, slots=True)
class UnitNode:
    node: str
    claimed_by: str  # the job whose claim holds it, or ""
    members: tuple[str, ...]  # the jobs whose members run there


@dataclass(frozen=True, slots=True)
class UnitView:
    server: str  # server-id-4, or the node name of a node without one
    nodes: tuple[UnitNode, ...]


@dataclass(frozen=True, slots=True)
class ClaimView:
    job: str
    phase: str
    config: int
    size: int
    nodes: tuple[str, ...]
    bound: int  # members of the job bound on those nodes
    ends_in: float | None  # seconds (Pending), None (Bound: while the job runs)
    progress: str | None = None  # "job x has 4 of its 8 members, holding ..." until all are
    victims: int = 0  # pods its preemption evicted that are still leaving


@dataclass(frozen=True, slots=True)
class UltraServers:
    units: tuple[UnitView, ...]
    claims: tuple[ClaimView, ...]
    waiting: tuple[tuple[str, str], ...]  # (job, why it has no claim), the loop's last word
    unread: str | None  # why the claims could not be read, if they could not

    @property
    def empty(self) -> bool:
        """Nothing to show: no UltraServer, no claim, no job waiting for one (a fleet of plain
        nodes has no units, and a job that waits holds no claim)."""
        return not self.units and not self.claims and not self.waiting


def ultraserver_view(
    occupancy: Occupancy,
    ledger: Ledger,
    now: float,
    unread: str | None = None,
    policy: Policy = Policy.BEST_FIT,
) -> UltraServers:
    """`now`: wall clock (claims end by it); `unread`: why the claims were not read."""
    units: dict[str, list[str]] = {}
    for node, ids in occupancy.servers.items():
        if node in occupancy.ultraservers:  # (claims on other nodes are listed with the claims)
            units.setdefault(ids.get(4, node), []).append(node)
    unit_views = []
    for server, nodes in sorted(units.items()):
        rows = []
        for node in sorted(nodes):
            claim = occupancy.claims.get(node)
            jobs = sorted({job_text(w.job) for w in occupancy.on_node.get(node, {}).values()})
            rows.append(UnitNode(node, claim.job_text if claim else "", tuple(jobs)))
        unit_views.append(UnitView(server, tuple(rows)))
    by_job: dict[tuple[str, str], list[str]] = {}
    for node, claim in occupancy.claims.items():
        by_job.setdefault(claim.job, []).append(node)
    claim_views = []
    for job, nodes in sorted(by_job.items()):
        first = occupancy.claims[nodes[0]]
        bound = sum(1 for w in occupancy.job_workers(job) if w.node in nodes)
        pending = [occupancy.claims[n] for n in nodes if occupancy.claims[n].phase == PENDING]
        ends = min((c.renewed + c.seconds for c in pending), default=None)
        claim_views.append(
            ClaimView(
                job_text(job),
                PENDING if pending else first.phase,
                first.config,
                occupancy.claimed_size(job),
                tuple(sorted(nodes)),
                bound,
                None if ends is None else max(0.0, ends - now),
                job_progress(occupancy, job, now),
                sum(1 for v in claim_victims(occupancy, pending) if ledger.holding(v)),
            )
        )
    waiting = []
    for job, members in sorted(occupancy.jobs().items()):
        if occupancy.complete(job):
            continue
        oldest = members[0]
        size = max(occupancy.size(oldest.member, job), 1)
        fit = member_fit(ledger, oldest.pod, policy)
        planned = plan(occupancy, job, oldest.config, size, fit, closeness_of(oldest.pod))
        reason = (
            planned.reason
            if isinstance(planned, Shortfall)
            else f"fits now ({planned.where}: {', '.join(planned.slots)}): the extender "
            "reserves them at its next step"
        )
        waiting.append((job_text(job), reason))
    return UltraServers(tuple(unit_views), tuple(claim_views), tuple(waiting), unread)


def ultraserver_json(view: UltraServers) -> dict[str, Any]:
    return {
        "units": [
            {
                "server": unit.server,
                "nodes": [
                    {"node": n.node, "claimed_by": n.claimed_by or None, "members": list(n.members)}
                    for n in unit.nodes
                ],
            }
            for unit in view.units
        ],
        "claims": [
            {
                "job": c.job,
                "phase": c.phase,
                "config": c.config,
                "size": c.size,
                "nodes": list(c.nodes),
                "bound": c.bound,
                "ends_in_seconds": None if c.ends_in is None else round(c.ends_in, 1),
                "progress": c.progress,
                "victims_leaving": c.victims,
            }
            for c in view.claims
        ],
        "waiting": [{"job": job, "reason": reason} for job, reason in view.waiting],
        "claims_unread": view.unread,
    }
