"""Preemption for a training job: whole jobs, or nothing (issue 40), on UltraServer units and on
nodes of their own alike. Pure.

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
  that cannot fit with every lower-priority job gone evicts nobody;
- a unit counts for the members it takes empty (an UltraServer node one; a node of its own as many
  blocks as it holds, fewer with a failed device); the units chosen take all the members, and
  none of them could be left out (every pod there is evicted);
- a job that requires one network domain (jobs.network) takes units within one domain of that
  level only, the cheapest domain;
- a unit claimed for a Kueue workload that is admitted and not bound yet is never taken.

The extender's reservation loop carries it out (extender/loops/reserving.py): a dry run of each
victim's deletion (one refused: no preemption), the job's claim on the units (the victims listed
on it, so a restart finishes the evictions), then the evictions; the victims' replacements find
the units claimed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from neuron_scheduler.core.jobpreemption import Choice, Cost, Opening, cheapest
from neuron_scheduler.jobs.claims import MAX_VICTIMS, PENDING, NodeClaim
from neuron_scheduler.jobs.members import JobKey
from neuron_scheduler.jobs.network import Closeness, depth_of
from neuron_scheduler.jobs.placement import (
    Fit,
    Occupancy,
    Shortfall,
    UnitKey,
    job_text,
    never_fits,
    not_a_level,
    unit_words,
)


@dataclass(frozen=True, slots=True)
class Loose:
    """A pod of no job holding Neuron devices on a node (not leaving already)."""

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
    config: int = 4  # the units' node config (1: nodes of their own)
    slots: tuple[int, ...] = ()  # the members each node takes (by `nodes`; empty: one each)

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
    fit: Fit | None = None,
    closeness: Closeness | None = None,
) -> Preemption | Shortfall:
    """The units `job` (`size` members of node config `config`, at `priority`) gets by
    preemption and the victims, or why it gets none. `loose(node)`: the pods of no job on it;
    `unfit(node)`: why its members could not run there even with every pod gone (a failed
    device); `fit`: why they never can and what an empty node takes (for `never_fits`; default:
    `unfit`, one member a node); `now`: wall clock (work lost is counted to it)."""
    held = occupancy.held_units(job)
    need = size - occupancy.held_room(job)
    if need <= 0:
        return Shortfall(f"job {job_text(job)} holds its units already")
    fit = fit if fit is not None else Fit(unfit, excluded=unfit)
    own = {w.node for w in occupancy.job_workers(job)}
    priorities = _priorities(occupancy)
    required = None
    if closeness is not None and closeness.required:
        required = depth_of(closeness.key, occupancy.levels)
        if required is None:
            return Shortfall(not_a_level(job_text(job), closeness, occupancy.levels))
    counted: list[tuple[bool, int]] = []
    for ultra in (True, False) if config > 1 else (False,):
        openings: list[tuple[int, str, Opening[UnitKey, JobKey]]] = []
        pods_of_no_job: dict[UnitKey, list[Loose]] = {}
        rooms: dict[UnitKey, int] = {}
        for unit, nodes in occupancy.members.items():
            room = _room(occupancy, unit, nodes, config, ultra, need, fit)
            if room <= 0 or unit in held:
                continue
            if any(n in occupancy.rejected or unfit(n) is not None for n in nodes):
                continue  # (a claim not read: not ours to take)
            near = list(occupancy.others(job, nodes))
            if any(
                is_claim and _held_for_admission(occupancy.claims.get(n), now)
                for n, is_claim, _ in near
            ):
                continue
            jobs = {other for _, _, other in near if other is not None}
            there = [p for n in sorted(nodes) for p in loose(n)]
            if any(priorities.get(j, LOWEST) >= priority for j in jobs) or any(
                p.priority >= priority for p in there
            ):
                continue
            pods_of_no_job[unit] = there
            rooms[unit] = room
            work = sum(_ran(p.started, now) for p in there)
            opening = Opening(unit, frozenset(jobs), len(there), work, room)
            openings.append((0 if nodes & own else 1, unit[1], opening))
        openings.sort(key=lambda o: (o[0], o[1]))
        counted.append((ultra, len(openings)))

        def lost(victim: JobKey) -> float:
            return sum(_ran(w.started, now) for w in occupancy.job_workers(victim))

        choice: Choice[UnitKey, JobKey] | None = None
        for domain in _domains(occupancy, [o for _, _, o in openings], required):
            here = cheapest(domain, need, lost)
            if here is not None and (choice is None or here.cost < choice.cost):
                choice = here
        if choice is None:
            continue
        evicted = set(choice.jobs)
        victims = [uid for uid, worker in occupancy.workers.items() if worker.job in evicted]
        for opening in choice.openings:
            victims += [p.uid for p in pods_of_no_job[opening.unit]]
        if len(victims) > MAX_VICTIMS:
            return Shortfall(
                f"job {job_text(job)} would evict {len(victims)} pods, more than {MAX_VICTIMS}: "
                "no preemption"
            )
        taken: dict[str, int] = {}
        for opening in choice.openings:
            for node in occupancy.nodes_of(opening.unit):
                taken[node] = 1 if ultra else rooms[opening.unit]
        order = sorted(taken)
        return Preemption(
            job,
            tuple(order),
            choice.jobs,
            tuple(dict.fromkeys(victims)),
            choice.cost,
            config if ultra else 1,
            tuple(taken[n] for n in order),
        )
    never = never_fits(occupancy, job, config, size, fit, closeness)
    if never is not None:
        return never
    ultra, found = max(counted, key=lambda c: c[1])
    more = " more" if held else ""
    where = f" in one {closeness.key} domain" if required is not None and closeness else ""
    if ultra:
        return Shortfall(
            f"job {job_text(job)} needs {unit_words(config, math.ceil(need / config), '')}{more}"
            f"{where} for its {size} members; with every job and pod of lower priority evicted "
            f"there would be {found}: no preemption"
        )
    return Shortfall(
        f"job {job_text(job)} needs room for {need}{more} of its {size} members{where}; with "
        f"every job and pod of lower priority evicted, the nodes it could have would not hold "
        f"them ({found} such node{'s' if found != 1 else ''}): no preemption"
    )


def _room(
    occupancy: Occupancy,
    unit: UnitKey,
    nodes: set[str],
    config: int,
    ultra: bool,
    need: int,
    fit: Fit,
) -> int:
    """The members the unit takes once every pod there is gone; 0 when it is none of the kind."""
    if ultra:
        return config if unit[0] == config and config > 1 and len(nodes) == config else 0
    if unit[0] != 1:
        return 0
    node = unit[1]
    if node in occupancy.ultraservers:
        return 1 if config == 1 else 0
    if fit.excluded is not None and fit.excluded(node) is not None:
        return 0
    return fit.empty_room(node, need)


def _domains(
    occupancy: Occupancy, openings: list[Opening[UnitKey, JobKey]], depth: int | None
) -> list[list[Opening[UnitKey, JobKey]]]:
    """The openings in one list, or, for a required level, one list per domain of it."""
    if depth is None:
        return [openings]
    groups: dict[tuple[str, ...], list[Opening[UnitKey, JobKey]]] = {}
    for opening in openings:
        nodes = occupancy.nodes_of(opening.unit)
        place = occupancy.places.get(min(nodes), ()) if nodes else ()
        key = (opening.unit[1],) if depth > len(occupancy.levels) else place[:depth]
        groups.setdefault(key, []).append(opening)
    return list(groups.values())


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


def _held_for_admission(claim: NodeClaim | None, now: float) -> bool:
    """A node Kueue's admission check claimed for a workload whose pods are not all bound yet,
    within its time (docs/kueue.md: the block is the workload's, nobody else may take it,
    whatever their priority). Its job has no member yet, so it counted as the lowest priority
    and a claim of it was taken for any job that asked, leaving the admitted workload's pods
    without their block. (Expired, it protects nothing: another scheduler's, which this extender
    does not end, would otherwise keep its unit from preemption for good.)"""
    return claim is not None and claim.awaits_members(now)


def _ran(started: float, now: float) -> float:
    """Seconds run (a start not known counts as the oldest: the most work)."""
    return max(0.0, now - started)
