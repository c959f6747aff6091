"""Static orders of the DRA driver's core windows (issue 42, "device order, measured"): DRA with
our prioritize (bench/quality.py's "DRA + our prioritize") with core windows published in our
order (from the low end: first fit takes the lowest free window) and from the high end (core
claims fill the node from the top while device claims fill it from the bottom: two-ended
packing), seed by seed against neuron-scheduler on the same pods.

Run: uv run python bench/dra_order_variants.py [--seeds 10] [--workloads inference,mixed]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import quality
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra import firstfit, scoring, shapes
from neuron_scheduler.sim.workloads import STANDARD

OURS = shapes._core_windows


def from_the_high_end(topology: Topology, count: int) -> list[shapes.Shape]:
    windows = OURS(topology, count)
    windows.sort(key=lambda s: (len(s.members), -(s.core_mask & -s.core_mask)))
    return windows


ORDERS: dict[str, Callable[[Topology, int], list[shapes.Shape]]] = {
    "from the low end (ours)": OURS,
    "from the high end": from_the_high_end,
}


def use(order: Callable[[Topology, int], list[shapes.Shape]]) -> None:
    shapes._core_windows = order
    for cached in (shapes._shapes, shapes._by_name, firstfit._by_request, scoring.scored_decision):
        cached.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--workloads", default="inference,mixed")
    args = parser.parse_args()
    catalog = Catalog.builtin()
    dra = next(c for c in quality.CONTENDERS if c.label == quality.DRA_LABEL)
    print(
        "| order | workload | load | pods placed vs neuron-scheduler "
        "| 1st frag. refusal, seed by seed |"
    )
    print("|---|---|---|---|---|")
    for label, order in ORDERS.items():
        use(order)
        for name in args.workloads.split(","):
            for load_name, load in quality.LOADS.items():
                workload = STANDARD[name].at_load(load, catalog)
                gaps, placed = [], []
                for seed in range(1, args.seeds + 1):
                    events = workload.events(seed)
                    ours = quality.NEURON_SCHEDULER.run(workload.nodes(), catalog, events, seed)
                    theirs = dra.run(workload.nodes(), catalog, events, seed)
                    gaps.append(
                        quality._value(theirs, "frag_util") - quality._value(ours, "frag_util")
                    )
                    placed.append(theirs.placed / ours.placed - 1)
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
