"""Allocator decisions per second on a 16-device torus and a 12-device ring, random occupancy.

Target (issue 2): at least 50,000 decisions/s on one core. Two figures per topology:
- "cold": the decision function itself with its cache bypassed (every call computes),
- "fleet": through `allocate`, whose cache is what the extender and simulator hit when many
  nodes share a type and a state; occupancy drawn from a realistic pool of 2,000 node states;
- "by demand, cold": through `allocate` with the built-in mix's request shapes as demand
  (core.demand), every cache cleared before each round: what a decision costs the extender
  right after the demand changed.

Run: uv run python bench/allocator.py [--seconds 3] [--decisions 2000] [--states 50000]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from neuron_scheduler.core.allocation import (
    NodeState,
    Policy,
    _decide,
    _decide_by_demand,
    _device_set_cores,
    _unusable,
    allocate,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import Demand, DemandWeights
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.sim.workloads import DEFAULT_MIX


def random_state(rng: random.Random, topology: Topology) -> NodeState:
    # Occupancy of 0-90% of devices, some of them only partly (core-level) used.
    used = 0
    for device in range(topology.devices):
        roll = rng.random()
        if roll < 0.35:
            used |= topology.core_mask_of_devices(1 << device)
        elif roll < 0.5:
            used |= 1 << (device * topology.cores_per_device)
    return NodeState(used)


def requests_for(topology: Topology) -> list[NeuronRequest]:
    devices = [1, 2, 3, 4, 8] if topology.allowed_device_counts is None else [1, 4, 8]
    return [NeuronRequest(NEURON, n) for n in devices] + [
        NeuronRequest(NEURONCORE, n) for n in (1, 2, 4, 8)
    ]


def builtin_demand() -> DemandWeights:
    demand = Demand()
    for mix in DEFAULT_MIX:
        for size in mix.sizes:
            for _ in range(int(mix.weight * 4)):
                demand.record(NeuronRequest(mix.resource, size).unit, size)
    return demand.weights


def measure(
    topology: Topology,
    seconds: float,
    cold: bool,
    pool: int,
    demand: DemandWeights = (),
    decisions: int = 2_000,
) -> list[float]:
    """Decisions per second in rounds of `decisions`, for `seconds` in all (one round at least)."""
    rng = random.Random(1)
    states = [random_state(rng, topology) for _ in range(pool)]
    requests = requests_for(topology)
    work = [(rng.choice(states), rng.choice(requests)) for _ in range(25 * decisions)]
    decide = _decide.__wrapped__  # type: ignore[attr-defined]
    rates: list[float] = []
    deadline = time.perf_counter() + seconds
    while not rates or time.perf_counter() < deadline:
        if demand:
            for cache in (_decide, _decide_by_demand, _unusable, _device_set_cores):
                cache.cache_clear()
        start = time.perf_counter()
        for state, request in work[:decisions]:
            if demand:
                allocate(topology, state, request, Policy.BEST_FIT, demand)
            elif cold:
                decide(topology, state.used_cores, 0, request.unit, request.count, Policy.BEST_FIT)
            else:
                allocate(topology, state, request)
        rates.append(decisions / (time.perf_counter() - start))
        work = work[decisions:] + work[:decisions]
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--decisions", type=int, default=2_000, help="decisions per round")
    parser.add_argument(
        "--states", type=int, default=50_000, help="random node states drawn for the cold rounds"
    )
    args = parser.parse_args()
    if args.decisions < 1 or args.states < 1:
        parser.error("--decisions and --states must be positive")
    catalog = Catalog.builtin()
    print(
        f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}"
        f"; rounds of {args.decisions:,} decisions: median and best round (a shared machine's "
        "noise only ever slows a round down)"
    )
    assert Unit.DEVICE  # the module's enum is what requests carry
    for instance_type in ("trn1.32xlarge", "inf2.48xlarge"):
        topology = catalog.resolve(instance_type).topology
        seconds, decisions, states = args.seconds, args.decisions, args.states
        cold = measure(topology, seconds, True, states, decisions=decisions)
        fleet = measure(topology, seconds, False, min(states, 2_000), decisions=decisions)
        demand = measure(topology, seconds, True, states, builtin_demand(), decisions)
        print(
            f"{instance_type:14} ({topology.kind.value}, {topology.devices} devices): "
            f"cold median {statistics.median(cold):,.0f} best {max(cold):,.0f} decisions/s; "
            f"fleet (cached) median {statistics.median(fleet):,.0f} decisions/s; "
            f"by demand, cold median {statistics.median(demand):,.0f} "
            f"best {max(demand):,.0f} decisions/s"
        )


if __name__ == "__main__":
    main()
