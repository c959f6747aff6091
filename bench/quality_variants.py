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
  too): the variants of session 8.

Run: uv run python bench/quality_variants.py [--seeds 40] [--first-seed 1]
     [--rows inference:0.85,mixed:1.2] [--adopted]
The held-out check: --seeds 80 --first-seed 101 --adopted (first-fit, the rule in force and
demand alone only).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

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
from neuron_scheduler.core.resources import NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.sim.contenders import FIRST_FIT, NEURON_SCHEDULER, Contender
from neuron_scheduler.sim.simulation import Allocator
from neuron_scheduler.sim.workloads import STANDARD

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
    args = parser.parse_args()
    catalog = Catalog.builtin()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    print(f"seeds {seeds.start}-{seeds.stop - 1}")
    rows = [(name, float(load)) for name, load in (r.split(":") for r in args.rows.split(","))]
    for name, load in rows:
        workload = STANDARD[name].at_load(load, catalog)
        first_fit_wait = 0.0
        in_force: list[float] = []
        # First-fit first (the waits are relative to its), then the rule in force (the others'
        # first refusals are also given as their difference from it, seed by seed).
        for variant in (FIRST_FIT, *(VARIANTS[:2] if args.adopted else VARIANTS)):
            first, waits, placed = [], [], []
            for seed in seeds:
                result = variant.run(workload.nodes(), catalog, workload.events(seed), seed)
                assert result.invalid_placements == 0
                refusal = result.utilization_at_first_fragmentation
                first.append(1.0 if refusal is None else refusal)
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


def _margin(values: list[float]) -> float:
    """Half-width of the mean's 95% confidence interval (normal approximation)."""
    return 1.96 * statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


if __name__ == "__main__":
    main()
