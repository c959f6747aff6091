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

Topology mode (issue 47), the model of sim/networkgangs.py: jobs of 2-32 whole trn1 nodes, all
or nothing, on a fleet in layer-3 network domains of 16-32 nodes, placed with no closeness, by
first-fit over domains, by the extender's rule (jobs/network.py), or by that rule with a bounded
wait for one domain (measured, not built). Per rule and load, means over seeds with a 95%
interval: mean and p95 wait, per job size, layer-3 domains a started job spans, the share of the
jobs one layer-3 domain could hold that got one (in all and per size), idle node-hours.

Run: uv run python bench/gangs.py --topology [--seeds 5] [--loads 0.6 0.7 0.8 0.9 1.0]
     [--nodes 384] [--days 7] [--patience 0.5] [--max-job 32]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from collections.abc import Iterable

from fleet import ROOT  # noqa: F401  (puts the checkout on sys.path)
from neuron_scheduler.sim import networkgangs
from neuron_scheduler.sim.gangs import PRIORITY, RULES, GangResult, GangWorkload, run


def interval(values: list[float], digits: int = 1) -> str:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    half = 1.96 * statistics.stdev(values) / len(values) ** 0.5
    return f"{mean:.{digits}f} ±{half:.{digits}f}"


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
    parser.add_argument("--topology", action="store_true", help="the network-domain model")
    parser.add_argument("--nodes", type=int, default=384, help="--topology: trn1 nodes")
    parser.add_argument("--patience", type=float, default=0.5, help="--topology: hours")
    parser.add_argument("--max-job", type=int, default=32, help="--topology: largest job")
    if "--topology" in sys.argv:
        return topology(parser)
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


def topology(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9, 1.0])
    parser.add_argument("--days", type=float, default=7.0)
    parser.add_argument(
        "--rules", nargs="+", default=list(networkgangs.RULES), choices=networkgangs.RULES
    )
    args = parser.parse_args()
    if args.seeds < 2 or args.nodes < 16 or args.days <= 0 or min(args.loads) <= 0:
        parser.error("--seeds >= 2, --nodes >= 16, --days > 0 and loads > 0")
    base = networkgangs.NetworkWorkload()
    sizes = tuple((s, w) for s, w in base.job_sizes if s <= args.max_job)
    if not sizes:
        parser.error(f"--max-job {args.max_job}: no job size left (sizes 2, 4, 8, 16, 32)")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}; {args.nodes} trn1 nodes in layer-3 domains of "
        f"{'/'.join(map(str, base.domain_sizes))} (drawn per seed), {base.domains_per_layer2} to a "
        f"layer-2 domain; {args.days:g} days, seeds 1-{args.seeds}"
    )
    shares = ", ".join(f"{s}: {100 * w / sum(w for _, w in sizes):.0f}%" for s, w in sizes)
    print(
        f"jobs of whole nodes, sizes {shares}; mean 3 h; closest-wait waits up to "
        f"{args.patience:g} h for one domain\n"
    )
    shown = "/".join(str(s) for s, _ in sizes)
    print(
        f"| load | rule | jobs | mean wait h | p95 wait h | mean wait h of {shown} "
        f"| p95 wait h of {shown} | layer-3 domains per job | in one domain (of those one "
        f"could hold) | in one domain, of {shown} | idle node-hours |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for load in args.loads:
        workload = networkgangs.NetworkWorkload(
            nodes=args.nodes,
            hours=24 * args.days,
            load=load,
            job_sizes=sizes,
            patience_h=args.patience,
        )
        for rule in args.rules:
            results = [networkgangs.run(workload, rule, seed) for seed in range(1, args.seeds + 1)]
            one = " / ".join(
                f"{100 * statistics.fmean(r.one_domain_by_size.get(s, 1.0) for r in results):.0f}"
                for s, _ in sizes
            )
            print(
                f"| {load:g} | {rule} "
                f"| {statistics.fmean(r.jobs for r in results):.0f} "
                f"| {interval([r.mean_wait_h for r in results], 3)} "
                f"| {interval([r.p95_wait_h for r in results], 2)} "
                f"| {sized(r.wait_by_size_h for r in results)} "
                f"| {sized(r.p95_by_size_h for r in results)} "
                f"| {interval([r.mean_domains for r in results], 2)} "
                f"| {interval([100 * r.one_domain_share for r in results])}% "
                f"| {one} "
                f"| {interval([r.idle_node_hours for r in results], 0)} |",
                flush=True,
            )


def sized(per_seed: Iterable[dict[int, float]]) -> str:
    """The mean over seeds of each size's figure."""
    found: dict[int, list[float]] = {}
    for figures in per_seed:
        for size, value in figures.items():
            found.setdefault(size, []).append(value)
    return " / ".join(f"{statistics.fmean(v):.2f}" for _, v in sorted(found.items()))


if __name__ == "__main__":
    main()
