"""Preemption: pods evicted per preemptor placed, with and without the extender's preempt verb.

Two measurements (issue 18):
1. The real kube-scheduler v1.36.3 (tools/kube) on a testbed control plane, the world of the
   e2e test: a trn1.32xlarge of 16 one-device low-priority pods whose youngest sit one per row,
   and a high-priority 4-device pod. Per round: how many pods were evicted, and whether (and how
   fast) the preemptor was bound within --wait seconds. With the verb and without it.
2. The simulator on the default fleet, a seeded workload where a tenth of the pods are
   high-priority 4- and 8-device jobs: evictions, evictions that placed nothing, preemptors
   placed, for best-fit and first-fit, with and without the verb.

Run: uv run python bench/preemption.py [--rounds 3] [--wait 60] [--sim-only]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

from fleet import ROOT
from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NEURONCORE
from neuron_scheduler.sim.preemption import Preemption
from neuron_scheduler.sim.simulation import Simulation
from neuron_scheduler.sim.workloads import PodMix, default_fleet, generate_workload
from tests.e2e.harness import Scenario
from tests.e2e.preemption import row_world
from tests.testbed import ControlPlane, Stack, find_kubebin

MIX = (
    PodMix(NEURON, (1,), 6.0),
    PodMix(NEURONCORE, (1, 2), 3.0),
    PodMix(NEURON, (4, 8), 1.0, priority=1000),
)


def real_round(stack: Stack, verb: bool, wait: float) -> tuple[int, float | None]:
    """(pods evicted, seconds from creation to binding or None when not bound in time)."""
    stack.use_scheduler(True, preemption=verb)
    scenario = Scenario(stack)
    try:
        _, stand_in, _, high = row_world(scenario)
        start = time.monotonic()
        scenario.create_pod("big", {NEURON: 4}, priority_class=high)
        bound: float | None = None
        while time.monotonic() - start < wait:
            if scenario.pod("big")["spec"].get("nodeName"):
                bound = time.monotonic() - start
                break
            time.sleep(0.1)
        time.sleep(1.0)  # evictions still in flight are counted too
        return len(stand_in.finished), bound
    finally:
        scenario.cleanup()


def real(rounds: int, wait: float) -> None:
    with ControlPlane(find_kubebin(ROOT)) as cp:
        stack = Stack(cp)
        try:
            for verb in (True, False):
                label = "with the verb" if verb else "without the verb"
                for index in range(rounds):
                    evicted, bound = real_round(stack, verb, wait)
                    outcome = (
                        f"bound after {bound:.1f} s" if bound else f"pending after {wait:.0f} s"
                    )
                    print(f"real, {label}, round {index + 1}: {evicted} evicted, {outcome}")
        finally:
            stack.stop()


def simulated(pods: int, seed: int) -> None:
    catalog = Catalog.builtin()
    events = generate_workload(pods, seed, 1.0, 120.0, MIX)
    print(f"\nsimulator: default fleet, {pods} pods (seed {seed}), 10% high-priority 4/8-device")
    print(f"{'':22} {'placed':>7} {'by preemption':>14} {'evicted':>8} {'for nothing':>12}")
    for policy in (Policy.BEST_FIT, Policy.FIRST_FIT):
        for way in (Preemption.VERB, Preemption.COUNT):
            result = Simulation(default_fleet(), catalog, policy, way).run(events)
            label = f"{policy.value}, {'verb' if way is Preemption.VERB else 'no verb'}"
            print(
                f"{label:22} {result.placed:7d} {result.preempted:14d} {result.evictions:8d} "
                f"{result.evictions_for_nothing:12d}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a binding")
    parser.add_argument("--pods", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sim-only", action="store_true")
    args = parser.parse_args()
    python = sys.version.split()[0]
    print(f"{platform.machine()} {os.cpu_count()} CPUs, Python {python}, kube-scheduler v1.36.3")
    if not args.sim_only:
        real(args.rounds, args.wait)
    simulated(args.pods, args.seed)


if __name__ == "__main__":
    main()
