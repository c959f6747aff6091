"""Placement quality on the standard workloads: neuron-scheduler against first-fit and the
no-topology bound (issue 16).

Every run goes through the simulator's model of kube-scheduler (sim/kubescheduler.py): its
resource-count filter, the profile's scores plus the extender's, its random tie-break, and its
queue (pending pods are retried, highest priority then oldest first, when a pod leaves).

Contenders:
- neuron-scheduler: best-fit allocator and prioritize, under the chart's my-scheduler profile;
- neuron-scheduler, default profile: the same extender under kube-scheduler's default scoring
  (LeastAllocated on cpu/memory, extender weight 1): what default-scheduler mode gets without
  the documented snippet;
- first-fit: a topology-aware extender that filters and binds only, lowest devices first (AWS's
  extension), under kube-scheduler's defaults;
- DRA: our DRA driver's published devices under the scheduler's own DRA allocator (first fit
  in our order, no scoring; `dra/firstfit.py`) and kube-scheduler's default profile, no extender
  (issue 20). DRA hands out whole devices: a k-core request takes the devices that hold k cores;
- no-topology bound: counts only, contiguity ignored;
- clairvoyant: neuron-scheduler that knows when each pod will leave (sim/clairvoyant.py), no
  real scheduler: how much of what is left knowing lifetimes would buy.

Each workload (sim/workloads.py, committed seeded generators) runs at two offered loads:
- overload (1.2x the fleet's devices): the queue never drains; pods placed and utilization at the
  first fragmentation refusal are measured here;
- busy (0.85x): queues form in bursts and drain; large-pod waits are measured here (under
  sustained overload every wait grows with the length of the run, whatever the policy).

Run: uv run python bench/quality.py [--seeds 40] [--out bench/out/quality]
Prints a markdown table (BENCHMARKS.md "Placement quality") and writes quality.json plus two
pictures per load: utilization over time per policy, and the CDF of large-pod waits.

--consolidation (issue 33) runs the consolidation table instead (BENCHMARKS.md "Consolidation"):
the standard workloads whose small pods (one device, up to two cores) are long-lived replicas of
controllers (`Workload.with_services`, 10x the others' lifetime), neuron-scheduler without
consolidation against consolidation at the chart's defaults and at one bound changed per row
(sim/consolidation.py). Columns: large-pod mean and p95 wait, pods placed, pods moved
(evictions), pods unblocked (placed by a plan), evictions per pod unblocked, evicted for nothing.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from neuron_scheduler.core.allocation import Decision, NodeState, Policy
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import DemandWeights
from neuron_scheduler.core.resources import NEURON, NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra.firstfit import allocate_like_scheduler
from neuron_scheduler.sim.consolidation import ConsolidationLimits, consolidating
from neuron_scheduler.sim.contenders import (
    CLAIRVOYANT,
    FIRST_FIT,
    NEURON_SCHEDULER,
    NO_TOPOLOGY,
    Contender,
)
from neuron_scheduler.sim.kubescheduler import DEFAULT_FILTER_ONLY, DEFAULT_WITH_PRIORITIZE
from neuron_scheduler.sim.simulation import SimResult
from neuron_scheduler.sim.workloads import STANDARD


def dra_allocator(
    topology: Topology,
    state: NodeState,
    request: NeuronRequest,
    policy: Policy,
    demand: DemandWeights,
) -> Decision:
    del policy, demand  # the scheduler's DRA allocator has one way: first fit
    if request.unit is Unit.CORE:
        request = NeuronRequest(NEURON, -(-request.count // topology.cores_per_device))
    return allocate_like_scheduler(topology, state, request)


LOADS = {"overload": 1.2, "busy": 0.85}
CONTENDERS = (
    NEURON_SCHEDULER,
    Contender("neuron-scheduler, default profile", profile=DEFAULT_WITH_PRIORITIZE),
    FIRST_FIT,
    Contender("DRA", Policy.FIRST_FIT, DEFAULT_FILTER_ONLY, dra_allocator),
    NO_TOPOLOGY,
    CLAIRVOYANT,
)
BOUND = NO_TOPOLOGY.label


@dataclass
class Runs:
    """One contender on one workload at one load, over the seeds."""

    results: list[SimResult] = field(default_factory=list)

    def mean(self, value: str) -> float:
        return statistics.fmean(_value(r, value) for r in self.results)

    def median(self, value: str) -> float:
        return statistics.median(_value(r, value) for r in self.results)

    def margin(self, value: str) -> float:
        """Half-width of the mean's 95% confidence interval (normal approximation): two rows
        whose intervals overlap are not told apart by this many seeds."""
        values = [_value(r, value) for r in self.results]
        if len(values) < 2:
            return float("nan")
        return 1.96 * statistics.stdev(values) / len(values) ** 0.5

    def large_waits(self) -> list[float]:
        return sorted(w for r in self.results for w in r.large_waits + r.large_pending_waits)


def _value(result: SimResult, value: str) -> float:
    if value == "placed":
        return result.placed
    if value == "frag_util":
        # Never refused for fragmentation: the fleet ran full first.
        first = result.utilization_at_first_fragmentation
        return 1.0 if first is None else first
    if value == "mean_util":
        return result.mean_device_utilization
    if value == "large_wait_mean":
        return result.large_wait_mean()
    if value == "large_wait_p95":
        return result.large_wait_p95()
    if value == "frag_refusals":
        return result.fragmentation_refusals
    raise ValueError(value)


def run_all(seeds: int) -> dict[str, dict[str, dict[str, Runs]]]:
    catalog = Catalog.builtin()
    table: dict[str, dict[str, dict[str, Runs]]] = {}
    for name, standard in STANDARD.items():
        for load_name, load in LOADS.items():
            workload = standard.at_load(load, catalog)
            per = table.setdefault(name, {}).setdefault(load_name, {})
            for seed in range(1, seeds + 1):
                events = workload.events(seed)
                for contender in CONTENDERS:
                    result = contender.run(workload.nodes(), catalog, events, seed)
                    per.setdefault(contender.label, Runs()).results.append(result)
    return table


def print_table(table: dict[str, dict[str, dict[str, Runs]]]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    print(
        "| workload | load | policy | pods placed | % of bound | vs first-fit "
        "| util. at 1st frag. refusal, mean ±95% (median) | mean util. "
        "| large wait mean (x first-fit) "
        "| large wait p95 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, loads in table.items():
        for load_name, per in loads.items():
            bound = per[BOUND].mean("placed")
            first = per[FIRST_FIT.label]
            for label, runs in per.items():
                wait = runs.mean("large_wait_mean")
                first_wait = first.mean("large_wait_mean")
                row = {
                    "workload": name,
                    "load": load_name,
                    "policy": label,
                    "placed": runs.mean("placed"),
                    "of_bound": runs.mean("placed") / bound,
                    "vs_first_fit": runs.mean("placed") / first.mean("placed") - 1,
                    "frag_util": runs.mean("frag_util"),
                    "frag_util_margin": runs.margin("frag_util"),
                    "frag_util_median": runs.median("frag_util"),
                    "mean_util": runs.mean("mean_util"),
                    "large_wait_mean": wait,
                    "large_wait_vs_first_fit": wait / first_wait if first_wait else 1.0,
                    "large_wait_p95": runs.mean("large_wait_p95"),
                    "frag_refusals": runs.mean("frag_refusals"),
                    "invalid_placements": sum(r.invalid_placements for r in runs.results),
                }
                rows.append(row)
                print(
                    f"| {name} | {LOADS[load_name]:.2f} {load_name} | {label} "
                    f"| {row['placed']:.1f} | {row['of_bound']:.1%} "
                    f"| {row['vs_first_fit']:+.1%} | {row['frag_util']:.1%} "
                    f"±{100 * row['frag_util_margin']:.1f} ({row['frag_util_median']:.1%}) "
                    f"| {row['mean_util']:.1%} | {wait:.0f} s "
                    f"({row['large_wait_vs_first_fit']:.2f}) | {row['large_wait_p95']:.0f} s |"
                )
    return rows


def draw(table: dict[str, dict[str, dict[str, Runs]]], out: Path) -> list[Path]:
    written = []
    for load_name in LOADS:
        fig, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4), squeeze=False)
        for ax, (name, loads) in zip(axes[0], table.items(), strict=True):
            for label, runs in loads[load_name].items():
                first = runs.results[0]  # seed 1: one run's curve, not a blur of five
                ax.plot(
                    [s.time for s in first.samples],
                    [s.device_utilization * 100 for s in first.samples],
                    label=label,
                    linewidth=1,
                )
            ax.set_title(f"{name}, load {LOADS[load_name]} (seed 1)")
            ax.set_xlabel("time (s)")
            ax.set_ylabel("devices in use (%)")
            ax.set_ylim(0, 101)
        axes[0][0].legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        path = out / f"utilization-{load_name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)

        fig, axes = plt.subplots(1, len(table), figsize=(6 * len(table), 4), squeeze=False)
        for ax, (name, loads) in zip(axes[0], table.items(), strict=True):
            for label, runs in loads[load_name].items():
                waits = runs.large_waits()
                if waits:
                    ax.step(waits, [(i + 1) / len(waits) for i in range(len(waits))], label=label)
            ax.set_title(f"{name}, load {LOADS[load_name]}: large-pod wait (all seeds)")
            ax.set_xlabel("wait (s)")
            ax.set_ylabel("share of large pods")
            ax.set_xscale("symlog", linthresh=1)
        axes[0][0].legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        path = out / f"large-wait-cdf-{load_name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


SERVICES = 10.0  # small pods live this many times longer than the others
DEFAULTS = ConsolidationLimits()  # the chart's scheduler.consolidation
CONSOLIDATION = (
    NEURON_SCHEDULER,
    Contender("consolidation, defaults", simulation=consolidating(DEFAULTS)),
    *(
        Contender(f"consolidation, {label}", simulation=consolidating(limits))
        for label, limits in (
            ("pending 10 s", ConsolidationLimits(pending_seconds=10)),
            ("pending 120 s", ConsolidationLimits(pending_seconds=120)),
            ("10 evictions/h", ConsolidationLimits(evictions_per_hour=10)),
            ("120 evictions/h", ConsolidationLimits(evictions_per_hour=120)),
            ("no node cooldown", ConsolidationLimits(node_cooldown=0)),
            ("node cooldown 600 s", ConsolidationLimits(node_cooldown=600)),
            ("at most 4 victims", ConsolidationLimits(max_victims=4)),
        )
    ),
)


def consolidation_table(seeds: int) -> list[dict[str, object]]:
    catalog = Catalog.builtin()
    rows: list[dict[str, object]] = []
    print(
        "| workload | load | policy | large wait mean | large wait p95 | pods placed "
        "| evictions | pods unblocked | evictions per pod unblocked | evicted for nothing |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for standard in STANDARD.values():
        services = standard.with_services(SERVICES)
        for load_name, load in LOADS.items():
            workload = services.at_load(load, catalog)
            per: dict[str, list[SimResult]] = {}
            for seed in range(1, seeds + 1):
                events = workload.events(seed)
                for contender in CONSOLIDATION:
                    result = contender.run(workload.nodes(), catalog, events, seed)
                    per.setdefault(contender.label, []).append(result)
            for label, results in per.items():
                moved = statistics.fmean(r.moved for r in results)
                unblocked = statistics.fmean(r.unblocked for r in results)
                row: dict[str, object] = {
                    "workload": services.name,
                    "load": load_name,
                    "policy": label,
                    "large_wait_mean": statistics.fmean(r.large_wait_mean() for r in results),
                    "large_wait_p95": statistics.fmean(r.large_wait_p95() for r in results),
                    "placed": statistics.fmean(r.placed for r in results),
                    "evictions": moved,
                    "unblocked": unblocked,
                    "evictions_per_unblocked": moved / unblocked if unblocked else 0.0,
                    "evicted_for_nothing": sum(r.moved_for_nothing for r in results),
                }
                rows.append(row)
                print(
                    f"| {services.name} | {load:.2f} {load_name} | {label} "
                    f"| {row['large_wait_mean']:.0f} s | {row['large_wait_p95']:.0f} s "
                    f"| {row['placed']:.1f} | {moved:.1f} | {unblocked:.1f} "
                    f"| {row['evictions_per_unblocked']:.2f} | {row['evicted_for_nothing']} |"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # The first fragmentation refusal is one event per run, and heavy-tailed: on mixed/busy, 10
    # seeds put two policy variants 4.5 points apart that 40 seeds could not tell apart, and 20
    # seeds read mixed/overload 1.5 points below what 40 read.
    parser.add_argument("--seeds", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("bench/out/quality"))
    parser.add_argument(
        "--consolidation", action="store_true", help="the consolidation table only (issue 33)"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()}, Python {platform.python_version()}")
    if args.consolidation:
        start = time.perf_counter()
        rows = consolidation_table(args.seeds)
        print(f"\n{args.seeds} seeds, {time.perf_counter() - start:.0f} s")
        (args.out / "consolidation.json").write_text(json.dumps(rows, indent=1))
        return
    catalog = Catalog.builtin()
    for name, standard in STANDARD.items():
        print(
            f"{name}: {len(standard.nodes())} nodes, {standard.pods} pods per seed; "
            f"{standard.description}; as committed, offered load "
            f"{standard.offered_load(catalog):.2f}"
        )
    start = time.perf_counter()
    table = run_all(args.seeds)
    elapsed = time.perf_counter() - start
    print(f"{args.seeds} seeds, {elapsed:.0f} s\n")
    rows = print_table(table)
    (args.out / "quality.json").write_text(json.dumps(rows, indent=1))
    for path in draw(table, args.out):
        print(f"picture: {path}")


if __name__ == "__main__":
    main()
