"""What `encode` remembers for the annotations it writes is what reading them back gives: the
watch then finds a bind's own annotations decoded already (core.handoff's memo)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from neuron_scheduler.core import handoff
from neuron_scheduler.core.allocation import NodeState, Placement, allocate
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest

TYPES = ("inf1.6xlarge", "inf2.48xlarge", "trn1.32xlarge", "trn2.48xlarge")


@st.composite
def written(draw: st.DrawFn) -> dict[str, str]:
    topology = Catalog.builtin().resolve(draw(st.sampled_from(TYPES))).topology
    resource = draw(st.sampled_from((NEURON, NEURONCORE)))
    most = topology.devices if resource == NEURON else topology.total_cores
    count = draw(st.integers(1, most))
    parts = draw(st.lists(st.integers(0, count), min_size=1, max_size=4))
    per_container = (*parts, count - sum(parts)) if sum(parts) <= count else ()
    request = NeuronRequest(resource, count, per_container)
    used = draw(st.integers(0, (1 << topology.total_cores) - 1)) & draw(st.integers(0, 255))
    decision = allocate(topology, NodeState(used, 0), request)
    placement = decision if isinstance(decision, Placement) else Placement((0,), (0,), 0)
    containers = [f"c{i}" for i in range(max(len(per_container), 1))]
    return handoff.encode("node-1", request, placement, containers, draw(st.integers(0, 2**63)))


@settings(max_examples=200, deadline=None)
@given(annotations=written())
def test_what_encode_remembers_is_what_decoding_gives(annotations: dict[str, str]) -> None:
    remembered = handoff._MEMO[tuple(map(annotations.get, handoff._READ))]
    assert remembered == handoff._decode(annotations, None)
    assert handoff.decode(annotations) is remembered
