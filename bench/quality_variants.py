"""Policy variants tried against issue 16's 90% at the first fragmentation refusal (session 8;
BENCHMARKS.md "Placement quality", the variants table). Not the product's policy: each caps
neuron-scheduler's node score by best-fit's (the score without demand), for requests up to a
size, with and without the clairvoyant tie-break.

Run: uv run python bench/quality_variants.py [--seeds 40]
"""

from __future__ import annotations

import argparse
import statistics

from neuron_scheduler.core.allocation import Decision, NodeState, Placement, Policy, allocate
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import DemandWeights
from neuron_scheduler.core.resources import NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.sim.clairvoyant import ClairvoyantSimulation
from neuron_scheduler.sim.contenders import CLAIRVOYANT, NEURON_SCHEDULER, Contender
from neuron_scheduler.sim.simulation import Allocator
from neuron_scheduler.sim.workloads import STANDARD

ROWS = (("inference", 0.85), ("mixed", 0.85), ("mixed", 1.2))


def capped(up_to_devices: float) -> Allocator:
    """neuron-scheduler's decision, its score capped by best-fit's for requests of at most
    `up_to_devices` devices' worth."""

    def decide(
        topology: Topology,
        state: NodeState,
        request: NeuronRequest,
        policy: Policy,
        demand: DemandWeights,
    ) -> Decision:
        decision = allocate(topology, state, request, policy, demand)
        if not isinstance(decision, Placement) or not demand:
            return decision
        size = request.count
        if request.unit is Unit.CORE:
            size /= topology.cores_per_device
        if size > up_to_devices:
            return decision
        best_fit = allocate(topology, state, request, policy, ())
        assert isinstance(best_fit, Placement)  # the same node state fits the same request
        return decision._replace(score=min(decision.score, best_fit.score))

    return decide


VARIANTS = (
    NEURON_SCHEDULER,
    Contender("cap, every size", allocator=capped(float("inf"))),
    Contender("cap, <= 4 devices", allocator=capped(4)),
    Contender("cap, <= 1 device", allocator=capped(1)),
    CLAIRVOYANT,
    Contender(
        "clairvoyant + cap, <= 4 devices",
        allocator=capped(4),
        simulation=ClairvoyantSimulation,
    ),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=40)
    args = parser.parse_args()
    catalog = Catalog.builtin()
    for name, load in ROWS:
        workload = STANDARD[name].at_load(load, catalog)
        for variant in VARIANTS:
            first, waits = [], []
            for seed in range(1, args.seeds + 1):
                result = variant.run(workload.nodes(), catalog, workload.events(seed), seed)
                assert result.invalid_placements == 0
                refusal = result.utilization_at_first_fragmentation
                first.append(1.0 if refusal is None else refusal)
                waits.append(result.large_wait_mean())
            margin = 1.96 * statistics.stdev(first) / len(first) ** 0.5 if len(first) > 1 else 0
            print(
                f"{name} {load}: {variant.label}: first refusal {statistics.fmean(first):.1%} "
                f"±{100 * margin:.1f} (median {statistics.median(first):.1%}), "
                f"large-pod wait {statistics.fmean(waits):.0f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
