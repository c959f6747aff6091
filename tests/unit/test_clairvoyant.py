from __future__ import annotations

import math

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NeuronRequest
from neuron_scheduler.sim.clairvoyant import ClairvoyantSimulation, alignment
from neuron_scheduler.sim.contenders import CLAIRVOYANT
from neuron_scheduler.sim.simulation import NodeSpec, PodEvent, SimNode, Simulation
from neuron_scheduler.sim.workloads import STANDARD


def test_alignment_prefers_a_node_that_outlives_the_pod_then_the_least_lengthened() -> None:
    ends = [(50.0, [60.0, 20.0]), (50.0, [100.0]), (50.0, [40.0]), (50.0, [10.0]), (50.0, [])]
    keys = [alignment(end, node) for end, node in ends]
    assert keys == sorted(keys)
    assert alignment(math.inf, [math.inf]) == (0, 0.0)  # pods that never leave: no NaN
    assert alignment(math.inf, [5.0]) > alignment(10.0, [5.0])


def _two_nodes_one_free_device_each() -> tuple[list[NodeSpec], list[PodEvent]]:
    fleet = [NodeSpec("n0", "inf2.48xlarge"), NodeSpec("n1", "inf2.48xlarge")]
    events = [
        PodEvent(0, "long", NeuronRequest(NEURON, 11), duration=100.0),
        PodEvent(0.5, "short", NeuronRequest(NEURON, 11), duration=10.0),
        # Both nodes now have one free device and score alike: only the tie-break decides.
        PodEvent(1, "new", NeuronRequest(NEURON, 1), duration=50.0),
    ]
    return fleet, events


def _node_of(nodes: list[SimNode], pod: str) -> str:
    return next(n.name for n in nodes if pod in n.pods)


def test_clairvoyant_puts_a_pod_beside_pods_that_outlive_it(catalog: Catalog) -> None:
    fleet, events = _two_nodes_one_free_device_each()
    for seed in range(20):
        result = ClairvoyantSimulation(fleet, catalog, seed=seed).run(events)
        assert _node_of(result.nodes, "long") != _node_of(result.nodes, "short")
        assert _node_of(result.nodes, "new") == _node_of(result.nodes, "long")
    # kube-scheduler's random pick takes either node: the test above measures the tie-break.
    picked = {
        _node_of(r.nodes, "new") == _node_of(r.nodes, "long")
        for r in (Simulation(fleet, catalog, seed=seed).run(events) for seed in range(20))
    }
    assert picked == {True, False}


def test_clairvoyant_contender_places_only_valid_sets(catalog: Catalog) -> None:
    workload = STANDARD["mixed"].at_load(0.85, catalog)
    result = CLAIRVOYANT.run(workload.nodes(), catalog, workload.events(1)[:600], seed=1)
    assert result.placed > 0 and result.invalid_placements == 0
