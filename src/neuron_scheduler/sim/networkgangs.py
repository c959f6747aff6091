"""Training jobs on a fleet of nodes in network domains (issue 47). Pure.

The fleet is `nodes` trn1 nodes in layer-3 domains of 16 to 32 nodes (EKS's
`topology.k8s.aws/network-node-layer-3`), four layer-3 domains to a layer-2 domain, one layer-1
domain. Jobs of 2 to 32 members, each member a whole node, arrive and leave; every job gets nodes
for all its members at once or waits (the extender's claims), and the waiting jobs are tried
oldest first on every arrival and departure, each taking nodes if it fits now (the reservation
loop's order). The rules differ only in which free nodes a job that fits takes:

- `none`: any free nodes, at random (kube-scheduler's tie-break among nodes that score alike:
  the extender before issue 47 knew nothing of the network);
- `first-fit`: the first layer-3 domain, in a fixed order, with room for the whole job, else
  domains in that order until it fits;
- `closest`: the extender's rule, jobs/network.py `choose` (the fewest layer-3 domains, then
  layer-2, best fit; a job that must span domains takes the most broken-up ones);
- `closest-wait`: measured, not built: `closest`, and a job that one layer-3 domain could hold
  but none can now waits up to `patience_h` for one (as if it required one for that long), then
  spans domains;
- `by-size`, `end-aligned`: measured, not built, to see whether another immediate rule does
  better: a job one domain holds goes to the smallest such domain (by nodes in all), then best
  fit; or (clairvoyant: run times known) to the domain whose running jobs end closest to when
  it ends. Spanning as `closest`.

A job's wait is from its arrival to its start; a job not started by the end counts as waiting to
the end. Idle node-hours are node-hours that nodes stood free while a job waited (for more than
were free, or, under closest-wait, for one domain).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

from neuron_scheduler.jobs.network import Atom, Closeness, choose

RULES = ("none", "first-fit", "closest", "closest-wait", "by-size", "end-aligned")
LEVELS = ("layer-1", "layer-2", "layer-3")


@dataclass(frozen=True, slots=True)
class NetworkWorkload:
    nodes: int = 384
    domain_sizes: tuple[int, ...] = (16, 24, 32)  # layer-3 domains, drawn until the fleet is full
    domains_per_layer2: int = 4
    hours: float = 24 * 7
    load: float = 0.8  # node-hours asked for per node-hour of the fleet
    job_sizes: tuple[tuple[int, float], ...] = (
        (2, 0.3),
        (4, 0.25),
        (8, 0.2),
        (16, 0.15),
        (32, 0.1),
    )
    job_hours: float = 3.0  # mean lifetime of a job (exponential)
    patience_h: float = 0.5  # how long a job waits for one layer-3 domain under closest-wait


@dataclass(slots=True)
class Job:
    index: int
    size: int
    arrived: float
    hours: float
    started: float | None = None
    nodes: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class NetworkResult:
    rule: str
    jobs: int
    started: int
    mean_wait_h: float
    p95_wait_h: float
    wait_by_size_h: dict[int, float]
    p95_by_size_h: dict[int, float]
    mean_domains: float  # layer-3 domains a started job spans
    one_domain_share: float  # of started jobs that fit in one layer-3 domain, those in one
    idle_node_hours: float
    one_domain_by_size: dict[int, float] = field(default_factory=dict)


def fleet(workload: NetworkWorkload, seed: int) -> list[tuple[str, str, str]]:
    """Each node's place (layer-1, layer-2, layer-3), for a seed (the same for every rule)."""
    rng = random.Random(seed * 7919 + 3)
    places: list[tuple[str, str, str]] = []
    domain = 0
    while len(places) < workload.nodes:
        size = min(rng.choice(workload.domain_sizes), workload.nodes - len(places))
        layer2 = f"s{domain // workload.domains_per_layer2}"
        places += [("nn-1", layer2, f"d{domain:03d}")] * size
        domain += 1
    return places


def arrivals(workload: NetworkWorkload, seed: int) -> list[Job]:
    """The jobs of a seed (the same for every rule): Poisson arrivals at the load asked for."""
    rng = random.Random(seed)
    sizes, weights = zip(*workload.job_sizes, strict=True)
    mean_size = sum(s * w for s, w in workload.job_sizes) / sum(weights)
    rate = workload.load * workload.nodes / (mean_size * workload.job_hours)  # jobs per hour
    jobs: list[Job] = []
    now = 0.0
    while True:
        now += rng.expovariate(rate)
        if now >= workload.hours:
            return jobs
        size = rng.choices(sizes, weights)[0]
        jobs.append(Job(len(jobs), size, now, rng.expovariate(1 / workload.job_hours)))


