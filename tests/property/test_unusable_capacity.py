"""What placement by demand calls unusable for a request shape against brute force: exactly the
free cores that no valid placement of that shape, on the node as it is, could be given."""

from __future__ import annotations

from itertools import combinations

import hypothesis.strategies as st
from hypothesis import given, settings

from neuron_scheduler.core.allocation import (
    _unusable,
    _unusable_cores,
    busy_devices,
    is_valid_core_set,
    is_valid_device_set,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import Unit
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
    topology = CATALOG.resolve(instance_type, *neuron_capacity(instance_type)).topology
    full = (1 << topology.total_cores) - 1
    used = used_bits & full
    for _ in range(density):  # sparser states too, where most shapes still fit
        used &= used >> 1
    free = full & ~used
    expected = free & ~usable_by_brute_force(instance_type, used, unit, count)
    assert _unusable_cores(topology, free, busy_devices(topology, used), unit, count) == expected
    # What placement by demand weighs: those cores, by how often the shape is asked for.
    assert _unusable(topology, used, ((unit, count, 3),)) == 3 * expected.bit_count()


@settings(max_examples=300, deadline=None)
@given(
    instance_type=st.sampled_from(TYPES),
    used_bits=st.integers(0, (1 << 128) - 1),
    density=st.integers(0, 4),
    shapes=st.lists(
        st.tuples(
            st.sampled_from([Unit.CORE, Unit.DEVICE]),
            st.sampled_from([1, 2, 3, 4, 8, 12, 16, 40]),
            st.integers(1, 1024),
        ),
        max_size=5,
        unique_by=lambda shape: shape[:2],
    ),
)
def test_unusable_weighs_every_shape_asked_for(
    instance_type: str, used_bits: int, density: int, shapes: list[tuple[Unit, int, int]]
) -> None:
    """Several shapes at once, as a cluster asks (worked out from one plan per topology)."""
    topology = CATALOG.resolve(instance_type, *neuron_capacity(instance_type)).topology
    full = (1 << topology.total_cores) - 1
    used = used_bits & full
    for _ in range(density):
        used &= used >> 1
    free, busy = full & ~used, busy_devices(topology, used)
    demand = tuple(sorted(shapes))
    expected = sum(
        weight * _unusable_cores(topology, free, busy, unit, count).bit_count()
        for unit, count, weight in demand
    )
    assert _unusable(topology, used, demand) == expected
