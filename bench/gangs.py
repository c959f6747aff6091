"""Training jobs on a Trn2 UltraServer fleet under the rules of sim/gangs.py (issues 32 and 40):
member by member (the extender before issue 32), all or nothing (issue 32), all or nothing with
the oldest job holding units, pod affinity alone (no extender rule), all or nothing with the
docs' priority advice and kube-scheduler's preemption as it was, job-level preemption (issue 40),
and one reservation with backfill. The model is sim/gangs.py (pure, seeded).

Per rule, means over seeds with a 95% interval: jobs started, mean and p95 job wait (time spent
waiting, in all, before its last start; a job not started by the end counts as waiting to the
end), the mean and p95 wait of each size, node-hours that nodes were bound, reserved or held for
a job that could not run yet (idle), node-hours of work preempted jobs and pods had done (lost),
UltraServers that held members of two jobs at once (must be 0), single-node pods started.

Run: uv run python bench/gangs.py [--seeds 20] [--loads 0.8 1.0] [--ultraservers 8]
     [--rules gangs preempt ...] [--declared-slack 1.0] [--declared-share 1.0]
     [--priorities 16:2,8:1,4:0]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

from fleet import ROOT  # noqa: F401  (puts the checkout on sys.path)
from neuron_scheduler.sim.gangs import PRIORITY, RULES, GangResult, GangWorkload, run


def interval(values: list[float]) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.1f}"
    half = 1.96 * statistics.stdev(values) / len(values) ** 0.5
    return f"{mean:.1f} ±{half:.1f}"


def by_size(results: list[GangResult], p95: bool = False) -> str:
    """The mean over seeds of each size's mean (or p95) wait."""
    sizes = sorted({s for r in results for s in r.wait_by_size_h})
    means = []
    for size in sizes:
        waits = [(r.p95_by_size_h if p95 else r.wait_by_size_h).get(size) for r in results]
        means.append(statistics.fmean(w for w in waits if w is not None))
    return " / ".join(f"{m:.1f}" for m in means)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.8, 1.0])
    parser.add_argument("--ultraservers", type=int, default=8)
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    parser.add_argument("--declared-slack", type=float, default=1.0)
    parser.add_argument("--declared-share", type=float, default=1.0)
    parser.add_argument(
        "--priorities",
        default=",".join(f"{size}:{value}" for size, value in PRIORITY),
        help="size:priority of jobs under gangs-priority and preempt (other sizes: 0)",
    )
    args = parser.parse_args()
    try:
        priorities = tuple(
            (int(size), int(value))
            for size, value in (pair.split(":") for pair in args.priorities.split(","))
        )
    except ValueError:
        parser.error(f"--priorities {args.priorities!r}: give size:priority pairs, e.g. 16:1,8:0")
    if args.seeds < 2 or args.ultraservers < 1 or args.days <= 0 or min(args.loads) <= 0:
        parser.error("--seeds >= 2, --ultraservers >= 1, --days > 0 and loads > 0")
    if args.declared_slack < 0 or not 0 <= args.declared_share <= 1:
        parser.error("--declared-slack >= 0 and --declared-share from 0 to 1")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; {args.ultraservers} UltraServers "
        f"({args.ultraservers * 4} trn2u nodes), {args.days:g} days, seeds 1-{args.seeds}"
    )
    print(
        "jobs of 4/8/16 members (50/30/20%), mean 3 h; single-node pods 30% of the offered "
        "node-hours, mean 1 h; declared run times: lifetime x U(1, "
        f"{1 + args.declared_slack:g}), declared by {100 * args.declared_share:g}%; priorities "
        f"(gangs-priority, preempt) {args.priorities}\n"
    )
    print(
        "| load | rule | jobs | started | mean wait h | p95 wait h | mean wait h of 4 / 8 / 16 "
        "| p95 wait h of 4 / 8 / 16 | idle node-hours | node-hours lost to preemption "
        "| shared UltraServers | single pods started |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for load in args.loads:
        workload = GangWorkload(
            ultraservers=args.ultraservers,
            hours=24 * args.days,
            load=load,
            declared_slack=args.declared_slack,
            declared_share=args.declared_share,
            priorities=priorities,
        )
        for rule in args.rules:
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
                f"| {by_size(results, p95=True)} "
                f"| {interval([r.idle_node_hours for r in results])} "
                f"| {interval([r.lost_node_hours for r in results])} "
                f"| {max(r.shared_units for r in results)} "
                f"| {interval([100 * r.singles_started / max(r.singles, 1) for r in results])}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
