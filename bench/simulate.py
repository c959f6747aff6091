"""`simulate` at scale: 5,000 nodes and at least 100,000 pod events (arrivals and departures).

Target (issue 2): under 60 s. Runs the same Simulation the CLI runs; prints wall time, the
placement outcome and peak RSS. Run: uv run python bench/simulate.py [--nodes 5000 --events 100000]
"""

from __future__ import annotations

import argparse
import platform
import resource
import time

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.sim.simulation import NodeSpec, Simulation
from neuron_scheduler.sim.workloads import generate_workload

MIX = [
    ("inf1.6xlarge", 0.10),
    ("inf1.24xlarge", 0.05),
    ("inf2.24xlarge", 0.15),
    ("inf2.48xlarge", 0.20),
    ("trn1.32xlarge", 0.25),
    ("trn2.48xlarge", 0.25),
]


def fleet(nodes: int) -> list[NodeSpec]:
    specs: list[NodeSpec] = []
    for instance_type, share in MIX:
        count = round(nodes * share)
        specs.extend(NodeSpec(f"{instance_type}-{i}", instance_type) for i in range(count))
    return specs[:nodes]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=5_000)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--policy", choices=[p.value for p in Policy], default="best-fit")
    args = parser.parse_args()
    specs = fleet(args.nodes)
    # Lifetimes sized so the fleet runs near full: arrivals outpace departures at times.
    lifetime = args.nodes * 4.0
    # Each pod is two events: its arrival and, once placed and run, its departure.
    events = generate_workload(pods=args.events // 2, seed=1, mean_lifetime=lifetime)
    start = time.perf_counter()
    result = Simulation(specs, Catalog.builtin(), Policy(args.policy)).run(events)
    elapsed = time.perf_counter() - start
    handled = result.arrivals + result.departed
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"machine: {platform.machine()}, Python {platform.python_version()}")
    print(
        f"{len(specs)} nodes, {handled} events ({result.arrivals} arrivals, "
        f"{result.departed} departures), "
        f"policy {args.policy}: {elapsed:.1f} s wall, {handled / elapsed:,.0f} events/s, "
        f"peak RSS {rss:.0f} MB"
    )
    print(
        f"placed {result.placed}, pending at end {len(result.pending)}, "
        f"mean devices in use {100 * result.mean_device_utilization:.1f}%, "
        f"fragmentation at end {100 * result.fragmentation:.1f}%"
    )


if __name__ == "__main__":
    main()
