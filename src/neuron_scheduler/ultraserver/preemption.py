"""Preemption for a training job on UltraServers: whole jobs, or nothing (issue 40). Pure.

kube-scheduler asks the preempt verb about one pod, and evicts victims on one node: for a member
of a job that needs whole units, that evicts members of other jobs one by one, whether or not
the job then fits (before issue 40, a 16-member job on a fleet of three UltraServers evicted
every running job). Here the preemptor is the member's whole job:

- only units whose every node its members could use once every pod there is gone (their spec,
  the devices they ask for, the devices that failed), and where every pod is of lower priority
  than the job, are taken into account: the pods of no job
  there, and the jobs holding members or a claim there, each of which is evicted whole
  (members on every node, not only on these units);
- of those, the cheapest units for all its members, by core/jobpreemption: the fewest whole
  jobs, then the fewest pods of no job, then the least work lost; units it holds already, and
  free ones, cost nothing;
- when even every one of them is too few, there is no preemption at all (`Shortfall`), so a job
  that cannot fit with every lower-priority job gone evicts nobody.

The extender's reservation loop carries it out (extender/loops/reserving.py): the job's claim on
the units first (the victims listed on it, so a restart finishes the evictions), then the
evictions; the victims' replacements find the units claimed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from neuron_scheduler.core.jobpreemption import Cost, Opening, cheapest
from neuron_scheduler.ultraserver.claims import MAX_VICTIMS, PENDING, NodeClaim
from neuron_scheduler.ultraserver.jobs import JobKey
from neuron_scheduler.ultraserver.placement import (
    Occupancy,
    Shortfall,
    UnitKey,
    job_text,
    never_fits,
    unit_words,
)


@dataclass(frozen=True, slots=True)
class Loose:
    """A pod of no job holding Neuron devices on an UltraServer node (not leaving already)."""

    uid: str
    priority: int
    started: float  # seconds since the epoch (0: unknown, counts as the oldest)


LOWEST = -(2**31)


@dataclass(frozen=True, slots=True)
class Preemption:
    job: JobKey
    nodes: tuple[str, ...]  # the nodes of the units its claim takes (those it holds not again)
    jobs: tuple[JobKey, ...]  # evicted whole
    victims: tuple[str, ...]  # pod uids: the jobs' bound members, the pods of no job there
    cost: Cost  # jobs, pods of no job, node-seconds of work lost

    @property
    def summary(self) -> str:
        jobs = ", ".join(job_text(j) for j in self.jobs[:4])
        more = f" and {len(self.jobs) - 4} more" if len(self.jobs) > 4 else ""
        parts = [f"job{'s' if len(self.jobs) != 1 else ''} {jobs}{more} whole"] if jobs else []
        if self.cost[1]:
            parts.append(f"{self.cost[1]} pod{'s' if self.cost[1] != 1 else ''} of no job")
        return " and ".join(parts) or "nobody"


def plan_preemption(
    occupancy: Occupancy,
    job: JobKey,
    config: int,
    size: int,
    priority: int,
    loose: Callable[[str], Sequence[Loose]],
    unfit: Callable[[str], str | None],
    now: float,
    excluded: Callable[[str], str | None] | None = None,
) -> Preemption | Shortfall:
    """The units `job` (`size` members of `config`, at `priority`) gets by preemption and the
    victims, or why it gets none. `loose(node)`: the pods of no job on it; `unfit(node)`: why
    its members could not run there even with every pod gone (a failed device); `excluded(node)`:
    why they never can, whatever the node's devices (their spec: for `never_fits`; default
    `unfit`); `now`: wall clock (work lost is counted to it)."""
    held = occupancy.held_units(job)
    needed = math.ceil(size / config) - len(held)
    if needed <= 0:
        return Shortfall(f"job {job_text(job)} holds its units already")
    own = {w.node for w in occupancy.job_workers(job)}
    priorities = _priorities(occupancy)
    openings: list[tuple[int, str, Opening[UnitKey, JobKey]]] = []
    pods_of_no_job: dict[UnitKey, list[Loose]] = {}
    for unit, nodes in occupancy.members.items():
        if unit[0] != config or unit in held or len(nodes) != config:
            continue
        if any(n in occupancy.rejected or unfit(n) is not None for n in nodes):
            continue  # (a claim not read: not ours to take)
        jobs = {other for _, _, other in occupancy.others(job, nodes) if other is not None}
        there = [p for n in sorted(nodes) for p in loose(n)]
        if any(priorities.get(j, LOWEST) >= priority for j in jobs) or any(
            p.priority >= priority for p in there
        ):
            continue
        pods_of_no_job[unit] = there
        work = sum(_ran(p.started, now) for p in there)
        opening = Opening(unit, frozenset(jobs), len(there), work)
        openings.append((0 if nodes & own else 1, unit[1], opening))
    openings.sort(key=lambda o: (o[0], o[1]))

    def lost(victim: JobKey) -> float:
        return sum(_ran(w.started, now) for w in occupancy.job_workers(victim))

    choice = cheapest([o for _, _, o in openings], needed, lost)
    if choice is None:
        never = never_fits(occupancy, job, config, size, excluded or unfit)
        if never is not None:
            return never
        more = " more" if held else ""
        return Shortfall(
            f"job {job_text(job)} needs {unit_words(config, needed, '')}{more} for its {size} "
            f"members; with every job and pod of lower priority evicted there would be "
            f"{len(openings)}: no preemption"
        )
    evicted = set(choice.jobs)
    victims = [uid for uid, worker in occupancy.workers.items() if worker.job in evicted]
    for opening in choice.openings:
        victims += [p.uid for p in pods_of_no_job[opening.unit]]
    if len(victims) > MAX_VICTIMS:
        return Shortfall(
            f"job {job_text(job)} would evict {len(victims)} pods, more than {MAX_VICTIMS}: "
            "no preemption"
        )
    taken = sorted(n for o in choice.openings for n in occupancy.nodes_of(o.unit))
    return Preemption(job, tuple(taken), choice.jobs, tuple(dict.fromkeys(victims)), choice.cost)


def claim_victims(occupancy: Occupancy, claims: Iterable[NodeClaim]) -> list[str]:
    """The pods a job's preemption evicts, by its Pending claims: the uids listed on them, and
    every member of the jobs evicted whole that is not on a node of a complete claim of its own
    job. The plan's list was made before the claim was written; a member that was on its way
    then (past filter, binding) is known now, and is evicted with its job. A victim job's
    replacements bind only into a claim of their own, complete: they are no victims."""
    pending = [c for c in claims if c.phase == PENDING]
    found = dict.fromkeys(v for c in pending for v in c.victims)
    jobs = {j for c in pending for j in c.victim_jobs}
    if not jobs:
        return list(found)
    settled: dict[JobKey, set[str]] = {}  # each victim job's complete claim's nodes
    for job in jobs:
        settled[job] = occupancy.claimed(job) if occupancy.complete(job) else set()
    for uid, worker in occupancy.workers.items():
        if worker.job in jobs and worker.node not in settled[worker.job]:
            found.setdefault(uid)
    return list(found)


def job_priority(occupancy: Occupancy, job: JobKey) -> int | None:
    """The job's priority (its highest member's, bound or waiting), or None with no member."""
    return _priorities(occupancy).get(job)


def _priorities(occupancy: Occupancy) -> dict[JobKey, int]:
    """Each job's priority: its highest member's, bound or waiting (a job with a claim and no
    member left is missing: the lowest)."""
    found: dict[JobKey, int] = {}
    for job, value in [
        *((w.job, w.priority) for w in occupancy.workers.values()),
        *((p.member.job, p.pod.spec.priority or 0) for p in occupancy.pending.values()),
    ]:
        found[job] = max(found.get(job, LOWEST), value)
    return found


def _ran(started: float, now: float) -> float:
    """Seconds run (a start not known counts as the oldest: the most work)."""
    return max(0.0, now - started)
