"""The simulator's model of kube-scheduler: scores, the configuration it renders, queue order."""

from __future__ import annotations

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NeuronRequest
from neuron_scheduler.sim.contenders import FIRST_FIT, NEURON_SCHEDULER, NO_TOPOLOGY
from neuron_scheduler.sim.kubescheduler import (
    CHART,
    DEFAULT_FILTER_ONLY,
    DEFAULT_WITH_PRIORITIZE,
    NodeResources,
    extender_score,
    feasible_nodes_to_find,
    in_tree_score,
    scheduler_profile,
)
from neuron_scheduler.sim.simulation import NodeSpec, PodEvent, Simulation
from neuron_scheduler.sim.workloads import STANDARD

GI = 1024**3
NODE = NodeResources(
    (("cpu", 192_000), ("memory", 768 * GI), (NEURON, 16), ("aws.amazon.com/neuroncore", 32))
)


def test_feasible_nodes_to_find_as_kube_scheduler_counts() -> None:
    assert feasible_nodes_to_find(50) == 50
    assert feasible_nodes_to_find(1000) == 420  # 50 - 1000/125 = 42%
    assert feasible_nodes_to_find(5000) == 500  # 10%
    assert feasible_nodes_to_find(200, 5) == 100  # never fewer than 100


def test_most_allocated_over_neuron_scores_the_fuller_node() -> None:
    # 8 of 16 devices requested already, 4 more: 75; cpu and memory are not scored by the chart.
    assert in_tree_score(CHART, NODE, {NEURON: 8}, 8, {NEURON: 4}) == 75
    assert in_tree_score(CHART, NODE, {}, 0, {NEURON: 4}) == 25


def test_default_profile_spreads_by_cpu_and_memory_defaults() -> None:
    # A pod with no cpu or memory requests counts as 100m and 200Mi: LeastAllocated 99 + 99
    # over two resources, BalancedAllocation 99.
    assert in_tree_score(DEFAULT_WITH_PRIORITIZE, NODE, {}, 0, {NEURON: 1}) == 99 + 99


def test_extender_score_scales_by_weight_and_ten() -> None:
    assert extender_score(CHART, 7) == 7 * 20 * 10
    assert extender_score(DEFAULT_WITH_PRIORITIZE, 7) == 70
    assert extender_score(DEFAULT_FILTER_ONLY, 7) == 0
    # With the chart's weight one point of topology score outweighs the whole in-tree range.
    assert extender_score(CHART, 1) > 100


def test_rendered_profiles() -> None:
    assert scheduler_profile(DEFAULT_WITH_PRIORITIZE, "s") == {"schedulerName": "s"}
    chart = scheduler_profile(CHART, "my-scheduler")
    assert chart["plugins"] == {
        "score": {"disabled": [{"name": "NodeResourcesBalancedAllocation"}]}
    }
    (fit,) = chart["pluginConfig"]
    assert fit["name"] == "NodeResourcesFit"
    assert fit["args"]["scoringStrategy"] == {
        "type": "MostAllocated",
        "resources": [
            {"name": NEURON, "weight": 1},
            {"name": "aws.amazon.com/neuroncore", "weight": 1},
        ],
    }


def test_pods_deleted_together_free_their_block_before_any_retry(catalog: Catalog) -> None:
    """Four one-device pods of one row deleted at once: the older waiting 4-device pod gets
    the row. Deleted one by one, the younger 1-device pod would take the first freed device."""
    fleet = [NodeSpec("n0", "trn1.32xlarge")]
    fill = [PodEvent(0, f"p{i:02d}", NeuronRequest(NEURON, 1)) for i in range(16)]
    filled = Simulation(fleet, catalog).run(fill)
    row = [p for p, placement in filled.nodes[0].pods.items() if placement.devices[0] < 4]
    assert len(row) == 4
    waiting = [
        PodEvent(1, "big", NeuronRequest(NEURON, 4)),
        PodEvent(2, "small", NeuronRequest(NEURON, 1)),
    ]
    together = Simulation(fleet, catalog).run(fill + waiting + [PodEvent(3, p, None) for p in row])
    assert "big" in together.nodes[0].pods and "small" in together.pending
    one_by_one = Simulation(fleet, catalog).run(
        fill + waiting + [PodEvent(3 + i, p, None) for i, p in enumerate(row)]
    )
    assert "small" in one_by_one.nodes[0].pods and "big" in one_by_one.pending


def test_standard_workloads_at_a_chosen_load(catalog: Catalog) -> None:
    for workload in STANDARD.values():
        assert 1.1 < workload.offered_load(catalog) < 2.2  # as committed: pods queue
        busy = workload.at_load(0.85, catalog)
        assert abs(busy.offered_load(catalog) - 0.85) < 1e-9
        assert busy.nodes() == workload.nodes()


def test_only_the_bound_places_what_the_topology_forbids(catalog: Catalog) -> None:
    workload = STANDARD["mixed"].at_load(1.2, catalog)
    events = workload.events(1)[:600]
    for contender in (NEURON_SCHEDULER, FIRST_FIT):
        assert contender.run(workload.nodes(), catalog, events).invalid_placements == 0
    assert NO_TOPOLOGY.run(workload.nodes(), catalog, events).invalid_placements > 0
