"""Training jobs on a Trn2 UltraServer fleet under three placement rules (issue 32). Pure.

The fleet is UltraServers of 4 trn2u nodes. Jobs of 4, 8 or 16 members (node config 4, one member
per node) and single-node pods arrive and leave; kube-scheduler is modelled as a queue tried in
order on every event (as it retries pods on cluster events), one pod at a time:

- `workers`: the rule before issue 32, member by member: a job fills the UltraServer it started
  and then opens the next complete free one (lowest id first); UltraServers holding or opened by
  another job are closed to it. Members bound before their job can start hold their nodes.
- `gangs`: all or nothing: a job gets units for all its members at once, or nothing; no other
  pod takes those nodes (what the extender does now).
- `affinity`: no extender rule, only `ultraserver-affinity`'s pod (anti-)affinity: required
  affinity with the job's own members on the UltraServer key for a job of one unit, preferred
  for larger ones, anti-affinity against other jobs' members; ties broken at random.

Single-node pods take any free node. A job runs once all its members are bound and leaves its
lifetime later; a job that has not started by the end is counted as waiting that long.
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

UNIT = 4  # trn2u.48xlarge nodes in one UltraServer
RULES = ("workers", "gangs", "gangs-hold", "affinity")
HOLD_AFTER = 0.5  # hours the oldest waiting job waits before it holds units as they free


@dataclass(frozen=True, slots=True)
class GangWorkload:
    ultraservers: int = 8
    hours: float = 24 * 7
    load: float = 0.9  # node-hours asked for per node-hour of the fleet
    job_sizes: tuple[tuple[int, float], ...] = ((4, 0.5), (8, 0.3), (16, 0.2))
    job_hours: float = 3.0  # mean lifetime of a job (exponential)
    single_share: float = 0.3  # of the offered node-hours, asked by single-node pods
    single_hours: float = 1.0


@dataclass(slots=True)
class Job:
    name: str
    size: int  # members (1 for a single-node pod)
    arrived: float
    hours: float
    started: float | None = None
    nodes: list[int] = field(default_factory=list)  # bound so far
    held_since: dict[int, float] = field(default_factory=dict)  # node -> when bound or claimed

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


def arrivals(workload: GangWorkload, seed: int) -> list[Job]:
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

    def unit(self, node: int) -> int:
        return node // UNIT

    def unit_nodes(self, unit: int) -> range:
        return range(unit * UNIT, unit * UNIT + UNIT)

    def jobs_in(self, unit: int) -> set[str]:
        return {
            job.name
            for n in self.unit_nodes(unit)
            for job in (self.holder[n], self.claimed.get(n))
            if job is not None and not job.single
        }

    def free(self, node: int, job: Job) -> bool:
        return self.holder[node] is None and self.claimed.get(node, job) is job

    # --- one pod (or job) at a time, as kube-scheduler tries them --------------------------

    def try_place(self, job: Job, now: float) -> bool:
        """Places what it can of `job` (a member, or all of it); True once it is all bound."""
        if job.single:
            nodes = [
                n
                for n in range(len(self.holder))
                if self.holder[n] is None and n not in self.claimed
            ]
            if not nodes:
                return False
            self.bind(job, self.rng.choice(nodes), now)
            return True
        if self.rule.startswith("gangs"):
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

    def _gang(self, job: Job, now: float) -> bool:
        units = math.ceil(job.size / UNIT)
        free = [
            u
            for u in range(len(self.holder) // UNIT)
            if all(
                self.holder[n] is None and self.claimed.get(n, job) is job
                for n in self.unit_nodes(u)
            )
        ]
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
        members = [n for u in free[:units] for n in self.unit_nodes(u)][: job.size]
        for node in members:
            self.bind(job, node, now)
        return True

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
    fleet = Fleet(workload.ultraservers, rule, rng)
    events: list[tuple[float, int, str, Job]] = []
    for i, job in enumerate(jobs):
        heapq.heappush(events, (job.arrived, i, "arrive", job))
    queue: list[Job] = []
    idle = 0.0
    counter = len(jobs)
    while events:
        now, _, kind, job = heapq.heappop(events)
        if now > workload.hours:
            break
        if kind == "arrive":
            queue.append(job)
        else:
            fleet.release(job)
        still = []
        fleet.head = next((j for j in queue if not j.single), None)
        for waiting in queue:  # kube-scheduler tries the queue in order on every event
            if fleet.try_place(waiting, now):
                waiting.started = now
                idle += sum(now - t for t in waiting.held_since.values())
                counter += 1
                heapq.heappush(events, (now + waiting.hours, counter, "leave", waiting))
            else:
                still.append(waiting)
        queue = still
    end = workload.hours
    for job in queue:  # members bound for a job that never started
        idle += sum(end - t for t in job.held_since.values())
    gangs = [j for j in jobs if not j.single]
    singles = [j for j in jobs if j.single]
    waits = sorted(((j.started if j.started is not None else end) - j.arrived) for j in gangs)
    return GangResult(
        rule,
        len(gangs),
        sum(1 for j in gangs if j.started is not None),
        statistics.fmean(waits) if waits else 0.0,
        waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0,
        idle,
        len(fleet.shared),
        sum(1 for j in singles if j.started is not None),
        len(singles),
        {
            size: statistics.fmean(
                (j.started if j.started is not None else end) - j.arrived
                for j in gangs
                if j.size == size
            )
            for size in sorted({j.size for j in gangs})
        },
    )