class Cluster:
    def __init__(self, places: list[tuple[str, str, str]], rule: str, rng: random.Random) -> None:
        self.places = places
        self.rule = rule
        self.rng = rng
        self.free = set(range(len(places)))
        self.domains = sorted({p for p in places})  # first-fit's fixed order
        self.sizes = {p: places.count(p) for p in self.domains}
        self.largest = max(self.sizes.values())
        self.ends: dict[int, float] = {}  # busy node -> when its job ends (end-aligned only)

    def _end_gap(self, domain: tuple[str, str, str], end: float) -> float:
        """How far the latest end of the jobs running in the domain is from `end` (an empty
        domain: as far as can be)."""
        busy = [self.ends[n] for n in self.ends if self.places[n] == domain]
        return abs(max(busy) - end) if busy else math.inf

    def pick(self, job: Job, now: float, one_domain: bool = False) -> list[int] | None:
        """The nodes the job takes at `now`, or None (`one_domain`: only within one layer-3
        domain)."""
        if len(self.free) < job.size:
            return None
        if self.rule == "none":
            return self.rng.sample(sorted(self.free), job.size)
        if self.rule == "first-fit":
            by_domain: dict[tuple[str, str, str], list[int]] = {}
            for n in sorted(self.free):
                by_domain.setdefault(self.places[n], []).append(n)
            for domain in self.domains:
                if len(by_domain.get(domain, [])) >= job.size:
                    return by_domain[domain][: job.size]
            ordered = [n for d in self.domains for n in by_domain.get(d, [])]
            return ordered[: job.size]
        if self.rule in ("by-size", "end-aligned"):
            by_domain = {}
            for n in sorted(self.free):
                by_domain.setdefault(self.places[n], []).append(n)
            fitting = [d for d, free in by_domain.items() if len(free) >= job.size]
            if fitting:
                end = now + job.hours
                key = (
                    (lambda d: (self.sizes[d], len(by_domain[d]), d))
                    if self.rule == "by-size"
                    else (lambda d: (self._end_gap(d, end), len(by_domain[d]), d))
                )
                return by_domain[min(fitting, key=key)][: job.size]
        atoms = [Atom(n, 1, self.places[n], 1, f"{n:06d}") for n in sorted(self.free)]
        asked = Closeness(LEVELS[-1], True, "patience") if one_domain else None
        chosen = choose(atoms, job.size, LEVELS, asked)
        return None if chosen is None else [a.key for a in chosen.atoms]


def run(workload: NetworkWorkload, rule: str, seed: int) -> NetworkResult:
    places = fleet(workload, seed)
    cluster = Cluster(places, rule, random.Random(seed * 31 + 7))
    jobs = arrivals(workload, seed)
    events = [(j.arrived, 0, "arrive", j.index) for j in jobs]
    if rule == "closest-wait":  # a retry when a job's patience ends, whatever else happens
        events += [(j.arrived + workload.patience_h, 2, "patience", j.index) for j in jobs]
    heapq.heapify(events)
    waiting: list[Job] = []
    idle, last = 0.0, 0.0
    while events:
        now, _, kind, index = heapq.heappop(events)
        if now > workload.hours:
            break
        if waiting:
            idle += len(cluster.free) * (now - last)
        last = now
        job = jobs[index]
        if kind == "arrive":
            waiting.append(job)
        elif kind == "leave":
            cluster.free.update(job.nodes)
            for node in job.nodes:
                cluster.ends.pop(node, None)
        still = []
        for candidate in waiting:
            patient = (
                rule == "closest-wait"
                and candidate.size <= cluster.largest
                and now - candidate.arrived < workload.patience_h
            )
            nodes = cluster.pick(candidate, now, patient)
            if nodes is None:
                still.append(candidate)
                continue
            cluster.free.difference_update(nodes)
            cluster.ends.update(dict.fromkeys(nodes, now + candidate.hours))
            candidate.nodes, candidate.started = nodes, now
            heapq.heappush(events, (now + candidate.hours, 1, "leave", candidate.index))
        waiting = still
    if waiting:
        idle += len(cluster.free) * (workload.hours - last)
    return _result(rule, jobs, places, cluster.largest, workload.hours, idle)


def _result(
    rule: str,
    jobs: list[Job],
    places: list[tuple[str, str, str]],
    largest: int,
    end: float,
    idle: float,
) -> NetworkResult:
    waits = [(j.started if j.started is not None else end) - j.arrived for j in jobs]
    started = [j for j in jobs if j.started is not None]
    spans = [len({places[n] for n in j.nodes}) for j in started]
    could = [j for j in started if j.size <= largest]
    one = sum(1 for j in could if len({places[n] for n in j.nodes}) == 1)
    by_size: dict[int, list[float]] = {}
    for job, wait in zip(jobs, waits, strict=True):
        by_size.setdefault(job.size, []).append(wait)
    one_by_size: dict[int, list[bool]] = {}
    for job in could:
        one_by_size.setdefault(job.size, []).append(len({places[n] for n in job.nodes}) == 1)
    return NetworkResult(
        rule,
        len(jobs),
        len(started),
        statistics.fmean(waits) if waits else 0.0,
        _p95(waits),
        {size: statistics.fmean(w) for size, w in sorted(by_size.items())},
        {size: _p95(w) for size, w in sorted(by_size.items())},
        statistics.fmean(spans) if spans else 0.0,
        one / len(could) if could else 1.0,
        idle,
        {size: sum(v) / len(v) for size, v in sorted(one_by_size.items())},
    )


def _p95(waits: list[float]) -> float:
    if not waits:
        return 0.0
    ordered = sorted(waits)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
