"""What the preempt verb costs kube-scheduler for a member of a training job (review of issue 40).

kube-scheduler calls the verb for every member of a waiting job it tries to place while nodes are
full, with every candidate node and its own victims on each. Before the review the verb worked
out the whole job's preemption on each call (only to decide whether to record an ask; the
reservation loop then worked it out again); now it records the ask, and the loop works the plan
out once per step (a burst of asks is one step). Measured in one process, in memory (no HTTP):
per call, the verb answering a member of a 64-member job of priority 1000 on N UltraServers full
of 4-member jobs of priority 10, kube-scheduler sending every node with one victim; and what
working out the plan costs (`preemption_for`), which the loop pays once per step.

Run: uv run python bench/preempt_verb.py [--units 25 100] [--calls 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time

import fleet  # noqa: F401  (the checkout on sys.path: tests/)
from neuron_scheduler.extender.state.members import preemption_for
from neuron_scheduler.extender.verbs.wire import ExtenderPreemptionArgs, MetaPod, MetaVictims
from neuron_scheduler.jobs.members import member_of
from tests.builders import node
from tests.unit.test_reserving import PREFIX, World


def world(units: int) -> tuple[World, list[str]]:
    """N UltraServers, each running a 4-member job of priority 10; a 64-member job of priority
    1000 waiting (the unit tests' world: the verb and the loop on one Ledger and Occupancy)."""
    found = World(units=0)
    nodes = []
    for k in range(units):
        labels = {PREFIX + "mode": "1_2_4", PREFIX + "server-id-4": f"{k:016x}"}
        nodes += [node(f"u{k}-{i}", "trn2u.48xlarge", labels=labels) for i in range(4)]
    for view in (found.ledger, found.occupancy):
        view.replace_nodes(nodes)
    for k in range(units):
        for i, pod in enumerate(
            found.job(f"low{k}", 4, priority=10, started="2026-01-01T00:00:00Z")
        ):
            found.bind(pod, f"u{k}-{i}")
    found.job("big", 64, priority=1000)
    return found, [n.metadata.name for n in nodes]


async def per_call(units: int, calls: int) -> tuple[float, float]:
    """Median seconds per preempt call, and per plan worked out."""
    found, names = world(units)
    ledger, occupancy, verb, pod = found.ledger, found.occupancy, found.verb, found.pods["big-0"]
    args = ExtenderPreemptionArgs(
        Pod=pod,
        NodeNameToMetaVictims={
            n: MetaVictims([MetaPod(f"low{k}-{i}")])
            for n in names
            for k, i in [map(int, n[1:].split("-"))]
        },
    )
    times = []
    for _ in range(calls):
        occupancy.preemption_asks.clear()
        start = time.perf_counter()
        await verb.preempt(args)
        times.append(time.perf_counter() - start)
    assert occupancy.preemption_asks, "the verb recorded no ask"
    member = member_of(pod)
    assert member is not None
    plans = []
    for _ in range(calls):
        start = time.perf_counter()
        preemption_for(ledger, occupancy, pod, member, 4, found.now)
        plans.append(time.perf_counter() - start)
    return statistics.median(times), statistics.median(plans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--units", type=int, nargs="+", default=[25, 100])
    parser.add_argument("--calls", type=int, default=50)
    options = parser.parse_args()
    machine = platform.processor() or platform.machine()
    print(f"# {platform.node()} {machine}, {os.cpu_count()} cpus")
    print(f"# python {sys.version.split()[0]}, {options.calls} calls each, median")
    print("| UltraServers | nodes | ms per preempt call | ms per plan worked out |")
    print("|---|---|---|---|")
    for units in options.units:
        call, plan = asyncio.run(per_call(units, options.calls))
        print(f"| {units} | {units * 4} | {call * 1000:.2f} | {plan * 1000:.2f} |")


if __name__ == "__main__":
    main()
