"""The simulator predicts the real kube-scheduler + extender (issue 16 §2), at a small size: the
same rounds of creations and deletions through both, the same number of pods placed
(bench/replay.py runs 40 nodes and 1,000 pods; figures in BENCHMARKS.md).

A control plane of its own: the replay's pods carry no nodeSelector (tests/e2e/replay.py says
why), so no other test's nodes may be there."""

from __future__ import annotations

from pathlib import Path

from neuron_scheduler.core.catalog import Catalog
from tests.e2e.harness import Scenario
from tests.e2e.replay import plan, run_real, simulate
from tests.testbed import ControlPlane, Stack

FLEET = (
    ("inf1.6xlarge", 2),
    ("inf2.48xlarge", 2),
    ("trn1.32xlarge", 2),
    ("trn2.48xlarge", 1),
)


def test_simulator_places_what_the_real_scheduler_places(kubebin: Path) -> None:
    replay = plan(FLEET, pods=120, per_round=20, mean_rounds=3, seed=4)
    with ControlPlane(kubebin) as cp:
        stack = Stack(cp)
        try:
            stack.use_scheduler(node_cache_capable=True)
            real = run_real(Scenario(stack), replay)
        finally:
            stack.stop()
    # The workload overfills the fleet: some pods wait, so placement decides what fits.
    assert real.pending_at_end > 0, real
    # Ties between nodes are broken at random, in kube-scheduler and in the simulator: the real
    # run must fall within the simulator's spread over seeds (93-99 of 120 over 300 seeds), give
    # or take 5%: at this size two pods are 2% (real runs placed 95, 99 and 101). The 2% target
    # holds at 40 nodes and 1,000 pods (bench/replay.py: -0.7%).
    placed = [simulate(replay, Catalog.builtin(), seed)[0].placed for seed in range(50)]
    assert min(placed) * 0.95 <= real.placed <= max(placed) * 1.05, (real, placed)
