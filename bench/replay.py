"""The simulator against the real kube-scheduler + extender on one replayed workload (issue 16
§2): about 40 nodes and 1,000 pods with deletions, in rounds (tests/e2e/replay.py says how).

Reports pods ever placed, pods bound at the end, and what the bound pods ask for per instance
type, for the real run and for the simulator over --sim-seeds seeds (kube-scheduler breaks
ties between nodes at random, so one real run is compared with the simulator's spread).

Run: uv run python bench/replay.py [--pods 1000] [--seed 1] [--sim-seeds 20]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

from fleet import ROOT
from neuron_scheduler.core.catalog import Catalog
from tests.e2e.harness import Scenario
from tests.e2e.replay import compare, plan, run_real, simulate
from tests.testbed import ControlPlane, Stack, find_kubebin

FLEET = (
    ("inf1.6xlarge", 4),
    ("inf1.24xlarge", 2),
    ("inf2.24xlarge", 6),
    ("inf2.48xlarge", 10),
    ("trn1.32xlarge", 12),
    ("trn2.48xlarge", 6),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pods", type=int, default=1000)
    parser.add_argument("--per-round", type=int, default=40)
    parser.add_argument("--mean-rounds", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sim-seeds", type=int, default=20)
    args = parser.parse_args()
    replay = plan(FLEET, args.pods, args.per_round, args.mean_rounds, args.seed)
    catalog = Catalog.builtin()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )
    print(
        f"{sum(c for _, c in FLEET)} nodes, {replay.pods} pods in {len(replay.rounds)} rounds "
        f"(replay seed {args.seed})"
    )
    sims = [simulate(replay, catalog, seed)[0] for seed in range(args.sim_seeds)]
    with ControlPlane(find_kubebin(ROOT)) as cp:
        stack = Stack(cp)
        stack.use_scheduler(True)
        real = run_real(Scenario(stack), replay, settle_seconds=300)
        stack.stop()
    placed = [s.placed for s in sims]
    mean = statistics.fmean(placed)
    print(
        f"real: {real.placed} placed, {real.bound_at_end} bound at the end, "
        f"{real.pending_at_end} pending; {real.seconds:.0f} s"
    )
    print(
        f"simulator over {len(sims)} seeds: placed mean {mean:.1f} (min {min(placed)}, max "
        f"{max(placed)}); {sims[0].seconds * 1000:.0f} ms per run"
    )
    print(f"placed: real vs simulator mean {real.placed / mean - 1:+.2%}")
    gaps = [compare(real, s) for s in sims]
    for key in gaps[0]:
        values = [g[key] for g in gaps]
        print(f"{key}: mean gap {statistics.fmean(values):.2%} (best seed {min(values):.2%})")
    between = [
        compare(a, b)["requested_by_type"] for i, a in enumerate(sims) for b in sims[i + 1 :]
    ]
    print(
        f"requested_by_type between two simulator seeds (ties broken differently): mean "
        f"{statistics.fmean(between):.2%}, min {min(between):.2%}, max {max(between):.2%}"
    )
    kinds = sorted(set(real.requested_by_type) | set(sims[0].requested_by_type))
    print("requested at the end, by instance type (real / simulator seed 0):")
    for kind in kinds:
        print(f"  {kind}: {real.requested_by_type[kind]} / {sims[0].requested_by_type[kind]}")


if __name__ == "__main__":
    main()
