"""What placement by demand calls unusable for a request shape against brute force: exactly the
free cores that no valid placement of that shape, on the node as it is, could be given; and the
placement a decision by demand picks against working it out the long way."""

from __future__ import annotations

from itertools import combinations

import hypothesis.strategies as st
from hypothesis import given, settings

from neuron_scheduler.core.allocation import (
    SMALL_DEVICE_COUNT,
    NodeState,
    Placement,
    _decide_by_demand,
    _demand_score,
    _unusable,
    _unusable_cores,
    allocate,
    busy_devices,
    is_valid_core_set,
    is_valid_device_set,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import DemandWeights
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from tests.builders import neuron_capacity

CATALOG = Catalog.builtin()
TYPES = ["inf1.6xlarge", "inf1.24xlarge", "inf2.48xlarge", "trn1.32xlarge", "trn2.48xlarge"]


def usable_by_brute_force(topology_type: str, used: int, unit: Unit, count: int) -> int:
    topology = CATALOG.resolve(topology_type, *neuron_capacity(topology_type)).topology
    usable = 0
    if unit is Unit.DEVICE:
        if count > topology.devices:
            return 0
        for devices in combinations(range(topology.devices), count):
            cores = topology.core_mask_of_devices(sum(1 << d for d in devices))
            if not cores & used and is_valid_device_set(topology, devices):
                usable |= cores
        return usable
    for start in range(topology.total_cores - count + 1):
        window = ((1 << count) - 1) << start
        if not window & used and is_valid_core_set(topology, range(start, start + count)):
            usable |= window
    return usable


def sparse_state(instance_type: str, used_bits: int, density: int) -> tuple[Topology, int]:
    """A node of the type, the cores in use from random bits thinned `density` times (sparser
    states too, where most shapes still fit)."""
    topology = CATALOG.resolve(instance_type, *neuron_capacity(instance_type)).topology
    used = used_bits & ((1 << topology.total_cores) - 1)
    for _ in range(density):
        used &= used >> 1
    return topology, used


def shapes_asked(min_size: int) -> st.SearchStrategy[list[tuple[Unit, int, int]]]:
    """What a cluster asks for: distinct (unit, count) shapes, each with a weight."""
    return st.lists(
        st.tuples(
            st.sampled_from([Unit.CORE, Unit.DEVICE]),
            st.sampled_from([1, 2, 3, 4, 8, 12, 16, 40]),
            st.integers(1, 1024),
        ),
        min_size=min_size,
        max_size=5,
        unique_by=lambda shape: shape[:2],
    )


@settings(max_examples=400, deadline=None)
@given(
    instance_type=st.sampled_from(TYPES),
    used_bits=st.integers(0, (1 << 128) - 1),
    density=st.integers(0, 4),
    unit=st.sampled_from([Unit.CORE, Unit.DEVICE]),
    count=st.sampled_from([1, 2, 3, 4, 8, 12, 16]),
)
def test_unusable_is_the_free_capacity_no_valid_placement_reaches(
    instance_type: str, used_bits: int, density: int, unit: Unit, count: int
) -> None:
    topology, used = sparse_state(instance_type, used_bits, density)
    free = ~used & ((1 << topology.total_cores) - 1)
    expected = free & ~usable_by_brute_force(instance_type, used, unit, count)
    assert _unusable_cores(topology, free, busy_devices(topology, used), unit, count) == expected
    # What placement by demand weighs: those cores, by how often the shape is asked for.
    assert _unusable(topology, used, ((unit, count, 3),)) == 3 * expected.bit_count()


def weighted_unusable(topology: Topology, used: int, demand: DemandWeights) -> int:
    """Each shape's unusable cores (checked against brute force above), by its weight."""
    free, busy = ~used & ((1 << topology.total_cores) - 1), busy_devices(topology, used)
    return sum(
        weight * _unusable_cores(topology, free, busy, unit, count).bit_count()
        for unit, count, weight in demand
    )


@settings(max_examples=300, deadline=None)
@given(
    instance_type=st.sampled_from(TYPES),
    used_bits=st.integers(0, (1 << 128) - 1),
    density=st.integers(0, 4),
    shapes=shapes_asked(min_size=0),
)
def test_unusable_weighs_every_shape_asked_for(
    instance_type: str, used_bits: int, density: int, shapes: list[tuple[Unit, int, int]]
) -> None:
    """Several shapes at once, as a cluster asks (worked out from one plan per topology)."""
    topology, used = sparse_state(instance_type, used_bits, density)
    demand = tuple(sorted(shapes))
    assert _unusable(topology, used, demand) == weighted_unusable(topology, used, demand)


def chosen_by_reference(
    topology: Topology, used: int, unit: Unit, count: int, demand: DemandWeights, best: Placement
) -> tuple[int, int]:
    """What a decision by demand picks, worked out the long way: each placement's waste from
    each shape's unusable cores on the node after it, in the allocator's order (device sets as
    the topology lists them, core windows by start); the best-fit pick stands unless another
    wastes strictly less. (its cores, what it raised the weighted unusable capacity by)"""
    if unit is Unit.DEVICE:
        busy = busy_devices(topology, used)
        masks = [
            topology.core_mask_of_devices(devices)
            for devices in topology.device_sets(count)
            if not devices & busy
        ]
    else:
        masks = [
            ((1 << count) - 1) << start
            for start in range(topology.total_cores - count + 1)
            if not (((1 << count) - 1) << start) & used
            and is_valid_core_set(topology, range(start, start + count))
        ]
    chosen, least = best.core_mask, weighted_unusable(topology, used | best.core_mask, demand)
    for mask in masks:
        after = weighted_unusable(topology, used | mask, demand)
        if after < least:
            chosen, least = mask, after
    return chosen, least - weighted_unusable(topology, used, demand)


@settings(max_examples=300, deadline=None)
@given(
    instance_type=st.sampled_from(TYPES),
    used_bits=st.integers(0, (1 << 128) - 1),
    density=st.integers(1, 5),
    unit=st.sampled_from([Unit.CORE, Unit.DEVICE]),
    count=st.sampled_from([1, 2, 3, 4, 8]),
    shapes=shapes_asked(min_size=1),
)
def test_a_decision_by_demand_picks_the_placement_that_wastes_least(
    instance_type: str,
    used_bits: int,
    density: int,
    unit: Unit,
    count: int,
    shapes: list[tuple[Unit, int, int]],
) -> None:
    topology, used = sparse_state(instance_type, used_bits, density)
    resource = NEURON if unit is Unit.DEVICE else NEURONCORE
    best = allocate(topology, NodeState(used, 0), NeuronRequest(resource, count))
    if not isinstance(best, Placement):
        return
    demand = tuple(sorted(shapes))
    chosen = _decide_by_demand(topology, used, unit, count, demand, best)
    mask, raised = chosen_by_reference(topology, used, unit, count, demand, best)
    assert chosen.core_mask == mask
    score = _demand_score(topology, demand, mask, raised)
    if unit is Unit.DEVICE and count <= SMALL_DEVICE_COUNT:
        score = min(score, best.score)
    assert chosen.score == score
