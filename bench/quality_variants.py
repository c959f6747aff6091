"""Policy variants around issue 16's targets (BENCHMARKS.md "Placement quality", the variants
table): the node score for small device pods with and without best-fit's ceiling, and the
ceiling for other requests. Run on seeds 1-40 to choose and on seeds 101-180 to check the choice
on runs it was not read off.

- in force: device pods of up to 4 devices score no higher than best-fit scores them (adopted
  2026-11-24, session 9, chosen on seeds 1-40, checked on seeds 101-180);
- demand alone: the rule before it;
- the ceiling for device pods of 2-4 devices only, for core pods only: session 9's other
  candidates;
- the ceiling for every request, and for every request of up to 4 devices' worth (core pods
  too): the variants of session 8;
- reservation (session 10): among the nodes that fit a pod, leave out those where it would take
  the last free home (one node, or one of two) of a larger shape the cluster asks for, while
  other nodes fit; or use that only to break kube-scheduler's ties.

--tie-streams N: the rule in force on each seed under N streams of kube-scheduler's random
picks among equally scored nodes (the same pods each time): how much of a row's spread is
those picks alone, and the best of them per seed (known only in hindsight).

Run: uv run python bench/quality_variants.py [--seeds 40] [--first-seed 1]
     [--rows inference:0.85,mixed:1.2] [--adopted | --tie-streams 16]
The held-out check: --seeds 80 --first-seed 101 --adopted (first-fit, the rule in force and
demand alone only).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

from fleet import standard_pods
from neuron_scheduler.core.allocation import (
    SMALL_DEVICE_COUNT,
    Decision,
    NodeState,
    Placement,
    Policy,
    allocate,
    decides_by_demand,
    demand_score,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import DemandWeights
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.sim.contenders import FIRST_FIT, NEURON_SCHEDULER, Contender
from neuron_scheduler.sim.simulation import (
    Allocator,
    Feasible,
    SimNode,
    SimResult,
    Simulation,
    Waiting,
)
from neuron_scheduler.sim.workloads import STANDARD, Workload

ROWS = tuple((name, load) for name in STANDARD for load in (1.2, 0.85))


# How a variant scores a placement the rule in force made through the demand score.
Rescore = Callable[[Topology, NodeState, NeuronRequest, DemandWeights, Placement], int]


def rescored(rescore: Rescore) -> Allocator:
    """The rule in force with another node score where the demand score decided."""

    def decide(
        topology: Topology,
        state: NodeState,
        request: NeuronRequest,
        policy: Policy,
        demand: DemandWeights,
    ) -> Decision:
        decision = allocate(topology, state, request, policy, demand)
        if not isinstance(decision, Placement) or not decides_by_demand(topology, policy, demand):
            return decision
        return decision._replace(score=rescore(topology, state, request, demand, decision))

    return decide


def devices_worth(request: NeuronRequest, topology: Topology) -> float:
    if request.unit is Unit.CORE:
        return request.count / topology.cores_per_device
    return request.count


def ceiling(applies: Callable[[NeuronRequest, Topology], bool]) -> Rescore:
    """The score by demand alone, capped by best-fit's for the requests `applies` picks (none:
    the rule before session 9)."""

    def rescore(
        topology: Topology,
        state: NodeState,
        request: NeuronRequest,
        demand: DemandWeights,
        placement: Placement,
    ) -> int:
        # From demand alone: the rule in force already caps small device pods.
        alone = demand_score(topology, state.used_cores, placement.core_mask, demand)
        if not applies(request, topology):
            return alone
        best_fit = allocate(topology, state, request, Policy.BEST_FIT, ())
        assert isinstance(best_fit, Placement)  # the same node state fits the same request
        return min(alone, best_fit.score)

    return rescore


# Shapes asked for less than this (about 2% of the snapshot's ~1024) are not reserved for.
RESERVED_WEIGHT = 20


class ReservingSimulation(Simulation):
    """The rule in force, holding back scarce homes of larger shapes. A placement takes a scarce
    home of a shape when its node can take that shape now and not after, and at most `homes`
    nodes (this one included) can take it now; its cost is the demand weight of the shapes whose
    scarce homes it takes (shapes larger than the pod, asked for at least RESERVED_WEIGHT). Of
    the nodes that fit, kube-scheduler scores only those of least cost (all of them when none
    costs anything), or, `as_tie_break`, picks among its equally scored nodes the least costly.
    """

    homes = 1
    as_tie_break = False  # only among kube-scheduler's equally scored nodes

    def _shortlist(self, feasible: list[Feasible], request: NeuronRequest) -> list[Feasible]:
        if self.as_tie_break:
            return feasible
        costs = [self._cost(placement, members, request) for _, placement, members in feasible]
        least = min(costs)
        return [f for f, cost in zip(feasible, costs, strict=True) if cost == least]

    def _break_tie(
        self, tied: list[tuple[Placement, dict[str, SimNode]]], waiting: Waiting
    ) -> tuple[SimNode, Placement]:
        if self.as_tie_break and len(tied) > 1:
            costs = [self._cost(p, members, waiting.request) for p, members in tied]
            least = min(costs)
            tied = [t for t, cost in zip(tied, costs, strict=True) if cost == least]
        return super()._break_tie(tied, waiting)

    def _cost(
        self, placement: Placement, members: dict[str, SimNode], request: NeuronRequest
    ) -> int:
        """The demand weight of the larger shapes whose scarce home this placement takes."""
        node = next(iter(members.values()))  # the members are alike: any of them answers
        topology, state = node.topology, node.state
        cost = 0
        for unit, count, weight in self.demand.weights:
            shape = NeuronRequest(NEURON if unit is Unit.DEVICE else NEURONCORE, count)
            if weight < RESERVED_WEIGHT or devices_worth(shape, topology) <= devices_worth(
                request, topology
            ):
                continue
            if not _fits(topology, state, shape) or _fits(
                topology, state.with_used(placement.core_mask), shape
            ):
                continue
            if self._homes(shape) <= self.homes:
                cost += weight
        return cost

    def _homes(self, shape: NeuronRequest) -> int:
        return sum(
            len(members)
            for (topology, _, _), groups in self._index.items()
            for (state, _, _, _), members in groups.items()
            if _fits(topology, state, shape)
        )


def _fits(topology: Topology, state: NodeState, request: NeuronRequest) -> bool:
    return isinstance(allocate(topology, state, request), Placement)


def reserving(homes: int, as_tie_break: bool) -> type[Simulation]:
    return type(
        "ReservingSimulation",
        (ReservingSimulation,),
        {"homes": homes, "as_tie_break": as_tie_break},
    )


VARIANTS = (
    NEURON_SCHEDULER,
    Contender("demand alone (before session 9)", allocator=rescored(ceiling(lambda r, t: False))),
    Contender(
        "ceiling for device pods of 2-4 devices only",
        allocator=rescored(ceiling(lambda r, _: r.unit is Unit.DEVICE and 2 <= r.count <= 4)),
    ),
    Contender(
        "ceiling for core pods only (every size)",
        allocator=rescored(ceiling(lambda r, _: r.unit is Unit.CORE)),
    ),
    Contender(
        "ceiling for every request",
        allocator=rescored(ceiling(lambda r, t: True)),
    ),
    Contender(
        f"ceiling up to {SMALL_DEVICE_COUNT} devices' worth, cores too",
        allocator=rescored(ceiling(lambda r, t: devices_worth(r, t) <= SMALL_DEVICE_COUNT)),
    ),
    Contender("reservation: the last home", simulation=reserving(1, False)),
    Contender("reservation: one of the last two homes", simulation=reserving(2, False)),
    Contender("reservation of the last home, among ties only", simulation=reserving(1, True)),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument(
        "--rows",
        default=",".join(f"{name}:{load}" for name, load in ROWS),
        help="workload:load pairs, comma-separated (default: all six)",
    )
    parser.add_argument(
        "--adopted", action="store_true", help="only the rule in force and demand alone"
    )
    parser.add_argument(
        "--variants",
        default="",
        help="only the variants whose label contains this (first-fit and the rule in force run "
        "always)",
    )
    parser.add_argument(
        "--tie-streams",
        type=int,
        default=0,
        help="instead: the rule in force under this many streams of random tie-breaks per seed",
    )
    parser.add_argument(
        "--pods",
        type=int,
        help="pods a seed in each standard workload (default: as committed; a few: a smoke run)",
    )
    args = parser.parse_args()
    standard_pods(args.pods)
    if args.seeds < 2:
        parser.error("--seeds must be 2 or more (the figures come with a confidence interval)")
    if args.tie_streams and (args.tie_streams < 2 or args.adopted or args.variants):
        parser.error("--tie-streams needs 2 or more streams and runs the rule in force alone")
    if args.adopted and args.variants:
        parser.error("--adopted runs the rule in force and demand alone: no --variants with it")
    catalog = Catalog.builtin()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    print(f"seeds {seeds.start}-{seeds.stop - 1}")
    rows = _rows(parser, args.rows)
    chosen = VARIANTS[:2] if args.adopted else VARIANTS
    variants = [v for v in chosen if v is NEURON_SCHEDULER or args.variants in v.label]
    for name, load in rows:
        workload = STANDARD[name].at_load(load, catalog)
        if args.tie_streams:
            _tie_streams(name, load, workload, catalog, seeds, args.tie_streams)
            continue
        first_fit_wait = 0.0
        in_force: list[float] = []
        # First-fit first (the waits are relative to its), then the rule in force (the others'
        # first refusals are also given as their difference from it, seed by seed).
        for variant in (FIRST_FIT, *variants):
            first, waits, placed = [], [], []
            for seed in seeds:
                result = variant.run(workload.nodes(), catalog, workload.events(seed), seed)
                assert result.invalid_placements == 0
                first.append(_first_refusal(result))
                waits.append(result.large_wait_mean())
                placed.append(result.placed)
            wait = statistics.fmean(waits)
            if variant is FIRST_FIT:
                first_fit_wait = wait
            if variant is NEURON_SCHEDULER:
                in_force = first
            paired = ""
            if in_force and variant is not NEURON_SCHEDULER:
                differences = [a - b for a, b in zip(first, in_force, strict=True)]
                paired = (
                    f", {statistics.fmean(differences):+.1%} ±{100 * _margin(differences):.1f}"
                    " against the rule in force"
                )
            print(
                f"{name} {load}: {variant.label}: first refusal {statistics.fmean(first):.1%} "
                f"±{100 * _margin(first):.1f} (median {statistics.median(first):.1%}){paired}, "
                f"large-pod wait {wait:.0f} s "
                f"({wait / first_fit_wait if first_fit_wait else float('nan'):.2f}x first-fit), "
                f"placed {statistics.fmean(placed):.1f}",
                flush=True,
            )


def _rows(parser: argparse.ArgumentParser, text: str) -> list[tuple[str, float]]:
    rows = []
    for row in text.split(","):
        name, _, load = row.partition(":")
        try:
            rows.append((name, float(load)))
        except ValueError:
            parser.error(f"--rows: {row!r} is not workload:load (e.g. mixed:0.85)")
        if name not in STANDARD or not 0 < rows[-1][1] < 100:
            parser.error(f"--rows: {row!r}: workloads are {', '.join(STANDARD)}, loads above 0")
    return rows


def _tie_streams(
    name: str, load: float, workload: Workload, catalog: Catalog, seeds: range, streams: int
) -> None:
    """The rule in force on the same pods under `streams` streams of tie-breaks per seed (the
    first is the seed's own, as in every other run)."""
    by_seed: list[list[float]] = []
    for seed in seeds:
        events = workload.events(seed)
        by_seed.append(
            [
                _first_refusal(
                    NEURON_SCHEDULER.run(
                        workload.nodes(), catalog, events, seed if k == 0 else 100_000 * seed + k
                    )
                )
                for k in range(streams)
            ]
        )
    runs = [value for values in by_seed for value in values]
    means = [statistics.fmean(values) for values in by_seed]
    print(
        f"{name} {load}: the rule in force, {streams} tie-break streams x {len(seeds)} seeds: "
        # The interval comes from the seeds' means: a seed's streams share its pods.
        f"first refusal {statistics.fmean(runs):.1%} ±{100 * _margin(means):.1f}, "
        f"{sum(v >= 0.9 for v in runs) / len(runs):.0%} of runs at 90% or more; "
        f"standard deviation within a seed (ties alone) "
        f"{100 * statistics.fmean(statistics.stdev(v) for v in by_seed):.1f} points, "
        f"of the seeds' means {100 * statistics.stdev(means):.1f}; "
        f"each seed's best stream, in hindsight: {statistics.fmean(max(v) for v in by_seed):.1%}",
        flush=True,
    )


def _first_refusal(result: SimResult) -> float:
    refusal = result.utilization_at_first_fragmentation
    return 1.0 if refusal is None else refusal


def _margin(values: list[float]) -> float:
    """Half-width of the mean's 95% confidence interval (normal approximation)."""
    return 1.96 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


if __name__ == "__main__":
    main()
