"""No single node or request may keep the extender's event loop busy for long (issue 21: 50 ms).

The allocator's work is bounded by the topology, and topologies by the ceilings (64 devices of 16
cores; anything beyond is refused before it is modelled). This times the largest shapes those
ceilings allow, with every cache emptied, against a reference computation measured in the same run
that takes about 50 ms on the development VM: the bound is a ratio, so a slower or busier machine
moves both sides alike.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from neuron_scheduler.core import allocation, ids, topology
from neuron_scheduler.core.allocation import NodeState, Policy, allocate
from neuron_scheduler.core.catalog import CapacityError, Catalog, InstanceTypeSpec
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest
from neuron_scheduler.core.topology import MAX_CORES_PER_DEVICE, MAX_DEVICES, Topology, TopologyKind
from neuron_scheduler.jobs.members import MAX_GANG
from neuron_scheduler.jobs.network import EKS_LEVELS, Atom, choose


def _empty_caches() -> None:
    for module in (allocation, topology, ids):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


def _budget() -> float:
    """About 50 ms of plain Python on the development VM (best of three)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        sum(i * i for i in range(700_000))
        best = min(best, time.perf_counter() - start)
    return best


def _slowest(work: Callable[[], object], repeats: int = 3) -> float:
    """The best of a few runs with empty caches: the work itself, without the machine's noise."""
    best = float("inf")
    for _ in range(repeats):
        _empty_caches()
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def _largest_shapes() -> list[Topology]:
    big = {
        "big.ring": InstanceTypeSpec(TopologyKind.RING, MAX_CORES_PER_DEVICE, MAX_DEVICES),
        "big.switch": InstanceTypeSpec(TopologyKind.SWITCH, MAX_CORES_PER_DEVICE, MAX_DEVICES),
    }
    catalog = Catalog({**{t: Catalog.builtin()._specs[t] for t in ("trn2.48xlarge",)}, **big})
    cores = MAX_DEVICES * MAX_CORES_PER_DEVICE
    return [
        catalog.resolve("unknown.metal", MAX_DEVICES, cores).topology,  # a chain
        catalog.resolve("big.ring").topology,
        catalog.resolve("big.switch", MAX_DEVICES, cores).topology,
        catalog.resolve("trn2.48xlarge", 16, 128).topology,  # the largest torus, LNC=1
    ]


def test_the_largest_shapes_decide_within_the_budget() -> None:
    budget = _budget()
    rng = random.Random(21)
    worst = (0.0, "")
    for shape in _largest_shapes():
        build = _slowest(
            lambda s=shape: Topology(
                s.instance_type, s.kind, s.devices, s.cores_per_device, s.groups
            )
        )
        worst = max(worst, (build, f"building {shape.instance_type}"))
        counts = {
            NEURON: sorted({1, 2, 3, shape.devices // 2, shape.devices}),
            NEURONCORE: sorted(
                {1, 2, shape.cores_per_device + 1, shape.total_cores // 3, shape.total_cores}
            ),
        }
        for occupancy in (0.0, 0.5, 0.9):
            used = sum(1 << c for c in range(shape.total_cores) if rng.random() < occupancy)
            for resource, sizes in counts.items():
                for size in sizes:
                    for policy in Policy:
                        request = NeuronRequest(resource, size)
                        took = _slowest(
                            lambda s=shape, r=request, p=policy, u=used: allocate(
                                s, NodeState(u), r, p
                            )
                        )
                        worst = max(
                            worst, (took, f"{shape.instance_type} {request.describe()} {policy}")
                        )
    assert worst[0] < budget, (
        f"{worst[1]} took {worst[0] * 1000:.1f} ms; budget {budget * 1000:.1f} ms"
    )


def test_capacity_beyond_the_ceilings_is_refused_without_being_modelled() -> None:
    """The hostile Nodes of issue 21 (3,000 devices; 10^9 cores) cost no more than a small one."""
    budget = _budget()
    catalog = Catalog.builtin()

    def hostile() -> None:
        for devices, cores in ((3000, None), (4, 10**9), (64, 65 * 16)):
            try:
                catalog.resolve("mystery.metal", devices, cores)
            except CapacityError:
                continue
            raise AssertionError(f"{devices} devices, {cores} cores was modelled")

    assert _slowest(hostile) < budget / 100


def test_a_huge_job_over_many_small_network_domains_is_chosen_within_a_few_budgets() -> None:
    """The network choice for a training job (jobs/network.py) of up to MAX_GANG members over
    as many layer-3 domains as there are nodes (node labels and job sizes are anyone's): it ran
    in the reservation loop's step and in filter, cubic in the domains a job spans (390 of
    them: 23 s), and its subset-sum table grew as domains x members (3,000 domains, 1,024
    members: 3.3 s, 280 MB)."""
    budget = _budget()
    shapes = [(400, 390), (3000, MAX_GANG), (2000, 1000)]
    worst = (0.0, "")
    for nodes, need in shapes:
        atoms = [
            Atom(f"n{i}", 1, ("l1", f"l2-{i // 50}", f"l3-{i}", ""), 1, f"n{i}")
            for i in range(nodes)
        ]
        took = _slowest(lambda a=atoms, n=need: choose(a, n, EKS_LEVELS))
        worst = max(worst, (took, f"{need} members over {nodes} single-node domains"))
    assert worst[0] < 8 * budget, (
        f"{worst[1]} took {worst[0] * 1000:.0f} ms; budget {budget * 1000:.1f} ms"
    )
