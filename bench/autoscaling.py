"""What an autoscaler adds with consolidation and capacity requests (issue 41): the simulator with
an autoscaler that counts devices (sim/autoscaling.py), for four setups of neuron-scheduler:

- none: the autoscaler alone (it adds nodes for pods short of devices, never for a pod stranded
  by fragmentation, and removes the nodes it added once empty);
- consolidation only (sim/consolidation.py at the chart's defaults);
- capacity requests only (a node asked for a stranded pod after `pendingSeconds`);
- both (a node asked for only when consolidation has no plan it may carry out);

plus the capacity requests' wait (`pendingSeconds`) varied, with both on: 120 s, the chart's
default, was chosen from this table (BENCHMARKS.md "Autoscaling" says why).

Workloads: the standard ones with long-lived small pods (bench/quality.py --consolidation's), in
two kinds: the small pods are controllers' replicas (consolidation may move them), or bare pods
(nothing may move them: the case of aws/karpenter-provider-aws#7265). Loads: busy (0.85 of the
base fleet's devices) and overload (1.2). Columns: nodes added (of them at capacity requests),
node-hours the added nodes were up, large-pod (8+ devices) mean and p95 wait, pods moved.

Run: uv run python bench/autoscaling.py [--seeds 10] [--out bench/out/autoscaling]
Prints a markdown table (BENCHMARKS.md "Autoscaling") and writes autoscaling.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

from fleet import standard_pods
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.sim.autoscaling import AutoscalerLimits, autoscaled
from neuron_scheduler.sim.contenders import Contender
from neuron_scheduler.sim.simulation import SimResult
from neuron_scheduler.sim.workloads import STANDARD

SERVICES = 10.0  # small pods live this many times longer than the others (as --consolidation)
LOADS = {"busy": 0.85, "overload": 1.2}
SETUPS = {
    "none": AutoscalerLimits(),
    "consolidation only": AutoscalerLimits(consolidation=True),
    "capacity requests only, pending 60 s": AutoscalerLimits(
        capacity_requests=True, pending_seconds=60
    ),
    "both, pending 60 s": AutoscalerLimits(
        consolidation=True, capacity_requests=True, pending_seconds=60
    ),
    "both, pending 20 s": AutoscalerLimits(
        consolidation=True, capacity_requests=True, pending_seconds=20
    ),
    "both, pending 120 s (the default)": AutoscalerLimits(
        consolidation=True, capacity_requests=True, pending_seconds=120
    ),
}


def row(workload: str, load: str, setup: str, results: list[SimResult]) -> dict[str, object]:
    def mean(value: list[float]) -> float:
        return statistics.fmean(value)

    return {
        "workload": workload,
        "load": load,
        "setup": setup,
        "nodes_added": mean([r.nodes_added for r in results]),
        "capacity_requests": mean([r.capacity_requests for r in results]),
        "node_hours": mean([r.added_node_seconds / 3600 for r in results]),
        "large_wait_mean": mean([r.large_wait_mean() for r in results]),
        "large_wait_p95": mean([r.large_wait_p95() for r in results]),
        "moved": mean([r.moved for r in results]),
        "placed": mean([r.placed for r in results]),
    }


def table(seeds: int) -> list[dict[str, object]]:
    catalog = Catalog.builtin()
    rows = []
    print(
        "| workload | small pods | load | setup | nodes added (at capacity requests) "
        "| node-hours added | large wait mean | large wait p95 | pods moved |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for standard in STANDARD.values():
        services = standard.with_services(SERVICES)
        for load_name, load in LOADS.items():
            workload = services.at_load(load, catalog)
            for kind in ("replicas", "bare"):
                per: dict[str, list[SimResult]] = {}
                for seed in range(1, seeds + 1):
                    events = workload.events(seed)
                    if kind == "bare":
                        events = [replace(e, owned=False) for e in events]
                    for label, limits in SETUPS.items():
                        contender = Contender(label, simulation=autoscaled(limits))
                        result = contender.run(workload.nodes(), catalog, events, seed)
                        per.setdefault(label, []).append(result)
                for label, results in per.items():
                    r = row(standard.name, load_name, label, results)
                    r["small_pods"] = kind
                    rows.append(r)
                    print(
                        f"| {standard.name} | {kind} | {load:.2f} {load_name} | {label} "
                        f"| {r['nodes_added']:.1f} ({r['capacity_requests']:.1f}) "
                        f"| {r['node_hours']:.2f} | {r['large_wait_mean']:.0f} s "
                        f"| {r['large_wait_p95']:.0f} s | {r['moved']:.1f} |",
                        flush=True,
                    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench/out/autoscaling"))
    parser.add_argument(
        "--pods",
        type=int,
        help="pods a seed in each standard workload (default: as committed; a few: a smoke run)",
    )
    args = parser.parse_args()
    standard_pods(args.pods)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()}, Python {platform.python_version()}")
    limits = AutoscalerLimits()
    print(
        f"autoscaler: a node {limits.provision_seconds:.0f} s after it is asked for, removed "
        f"{limits.empty_seconds:.0f} s after it is empty, at most {limits.max_added} added; "
        f"capacity requests: at most {limits.max_in_flight} in flight\n"
    )
    start = time.perf_counter()
    rows = table(args.seeds)
    print(f"\n{args.seeds} seeds, {time.perf_counter() - start:.0f} s")
    (args.out / "autoscaling.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
