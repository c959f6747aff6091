from __future__ import annotations

from neuron_scheduler.core.allocation import Policy, is_valid_core_set, is_valid_device_set
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NeuronRequest, Unit
from neuron_scheduler.sim.kubescheduler import feasible_nodes_to_find
from neuron_scheduler.sim.simulation import Feasible, NodeSpec, PodEvent, Simulation
from neuron_scheduler.sim.workloads import default_fleet, generate_workload


def test_default_run_never_overlaps_and_obeys_topology(catalog: Catalog) -> None:
    events = generate_workload()
    result = Simulation(default_fleet(), catalog, Policy.BEST_FIT).run(events)
    assert result.arrivals == 600
    assert result.placed + result.never_placed >= result.arrivals
    for node in result.nodes:
        seen: set[int] = set()
        for placement in node.pods.values():
            assert not seen & set(placement.cores)
            seen |= set(placement.cores)
            assert is_valid_device_set(node.topology, placement.devices) or is_valid_core_set(
                node.topology, placement.cores
            )
        assert node.state.used_cores.bit_count() == len(seen)


def test_same_seed_same_result(catalog: Catalog) -> None:
    a = Simulation(default_fleet(), catalog, Policy.BEST_FIT).run(generate_workload(seed=3))
    b = Simulation(default_fleet(), catalog, Policy.BEST_FIT).run(generate_workload(seed=3))
    assert a.placed == b.placed and a.pending == b.pending
    assert [n.pods for n in a.nodes] == [n.pods for n in b.nodes]


def test_pending_pod_is_placed_after_a_departure(catalog: Catalog) -> None:
    fleet = [NodeSpec("n0", "inf2.24xlarge")]
    events = [
        PodEvent(0, "big", NeuronRequest(NEURON, 6)),
        PodEvent(1, "waits", NeuronRequest(NEURON, 2)),
        PodEvent(2, "big", None),
    ]
    result = Simulation(fleet, catalog, Policy.BEST_FIT).run(events)
    assert result.placed == 2 and not result.pending
    assert result.nodes[0].pods["waits"].devices == (0, 1)


def test_pending_reason_reads_like_kube_scheduler(catalog: Catalog) -> None:
    fleet = [NodeSpec("t0", "trn1.32xlarge"), NodeSpec("t1", "trn1.32xlarge")]
    result = Simulation(fleet, catalog, Policy.BEST_FIT).run(
        [PodEvent(0, "p", NeuronRequest(NEURON, 7))]
    )
    assert result.pending["p"] == (
        "0/2 nodes are available: 2 Instance type trn1.32xlarge does not support requests for "
        "device: 7. Please request a different number of devices."
    )


def test_best_fit_strands_no_more_than_first_fit(catalog: Catalog) -> None:
    events = generate_workload(seed=11)
    best = Simulation(default_fleet(), catalog, Policy.BEST_FIT).run(events)
    first = Simulation(default_fleet(), catalog, Policy.FIRST_FIT).run(events)
    assert best.placed >= first.placed * 0.95


def test_kube_scheduler_sampling_formula() -> None:
    assert feasible_nodes_to_find(50) == 50
    assert feasible_nodes_to_find(500) == 230
    assert feasible_nodes_to_find(5000) == 500


def test_core_units(catalog: Catalog) -> None:
    assert NeuronRequest("aws.amazon.com/neuroncore", 2).unit is Unit.CORE


def test_a_shortlist_rules_nodes_out_before_scoring(catalog: Catalog) -> None:
    # Two nodes fit both pods and n1 (a ring of 6) is the tighter home for each; a contender
    # whose shortlist keeps only n0 places both there, the base simulation on n1.
    class OnlyN0(Simulation):
        def _shortlist(self, feasible: list[Feasible], request: NeuronRequest) -> list[Feasible]:
            return [f for f in feasible if "n0" in f[2]] or feasible

    fleet = [NodeSpec("n0", "inf2.48xlarge"), NodeSpec("n1", "inf2.24xlarge")]
    events = [
        PodEvent(0, "a", NeuronRequest(NEURON, 4)),
        PodEvent(1, "b", NeuronRequest(NEURON, 2)),
    ]
    base = Simulation(fleet, catalog, Policy.BEST_FIT).run(events)
    assert "a" in base.nodes[1].pods and "b" in base.nodes[1].pods
    narrowed = OnlyN0(fleet, catalog, Policy.BEST_FIT).run(events)
    assert "a" in narrowed.nodes[0].pods and "b" in narrowed.nodes[0].pods
