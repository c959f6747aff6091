"""Best-fit against brute force: no other allowed placement keeps a larger request satisfiable."""

from __future__ import annotations

from itertools import combinations

import hypothesis.strategies as st
from hypothesis import given, settings

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    allocate,
    is_valid_device_set,
    largest_free_run,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import ids_mask
from neuron_scheduler.core.resources import NEURON, NeuronRequest

CATALOG = Catalog.builtin()
TYPES = ["inf1.6xlarge", "inf1.24xlarge", "inf2.24xlarge", "inf2.48xlarge", "trn1.32xlarge"]


@settings(max_examples=300, deadline=None)
@given(
    instance_type=st.sampled_from(TYPES),
    used=st.sets(st.integers(0, 15), max_size=12),
    count=st.integers(1, 8),
)
def test_best_fit_keeps_the_largest_free_block(
    instance_type: str, used: set[int], count: int
) -> None:
    topology = CATALOG.resolve(instance_type).topology
    used_devices = [d for d in used if d < topology.devices]
    busy = ids_mask(used_devices)
    state = NodeState(topology.core_mask_of_devices(busy))
    decision = allocate(topology, state, NeuronRequest(NEURON, count))
    free = [d for d in range(topology.devices) if d not in used_devices]
    options = [
        c
        for c in combinations(free, count)
        if count <= len(free) and is_valid_device_set(topology, c)
    ]
    if not isinstance(decision, Placement):
        assert not options, f"refused although {options[0]} was possible"
        return
    chosen = largest_free_run(topology, busy | ids_mask(decision.devices))
    best = max(largest_free_run(topology, busy | ids_mask(c)) for c in options)
    assert chosen == best
