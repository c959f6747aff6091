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
- DRA (issues 20, 42): our DRA driver's published devices under the scheduler's own DRA
  allocator (first fit in our order; `dra/firstfit.py`): with device sets only, a k-core request
  taking the devices that hold k cores (issue 20); with core windows (the driver's default
  sizes; a larger core request asks for devices), under kube-scheduler's default profile
  without the extender, under a packing profile (MostAllocated over cpu and memory) without it,
  and with our prioritize-claims entries as the chart sets them (`dra/scoring.py`: the best-fit
  measure at the extender's weight, how full the node is at weight 1); and the bound of
  republishing the order as a node fills (first fit equal to the node's best fit);
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

from fleet import standard_pods
from neuron_scheduler.core.allocation import (
    Decision,
    NodeState,
    Placement,
    Policy,
    Refusal,
    allocate,
    placement_score,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import DemandWeights
from neuron_scheduler.core.ids import ids_mask
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra import DEFAULT_CORE_WINDOWS
from neuron_scheduler.dra.firstfit import allocate_like_scheduler, published_for
from neuron_scheduler.dra.scoring import scored_decision
from neuron_scheduler.dra.shapes import core_window_counts
from neuron_scheduler.sim.consolidation import ConsolidationLimits, consolidating
from neuron_scheduler.sim.contenders import (
    CLAIRVOYANT,
    FIRST_FIT,
    NEURON_SCHEDULER,
    NO_TOPOLOGY,
    Contender,
)
from neuron_scheduler.sim.kubescheduler import (
    DEFAULT_FILTER_ONLY,
    DEFAULT_WITH_PRIORITIZE,
    FitStrategy,
    Profile,
)
from neuron_scheduler.sim.simulation import SimResult
from neuron_scheduler.sim.workloads import STANDARD

# Core windows the DRA contenders' driver publishes (--core-windows; the driver's default).
CORE_WINDOWS = [DEFAULT_CORE_WINDOWS]


def as_published(
    request: NeuronRequest, topology: Topology, core_windows: tuple[int, ...]
) -> NeuronRequest:
    """What a DRA user asks for: a core claim when the driver publishes windows of that many
    cores; else the smaller of the next window published and the devices that hold the cores
    (`neuron-N`, as DRA users did before core claims; on a torus, the next group size)."""
    if request.unit is not Unit.CORE or request.count in core_windows:
        return request
    per_device = topology.cores_per_device
    devices = -(-request.count // per_device)
    allowed = topology.allowed_device_counts
    if allowed is not None:
        devices = min((n for n in allowed if n >= devices), default=devices)
    larger = [c for c in core_windows if c > request.count and c <= topology.total_cores]
    if larger and larger[0] <= devices * per_device:
        return NeuronRequest(NEURONCORE, larger[0])
    return NeuronRequest(NEURON, devices)


def dra_devices_only(
    topology: Topology,
    state: NodeState,
    request: NeuronRequest,
    policy: Policy,
    demand: DemandWeights,
) -> Decision:
    """DRA before core claims (issue 20): a k-core request takes the devices holding k cores."""
    del policy, demand  # the scheduler's DRA allocator has one way: first fit
    return allocate_like_scheduler(topology, state, as_published(request, topology, ()))


def dra_first_fit(
    topology: Topology,
    state: NodeState,
    request: NeuronRequest,
    policy: Policy,
    demand: DemandWeights,
) -> Decision:
    """DRA as built: device sets and core windows (the driver's default sizes), first fit in our
    order, and the node score our prioritize gives it (used only where the profile calls it).
    With the BEST_FIT policy, the bound of republishing the order as a node fills (issue 42):
    the driver, knowing only its node, puts its best fit's pick first for every class, so first
    fit is best fit (without the cluster's demand, which the driver does not see)."""
    windows = CORE_WINDOWS[0]
    request = as_published(request, topology, windows)
    if policy is not Policy.BEST_FIT:
        return scored_decision(topology, state, request, windows, demand)
    return republished(topology, state, request, demand, by_demand=False)


def republished(
    topology: Topology,
    state: NodeState,
    request: NeuronRequest,
    demand: DemandWeights,
    *,
    by_demand: bool,
) -> Decision:
    """The device an order republished after every change puts first: the node's best fit
    (weighed by the cluster's demand with `by_demand`), scored as our prioritize scores it."""
    if not published_for(topology, request.unit, request.count, CORE_WINDOWS[0]):
        return Refusal("not published", True)
    decision = allocate(topology, state, request, Policy.BEST_FIT, demand if by_demand else ())
    if not isinstance(decision, Placement):
        return decision
    taken = ids_mask(decision.cores)
    score = placement_score(topology, state, request.unit, taken, Policy.BEST_FIT, demand)
    return decision._replace(score=score)


# The cluster's own kube-scheduler (default profile) with our prioritize entries for pods with
# our claims, as the chart adds them: prioritize-claims at its weight
# (scheduler.scoring.extenderWeight) and prioritize-claims-packing at 1 (scoring.packNeuron).
DRA_PRIORITIZE = Profile(
    "kube-scheduler defaults, DRA prioritize entries as the chart sets them",
    extender_weight=20,
    packing_weight=1,
)
DRA_LABEL = "DRA + our prioritize"
# Without the extender, the closest kube-scheduler's own scores come to packing: NodeResourcesFit
# MostAllocated over cpu and memory (pods count as their requests, or 100m and 200Mi), blind to
# devices (docs/dra.md "Node choice").
DRA_PACKING = Profile(
    "kube-scheduler, MostAllocated over cpu and memory, no extender",
    fit_strategy=FitStrategy.MOST_ALLOCATED,
    balanced_weight=0,
    extender_prioritizes=False,
)


LOADS = {"overload": 1.2, "busy": 0.85}
CONTENDERS = (
    NEURON_SCHEDULER,
    Contender("neuron-scheduler, default profile", profile=DEFAULT_WITH_PRIORITIZE),
    FIRST_FIT,
    Contender(
        "DRA, device sets only (issue 20)", Policy.FIRST_FIT, DEFAULT_FILTER_ONLY, dra_devices_only
    ),
    Contender("DRA", Policy.FIRST_FIT, DEFAULT_FILTER_ONLY, dra_first_fit),
    Contender("DRA, packing profile", Policy.FIRST_FIT, DRA_PACKING, dra_first_fit),
    Contender(DRA_LABEL, Policy.FIRST_FIT, DRA_PRIORITIZE, dra_first_fit),
    Contender(f"{DRA_LABEL}, order republished", Policy.BEST_FIT, DRA_PRIORITIZE, dra_first_fit),
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


def run_all(
    seeds: int, contenders: tuple[Contender, ...] = CONTENDERS, first_seed: int = 1
) -> dict[str, dict[str, dict[str, Runs]]]:
    catalog = Catalog.builtin()
    table: dict[str, dict[str, dict[str, Runs]]] = {}
    for name, standard in STANDARD.items():
        for load_name, load in LOADS.items():
            workload = standard.at_load(load, catalog)
            per = table.setdefault(name, {}).setdefault(load_name, {})
            for seed in range(first_seed, first_seed + seeds):
                events = workload.events(seed)
                for contender in contenders:
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


def print_dra_targets(table: dict[str, dict[str, dict[str, Runs]]]) -> None:
    """Issue 42's targets: each DRA row against neuron-scheduler's, pods placed (within 2%) and
    utilization at the first fragmentation refusal (within 3 points), the latter also seed by
    seed (the same pods, so the noise of the pods cancels; mean and 95% interval)."""
    ours = NEURON_SCHEDULER.label
    print(
        "\n| workload | load | DRA row | pods placed vs neuron-scheduler "
        "| util. at 1st frag. refusal vs neuron-scheduler, seed by seed |"
    )
    print("|---|---|---|---|---|")
    for name, loads in table.items():
        for load_name, per in loads.items():
            if ours not in per:
                continue
            for label, runs in per.items():
                if not label.startswith("DRA"):
                    continue
                placed = runs.mean("placed") / per[ours].mean("placed") - 1
                gaps = [
                    _value(a, "frag_util") - _value(b, "frag_util")
                    for a, b in zip(runs.results, per[ours].results, strict=True)
                ]
                mean = statistics.fmean(gaps)
                margin = 1.96 * statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else 0
                print(
                    f"| {name} | {LOADS[load_name]:.2f} {load_name} | {label} | {placed:+.1%} "
                    f"| {100 * mean:+.1f} ±{100 * margin:.1f} points |"
                )


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
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument(
        "--core-windows",
        default=",".join(map(str, DEFAULT_CORE_WINDOWS)),
        help="the counts of core windows the DRA contenders' driver publishes (other core "
        "requests ask for the next window or the devices holding their cores)",
    )
    parser.add_argument(
        "--consolidation", action="store_true", help="the consolidation table only (issue 33)"
    )
    parser.add_argument(
        "--only",
        default="",
        help="run only the contenders whose label contains one of these comma-separated words "
        "(first-fit and the no-topology bound always run: the table is relative to them)",
    )
    parser.add_argument(
        "--pods",
        type=int,
        help="pods a seed in each standard workload (default: as committed; a few: a smoke run)",
    )
    args = parser.parse_args()
    standard_pods(args.pods)
    CORE_WINDOWS[0] = core_window_counts(int(c) for c in args.core_windows.split(",") if c)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.machine()}, Python {platform.python_version()}")
    print(f"DRA: core windows of {args.core_windows or 'no'} cores")
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
    words = [w for w in args.only.split(",") if w]
    contenders = tuple(
        c
        for c in CONTENDERS
        if not words or c in (FIRST_FIT, NO_TOPOLOGY) or any(w in c.label for w in words)
    )
    start = time.perf_counter()
    table = run_all(args.seeds, contenders, args.first_seed)
    elapsed = time.perf_counter() - start
    print(f"seeds {args.first_seed}-{args.first_seed + args.seeds - 1}, {elapsed:.0f} s\n")
    rows = print_table(table)
    print_dra_targets(table)
    (args.out / "quality.json").write_text(json.dumps(rows, indent=1))
    for path in draw(table, args.out):
        print(f"picture: {path}")


if __name__ == "__main__":
    main()
