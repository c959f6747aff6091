"""Training jobs on a Trn2 UltraServer fleet under three rules (issue 32): member by member (the
extender before issue 32), all or nothing (now), and pod affinity alone (no extender rule).
The model is sim/gangs.py (pure, seeded).

Per rule, means over seeds with a 95% interval: jobs started, mean and p95 job wait (arrival to
all members bound; a job not started by the end counts as waiting to the end), node-hours that
nodes were bound or reserved for a job that could not run yet, UltraServers that held members of
two jobs at once (must be 0), single-node pods started.

Run: uv run python bench/gangs.py [--seeds 20] [--loads 0.8 1.0] [--ultraservers 8]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

from fleet import ROOT  # noqa: F401  (puts the checkout on sys.path)
from neuron_scheduler.sim.gangs import RULES, GangResult, GangWorkload, run


def interval(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.1f}"
    half = 1.96 * statistics.stdev(values) / len(values) ** 0.5
    return f"{mean:.1f} ±{half:.1f}"


def by_size(results: list[GangResult]) -> str:
    sizes = sorted({s for r in results for s in r.wait_by_size_h})
    return " / ".join(
        f"{statistics.fmean(r.wait_by_size_h[s] for r in results if s in r.wait_by_size_h):.1f}"
        for s in sizes
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.8, 1.0])
    parser.add_argument("--ultraservers", type=int, default=8)
    parser.add_argument("--days", type=float, default=7.0)
    args = parser.parse_args()
    if args.seeds < 2 or args.ultraservers < 1 or args.days <= 0 or min(args.loads) <= 0:
        parser.error("--seeds >= 2, --ultraservers >= 1, --days > 0 and loads > 0")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; {args.ultraservers} UltraServers "
        f"({args.ultraservers * 4} trn2u nodes), {args.days:g} days, seeds 1-{args.seeds}"
    )
    print(
        "jobs of 4/8/16 members (50/30/20%), mean 3 h; single-node pods 30% of the offered "
        "node-hours, mean 1 h\n"
    )
    print(
        "| load | rule | jobs | started | mean wait h | p95 wait h | mean wait h of 4 / 8 / 16 "
        "| idle node-hours | shared UltraServers | single pods started |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for load in args.loads:
        workload = GangWorkload(ultraservers=args.ultraservers, hours=24 * args.days, load=load)
        for rule in RULES:
            results: list[GangResult] = [
                run(workload, rule, seed) for seed in range(1, args.seeds + 1)
            ]
            print(
                f"| {load:g} | {rule} "
                f"| {statistics.fmean(r.jobs for r in results):.0f} "
                f"| {interval([r.started for r in results])} "
                f"| {interval([r.mean_wait_h for r in results])} "
                f"| {interval([r.p95_wait_h for r in results])} "
                f"| {by_size(results)} "
                f"| {interval([r.idle_node_hours for r in results])} "
                f"| {max(r.shared_units for r in results)} "
                f"| {interval([100 * r.singles_started / max(r.singles, 1) for r in results])}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
