"""The scheduler's DRA decision over our published devices, as benchmarks call it."""

from __future__ import annotations

from neuron_scheduler.core.allocation import NodeState, Placement, Refusal, torus_count_warning
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import ids_mask
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest, Unit
from neuron_scheduler.dra.firstfit import allocate_like_scheduler, first_fit

CATALOG = Catalog.builtin()


def state(instance_type: str, used: list[int]) -> NodeState:
    topology = CATALOG.resolve(instance_type).topology
    return NodeState(topology.core_mask_of_devices(ids_mask(used)))


def test_a_3_window_wraps_when_only_the_wrap_is_free() -> None:
    topology = CATALOG.resolve("inf2.48xlarge").topology
    decision = allocate_like_scheduler(
        topology, state("inf2.48xlarge", list(range(2, 11))), NeuronRequest(NEURON, 3)
    )
    assert decision == Placement((11, 0, 1), (22, 23, 0, 1, 2, 3), 0)


def test_first_fit_takes_the_first_free_shape_in_published_order() -> None:
    topology = CATALOG.resolve("trn1.32xlarge").topology
    row0 = topology.core_mask_of_devices(ids_mask([0]))
    shape = first_fit(topology, row0, Unit.DEVICE, 4)
    assert shape is not None and shape.name == "row-1"
    assert first_fit(topology, row0 | topology.core_mask_of_devices(1 << 8), Unit.DEVICE, 8) is None
    # An unhealthy device's shapes carry a taint the claim does not tolerate.
    tainted = first_fit(topology, 0, Unit.DEVICE, 8, tainted=ids_mask([3]))
    assert tainted is not None and tainted.name == "half-1"


def test_one_used_core_keeps_its_device_from_device_claims_not_from_core_claims() -> None:
    topology = CATALOG.resolve("inf2.48xlarge").topology
    used = NodeState(ids_mask([1]))  # core 1: the second core of device 0
    single = allocate_like_scheduler(topology, used, NeuronRequest(NEURON, 1))
    assert isinstance(single, Placement) and single.devices == (1,)
    core = allocate_like_scheduler(
        topology, used, NeuronRequest(NEURONCORE, 1), core_windows=(1, 2)
    )
    assert core == Placement((0,), (0,), 0)
    # Two cores: within one device first (cores 2,3), not across devices 0 and 1 (cores 1,2).
    pair = allocate_like_scheduler(
        topology, NodeState(ids_mask([0])), NeuronRequest(NEURONCORE, 2), core_windows=(1, 2)
    )
    assert pair == Placement((1,), (2, 3), 0)


def test_refusals() -> None:
    trn = CATALOG.resolve("trn1.32xlarge").topology
    refused = allocate_like_scheduler(trn, NodeState(), NeuronRequest(NEURON, 7))
    assert refused == Refusal(torus_count_warning("trn1.32xlarge", 7), True)
    cores = allocate_like_scheduler(trn, NodeState(), NeuronRequest(NEURONCORE, 2))
    assert isinstance(cores, Refusal) and cores.unresolvable
    assert "no published core window of 2 cores" in cores.reason
    bigger = allocate_like_scheduler(
        trn, NodeState(), NeuronRequest(NEURONCORE, 9), core_windows=(1, 2, 4, 8, 16)
    )
    assert isinstance(bigger, Refusal) and bigger.unresolvable
    full = allocate_like_scheduler(trn, state("trn1.32xlarge", [0, 8]), NeuronRequest(NEURON, 8))
    assert isinstance(full, Refusal) and not full.unresolvable
    assert "free devices: 1-7,9-15" in full.reason
    no_core = allocate_like_scheduler(
        trn, NodeState((1 << 32) - 1 - 1), NeuronRequest(NEURONCORE, 2), core_windows=(1, 2)
    )
    assert isinstance(no_core, Refusal) and "free cores: 0" in no_core.reason
