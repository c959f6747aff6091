"""Variants of the DRA path around issue 42's targets (BENCHMARKS.md "DRA: core claims, node
choice, device order"), each seed by seed against neuron-scheduler on the same pods:

- as built: core windows in our order (from the low end), first fit, our two prioritize entries
  (bench/quality.py "DRA + our prioritize");
- core windows from the high end: core claims fill a node from the top while device claims fill
  it from the bottom (two-ended packing), a static order;
- without the packing entry: prioritize-claims alone (no prioritize-claims-packing);
- order republished, best fit: the driver republishes its order after every change so that first
  fit is its node's best fit (bench/quality.py's bound);
- order republished, by demand: the same with the extender's own choice within the node (best fit
  weighed by the cluster's demand, which the driver does not see): what only the extender's
  rule, made by the scheduler's allocator, would give.

Run: uv run python bench/dra_variants.py [--seeds 10] [--workloads inference,mixed,training]
     [--variants high]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import replace

import quality
from fleet import standard_pods
from neuron_scheduler.core.allocation import (
    Decision,
    NodeState,
    Policy,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import DemandWeights
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra import firstfit, scoring, shapes
from neuron_scheduler.sim.contenders import Contender
from neuron_scheduler.sim.workloads import STANDARD

OURS = shapes._core_windows
Order = Callable[[Topology, int], list[shapes.Shape]]


def from_the_high_end(topology: Topology, count: int) -> list[shapes.Shape]:
    windows = OURS(topology, count)
    windows.sort(key=lambda s: (len(s.members), -(s.core_mask & -s.core_mask)))
    return windows


def by_demand(
    topology: Topology,
    state: NodeState,
    request: NeuronRequest,
    policy: Policy,
    demand: DemandWeights,
) -> Decision:
    del policy
    request = quality.as_published(request, topology, quality.CORE_WINDOWS[0])
    return quality.republished(topology, state, request, demand, by_demand=True)


AS_BUILT = next(c for c in quality.CONTENDERS if c.label == quality.DRA_LABEL)
REPUBLISHED = next(c for c in quality.CONTENDERS if c.label.endswith("order republished"))
VARIANTS: tuple[tuple[str, Contender, Order], ...] = (
    ("as built", AS_BUILT, OURS),
    ("core windows from the high end", AS_BUILT, from_the_high_end),
    (
        "without the packing entry",
        replace(AS_BUILT, profile=replace(AS_BUILT.profile, packing_weight=0)),
        OURS,
    ),
    ("order republished, best fit", REPUBLISHED, OURS),
    (
        "order republished, by demand",
        Contender("by demand", Policy.BEST_FIT, quality.DRA_PRIORITIZE, by_demand),
        OURS,
    ),
)


def use(order: Order) -> None:
    shapes._core_windows = order
    for cached in (shapes._shapes, shapes._by_name, firstfit._by_request, scoring.scored_decision):
        cached.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--workloads", default="inference,mixed,training")
    parser.add_argument("--variants", default="", help="only those whose label contains this")
    parser.add_argument(
        "--pods",
        type=int,
        help="pods a seed in each standard workload (default: as committed; a few: a smoke run)",
    )
    args = parser.parse_args()
    standard_pods(args.pods)
    catalog = Catalog.builtin()
    chosen = [v for v in VARIANTS if args.variants in v[0]]
    print(f"seeds 1-{args.seeds}; each against neuron-scheduler on the same pods\n")
    print(
        "| variant | workload | load | pods placed vs neuron-scheduler "
        "| 1st frag. refusal, seed by seed |"
    )
    print("|---|---|---|---|---|")
    for name in args.workloads.split(","):
        for load_name, load in quality.LOADS.items():
            workload = STANDARD[name].at_load(load, catalog)
            ours = [
                quality.NEURON_SCHEDULER.run(workload.nodes(), catalog, workload.events(s), s)
                for s in range(1, args.seeds + 1)
            ]
            for label, contender, order in chosen:
                use(order)
                gaps, placed = [], []
                for seed, mine in enumerate(ours, start=1):
                    run = contender.run(workload.nodes(), catalog, workload.events(seed), seed)
                    gaps.append(
                        quality._value(run, "frag_util") - quality._value(mine, "frag_util")
                    )
                    placed.append(run.placed / mine.placed - 1)
                mean = statistics.fmean(gaps)
                margin = 1.96 * statistics.stdev(gaps) / len(gaps) ** 0.5
                print(
                    f"| {label} | {name} | {load_name} | {statistics.fmean(placed):+.1%} "
                    f"| {100 * mean:+.1f} ±{100 * margin:.1f} points |",
                    flush=True,
                )
    use(OURS)


if __name__ == "__main__":
    main()
