"""Training jobs on a Trn2 UltraServer fleet under placement, priority and reservation rules
(issues 32 and 40). Pure.

The fleet is UltraServers of 4 trn2u nodes. Jobs of 4, 8 or 16 members (node config 4, one member
per node) and single-node pods arrive and leave; kube-scheduler is modelled as a queue tried in
order on every event (as it retries pods on cluster events), one pod at a time:

- `workers`: the rule before issue 32, member by member: a job fills the UltraServer it started
  and then opens the next complete free one (lowest id first); UltraServers holding or opened by
  another job are closed to it. Members bound before their job can start hold their nodes.
- `gangs`: all or nothing: a job gets units for all its members at once, or nothing; no other
  pod takes those nodes (the extender's claims, issue 32).
- `gangs-hold`: all or nothing, and the oldest waiting job (after `HOLD_AFTER`) keeps units as
  they free until it fits.
- `affinity`: no extender rule, only `ultraserver-affinity`'s pod (anti-)affinity: required
  affinity with the job's own members on the UltraServer key for a job of one unit, preferred
  for larger ones, anti-affinity against other jobs' members; ties broken at random.
- `gangs-priority`: all or nothing with the docs' advice before issue 40 (larger jobs get a
  higher PriorityClass: `PRIORITY`, or `GangWorkload.priorities`), and kube-scheduler's
  preemption as it was: a waiting job's members each evict the pods of one node of lower
  priority (the youngest first), the extender approving, whether or not the job then fits; a
  job that loses a member fails whole (an MPI job does) and starts over; nodes freed are held
  for the preemptor (its nomination) until it fits.
- `preempt`: all or nothing with the same priorities and job-level preemption (issue 40): a
  waiting job evicts the fewest whole lower-priority jobs, then the fewest pods of no job, then
  the least work (core/jobpreemption), only when it then gets units for all its members; the
  units are its claim at once.
- `backfill`: all or nothing, no priorities, and one reservation (EASY backfill): the oldest
  waiting job that cannot start gets the units that free earliest by the run times the running
  ones declare; others may use those units only if their own declared run time ends before.

Single-node pods take any free node. A job runs once all its members are bound and leaves its
lifetime later. A job preempted starts over (its work is lost) and waits again; its wait is the
time it spent waiting in all. A job that has not started by the end is counted as waiting that
long.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

from neuron_scheduler.core.jobpreemption import Opening, cheapest

UNIT = 4  # trn2u.48xlarge nodes in one UltraServer
RULES = ("workers", "gangs", "gangs-hold", "affinity", "gangs-priority", "preempt", "backfill")
PRIORITY_RULES = ("gangs-priority", "preempt")
HOLD_AFTER = 0.5  # hours the oldest waiting job waits before it holds units as they free
# The docs' advice (before issue 40): larger jobs get a higher PriorityClass (single-node pods
# as the smallest jobs): (size, priority) pairs, `GangWorkload.priorities`.
PRIORITY = ((16, 2), (8, 1), (4, 0))


@dataclass(frozen=True, slots=True)
class GangWorkload:
    ultraservers: int = 8
    hours: float = 24 * 7
    load: float = 0.9  # node-hours asked for per node-hour of the fleet
    job_sizes: tuple[tuple[int, float], ...] = ((4, 0.5), (8, 0.3), (16, 0.2))
    job_hours: float = 3.0  # mean lifetime of a job (exponential)
    single_share: float = 0.3  # of the offered node-hours, asked by single-node pods
    single_hours: float = 1.0
    # Declared run times (backfill): each job and pod declares its lifetime times a factor drawn
    # uniformly from 1 to 1 + `declared_slack` (what people set is an upper bound, often loose);
    # a share `1 - declared_share` declares none (never backfilled onto reserved units).
    declared_slack: float = 1.0
    declared_share: float = 1.0
    priorities: tuple[tuple[int, int], ...] = PRIORITY  # (size, priority) under PRIORITY_RULES


@dataclass(slots=True)
class Job:
    name: str
    size: int  # members (1 for a single-node pod)
    arrived: float
    hours: float
    started: float | None = None
    nodes: list[int] = field(default_factory=list)  # bound so far
    held_since: dict[int, float] = field(default_factory=dict)  # node -> when bound or claimed
    priority: int = 0
    declared: float = math.inf  # the run time it declares (backfill), hours
    queued: float = 0.0  # when it joined the queue (arrival, or its preemption)
    waited: float = 0.0  # hours spent waiting, all starts before the last counted
    run: int = 0  # starts so far (a leave event is for one run)

    @property
    def single(self) -> bool:
        return self.size == 1 and self.name.startswith("pod")


@dataclass(frozen=True, slots=True)
class GangResult:
    rule: str
    jobs: int
    started: int
    mean_wait_h: float
    p95_wait_h: float
    idle_node_hours: float  # nodes bound or reserved for a job that could not run yet
    shared_units: int  # UltraServers that held members of two jobs at once (must be 0)
    singles_started: int
    singles: int
    wait_by_size_h: dict[int, float]  # mean wait of the jobs of each size
    p95_by_size_h: dict[int, float] = field(default_factory=dict)  # p95 wait of each size
    lost_node_hours: float = 0.0  # work preempted jobs and pods had done (started over)
    preemptions: int = 0  # jobs and pods evicted


def arrivals(workload: GangWorkload, seed: int) -> list[Job]:
    """The jobs and pods of a seed (the same for every rule), each with what it declares."""
    found = _arrivals(workload, seed)
    declared = random.Random(seed * 104729 + 1)  # its own stream: arrivals stay as they were
    for job in found:
        factor = 1 + declared.random() * workload.declared_slack
        if declared.random() < workload.declared_share:
            job.declared = job.hours * factor
        job.queued = job.arrived
    return found


def _arrivals(workload: GangWorkload, seed: int) -> list[Job]:
    rng = random.Random(seed)
    nodes = workload.ultraservers * UNIT
    sizes = [s for s, _ in workload.job_sizes]
    weights = [w for _, w in workload.job_sizes]
    mean_size = sum(s * w for s, w in workload.job_sizes) / sum(weights)
    job_rate = (
        workload.load * (1 - workload.single_share) * nodes / (mean_size * workload.job_hours)
    )
    single_rate = workload.load * workload.single_share * nodes / workload.single_hours
    found: list[Job] = []
    for kind, rate in (("job", job_rate), ("pod", single_rate)):
        t, i = 0.0, 0
        while True:
            t += rng.expovariate(rate)
            if t >= workload.hours:
                break
            if kind == "job":
                size = rng.choices(sizes, weights)[0]
                found.append(Job(f"job{i}", size, t, rng.expovariate(1 / workload.job_hours)))
            else:
                found.append(Job(f"pod{i}", 1, t, rng.expovariate(1 / workload.single_hours)))
            i += 1
    found.sort(key=lambda j: j.arrived)
    return found


class Fleet:
    def __init__(self, ultraservers: int, rule: str, rng: random.Random) -> None:
        self.rule = rule
        self.rng = rng
        self.holder: list[Job | None] = [None] * (ultraservers * UNIT)  # node -> its pod's job
        self.claimed: dict[int, Job] = {}  # node -> the job whose claim holds it
        self.shared: set[int] = set()
        self.head: Job | None = None  # the oldest job waiting (gangs-hold)
        self.nominated: dict[int, Job] = {}  # node -> the preemptor it is held for
        # backfill: the nodes reserved for the oldest waiting job, and when they free
        self.reserved: set[int] = set()
        self.shadow = math.inf
        self.evicted: list[Job] = []  # preempted since the run loop last looked
        self.lost = 0.0  # node-hours of work preempted
        self.preemptions = 0

    def unit(self, node: int) -> int:
        return node // UNIT

    def unit_nodes(self, unit: int) -> range:
        return range(unit * UNIT, unit * UNIT + UNIT)

    @property
    def units(self) -> int:
        return len(self.holder) // UNIT

    def jobs_in(self, unit: int) -> set[str]:
        return {
            job.name
            for n in self.unit_nodes(unit)
            for job in (self.holder[n], self.claimed.get(n))
            if job is not None and not job.single
        }

    def free(self, node: int, job: Job) -> bool:
        return self.holder[node] is None and self.claimed.get(node, job) is job

    def open_to(self, node: int, job: Job, now: float) -> bool:
        """Free for `job`: nobody's pod, claim or nomination in the way (a nomination of lower
        priority does not hold against it), and, under backfill, not reserved for the job at
        the head unless `job` declares it ends before the reservation starts."""
        if not self.free(node, job):
            return False
        held = self.nominated.get(node)
        if held is not None and held is not job and held.priority >= job.priority:
            return False
        if node in self.reserved and job is not self.head:
            return now + job.declared <= self.shadow
        return True

    # --- one pod (or job) at a time, as kube-scheduler tries them --------------------------

    def try_place(self, job: Job, now: float) -> bool:
        """Places what it can of `job` (a member, or all of it); True once it is all bound."""
        if job.single:
            nodes = [
                n
                for n in range(len(self.holder))
                if n not in self.claimed and self.open_to(n, job, now)
            ]
            if not nodes:
                return False
            self.bind(job, self.rng.choice(nodes), now)
            return True
        if self.rule.startswith("gangs") or self.rule in ("preempt", "backfill"):
            return self._gang(job, now)
        while len(job.nodes) < job.size:
            node = self._worker_rule(job) if self.rule == "workers" else self._affinity(job)
            if node is None:
                return False
            self.bind(job, node, now)
        return True

    def bind(self, job: Job, node: int, now: float) -> None:
        self.holder[node] = job
        job.nodes.append(node)
        job.held_since.setdefault(node, now)
        if not job.single and len(self.jobs_in(self.unit(node))) > 1:
            self.shared.add(self.unit(node))

    def release(self, job: Job) -> None:
        for node in job.nodes:
            self.holder[node] = None
        for node in [n for n, j in self.claimed.items() if j is job]:
            del self.claimed[node]
        for node in [n for n, j in self.nominated.items() if j is job]:
            del self.nominated[node]

    def preempt(self, victim: Job, now: float) -> None:
        """The victim stops and starts over: all its nodes free, its work lost, back in the
        queue (the run loop takes `evicted`)."""
        if victim.started is not None:
            self.lost += victim.size * (now - victim.started)
        self.release(victim)
        victim.nodes = []
        victim.held_since = {}
        victim.started = None
        victim.run += 1
        victim.queued = now
        self.preemptions += 1
        self.evicted.append(victim)

    def _free_units(self, job: Job, now: float) -> list[int]:
        return [
            u
            for u in range(self.units)
            if all(self.open_to(n, job, now) for n in self.unit_nodes(u))
        ]

    def _gang(self, job: Job, now: float) -> bool:
        units = math.ceil(job.size / UNIT)
        free = self._free_units(job, now)
        if len(free) < units and self.rule == "gangs-priority":
            free = self._preempt_by_node(job, units, now)
        elif len(free) < units and self.rule == "preempt":
            free = self._preempt_jobs(job, units, now)
        if len(free) < units:
            if self.rule == "gangs-hold" and self.head is job and now - job.arrived > HOLD_AFTER:
                for unit in free:  # the oldest waiting job holds what frees, until it fits
                    for node in self.unit_nodes(unit):
                        self.claimed[node] = job
                        job.held_since.setdefault(node, now)
            return False
        for unit in free[:units]:
            for node in self.unit_nodes(unit):
                self.claimed[node] = job
        for node in [n for n, j in self.nominated.items() if j is job]:
            del self.nominated[node]
        members = [n for u in free[:units] for n in self.unit_nodes(u)][: job.size]
        for node in members:
            self.bind(job, node, now)
        return True

    def _preempt_by_node(self, job: Job, units: int, now: float) -> list[int]:
        """kube-scheduler's preemption as it was: each member of the waiting job evicts the
        pods of one node of lower priority (the lowest priority, then the youngest), the node
        held for it; the members are tried one after another within a second, each before the
        victims of the others are gone, so none waits to see whether the job fits. A job that
        loses a member fails whole and starts over."""
        for _ in range(job.size):
            victims = [
                (victim.priority, -(victim.started or 0.0), node)
                for node, victim in enumerate(self.holder)
                if victim is not None
                and victim.priority < job.priority
                and self.nominated.get(node, job) is job
            ]
            if not victims:
                break
            node = min(victims)[2]
            victim = self.holder[node]
            assert victim is not None
            self.preempt(victim, now)
            self.nominated[node] = job
        return self._free_units(job, now)

    def _preempt_jobs(self, job: Job, units: int, now: float) -> list[int]:
        """Job-level preemption (issue 40): the cheapest units by core/jobpreemption, only when
        they give the job all its units; their victims are evicted whole."""
        openings: list[Opening[int, str]] = []
        jobs: dict[str, Job] = {}
        for unit in range(self.units):
            nodes = self.unit_nodes(unit)
            there = {
                j.name: j
                for n in nodes
                for j in (self.holder[n], self.claimed.get(n))
                if j is not None and j is not job and not j.single
            }
            singles = [j for n in nodes if (j := self.holder[n]) is not None and j.single]
            if any(j.priority >= job.priority for j in [*there.values(), *singles]):
                continue
            jobs.update(there)
            work = sum(now - (j.started if j.started is not None else now) for j in singles)
            openings.append(Opening(unit, frozenset(there), len(singles), work))

        def lost(name: str) -> float:
            victim = jobs[name]
            return victim.size * (now - (victim.started if victim.started is not None else now))

        choice = cheapest(openings, units, lost)
        if choice is None:
            return []
        for name in choice.jobs:
            self.preempt(jobs[name], now)
        chosen = [o.unit for o in choice.openings]
        for unit in chosen:
            for node in self.unit_nodes(unit):
                single = self.holder[node]
                if single is not None:
                    self.preempt(single, now)
        return chosen

    def reserve_for(self, job: Job | None, now: float) -> None:
        """Backfill: the units that free earliest by declared run times, for `job` (the oldest
        waiting training job that cannot start), and when the last of them frees; nothing for
        None."""
        self.reserved, self.shadow = set(), math.inf
        if job is None:
            return
        frees: list[tuple[float, int]] = []
        for unit in range(self.units):
            ends = [
                holder.started + holder.declared
                for n in self.unit_nodes(unit)
                if (holder := self.holder[n]) is not None and holder.started is not None
            ]
            frees.append((max(ends, default=now), unit))
        frees.sort()
        chosen = frees[: math.ceil(job.size / UNIT)]
        if chosen[-1][0] == math.inf:
            return  # no declared end in sight: nothing to reserve against
        self.shadow = chosen[-1][0]
        self.reserved = {n for _, unit in chosen for n in self.unit_nodes(unit)}

    def held_free(self) -> int:
        """Nodes free but held for a job that cannot run yet: nominated (gangs-priority) or
        reserved (backfill)."""
        held = set(self.nominated) | self.reserved
        return sum(1 for n in held if self.holder[n] is None)

    def _worker_rule(self, job: Job) -> int | None:
        mine = {self.unit(n) for n in job.nodes}
        for unit in sorted(mine):  # fill the UltraServer it started first
            for node in self.unit_nodes(unit):
                if self.free(node, job):
                    return node
        for unit in range(len(self.holder) // UNIT):  # then open the next complete free one
            if unit in mine or self.jobs_in(unit) - {job.name}:
                continue
            if all(self.holder[n] is None for n in self.unit_nodes(unit)):
                return unit * UNIT
        return None

    def _affinity(self, job: Job) -> int | None:
        mine = {self.unit(n) for n in job.nodes}
        candidates = []
        for node in range(len(self.holder)):
            if self.holder[node] is not None:
                continue
            unit = self.unit(node)
            if self.jobs_in(unit) - {job.name}:
                continue  # anti-affinity: other jobs' members on this UltraServer
            if job.size <= UNIT and mine and unit not in mine:
                continue  # required affinity with its own members
            candidates.append((0 if unit in mine else 1, node))
        if not candidates:
            return None
        best = min(c[0] for c in candidates)  # preferred affinity outweighs the rest
        return self.rng.choice([n for score, n in candidates if score == best])


def run(workload: GangWorkload, rule: str, seed: int) -> GangResult:
    rng = random.Random(seed * 7919 + RULES.index(rule))
    jobs = arrivals(workload, seed)
    if rule in PRIORITY_RULES:
        for job in jobs:
            job.priority = dict(workload.priorities).get(job.size, 0)
    fleet = Fleet(workload.ultraservers, rule, rng)
    events: list[tuple[float, int, str, Job, int]] = []
    for i, job in enumerate(jobs):
        heapq.heappush(events, (job.arrived, i, "arrive", job, 0))
    queue: list[Job] = []
    idle = 0.0
    counter = len(jobs)
    last = 0.0
    while events:
        now, _, kind, job, run_ = heapq.heappop(events)
        if now > workload.hours:
            break
        idle += fleet.held_free() * (now - last)  # held for a preemptor, or reserved
        last = now
        if kind == "arrive":
            queue.append(job)
        elif run_ != job.run:
            continue  # it was preempted: this run ended early
        else:
            fleet.release(job)
        if rule in PRIORITY_RULES:  # kube-scheduler's queue: highest priority, then oldest
            queue.sort(key=lambda j: (-j.priority, j.queued))
        still = []
        fleet.head = next((j for j in queue if not j.single), None)
        blocked: Job | None = None  # backfill: the first job that cannot start
        for waiting in queue:  # kube-scheduler tries the queue in order on every event
            if rule == "backfill" and blocked is None:
                fleet.head = waiting
            if fleet.try_place(waiting, now):
                waiting.started = now
                waiting.waited += now - waiting.queued
                idle += sum(now - t for t in waiting.held_since.values())
                counter += 1
                heapq.heappush(
                    events, (now + waiting.hours, counter, "leave", waiting, waiting.run)
                )
            else:
                still.append(waiting)
                if rule == "backfill" and blocked is None and not waiting.single:
                    blocked = waiting  # the oldest waiting job: the units that free first
                    fleet.reserve_for(waiting, now)
        if rule == "backfill" and blocked is None:
            fleet.reserve_for(None, now)
        queue = still + fleet.evicted
        fleet.evicted = []
    end = workload.hours
    idle += fleet.held_free() * max(0.0, end - last)
    for job in queue:  # members bound for a job that never started
        idle += sum(end - t for t in job.held_since.values())
        job.waited += end - job.queued
    gangs = [j for j in jobs if not j.single]
    singles = [j for j in jobs if j.single]
    waits = sorted(j.waited for j in gangs)
    sizes = sorted({j.size for j in gangs})
    by_size = {size: sorted(j.waited for j in gangs if j.size == size) for size in sizes}
    return GangResult(
        rule,
        len(gangs),
        sum(1 for j in gangs if j.started is not None),
        statistics.fmean(waits) if waits else 0.0,
        _p95(waits),
        idle,
        len(fleet.shared),
        sum(1 for j in singles if j.started is not None),
        len(singles),
        {size: statistics.fmean(w) for size, w in by_size.items()},
        {size: _p95(w) for size, w in by_size.items()},
        fleet.lost,
        fleet.preemptions,
    )


def _p95(waits: list[float]) -> float:
    return waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0
