"""Consolidation's planner (core/consolidation) on random nodes: a torus and a ring, each device
held by a one-device pod of random priority or free, some pods never movable, one other node with
random room; a pending pod of 2 or 4 devices.

Whatever it answers:
- a move evicts only pods it may (not never-moved, of priority at most the pending pod's), at most
  `max_victims`; with them gone the freed block is free, allowed by the topology, and the pending
  pod's size;
- every moved pod of equal priority has a place, and the places overlap neither each other nor
  the freed block nor what their node holds already;
- when some block's holders are all movable, of lower priority and few enough, there is a move (a
  lower-priority pod may go without a place).
"""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import event, given, settings
from hypothesis import strategies as st

from neuron_scheduler.core.allocation import NodeState, allowed_blocks, is_valid_device_set
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.consolidation import Move, Mover, Room, plan_move
from neuron_scheduler.core.eviction import Occupant
from neuron_scheduler.core.ids import core_mask_of_devices, mask_ids
from neuron_scheduler.core.resources import NEURON, NeuronRequest, Unit

CATALOG = Catalog.builtin()
TYPES = ("trn1.32xlarge", "inf2.48xlarge")


@st.composite
def worlds(draw: st.DrawFn) -> tuple[str, dict[str, Mover], NodeState, int, int, int]:
    node_type = draw(st.sampled_from(TYPES))
    topology = CATALOG.resolve(node_type).topology
    per = topology.cores_per_device
    movers: dict[str, Mover] = {}
    used = 0
    for device in range(topology.devices):
        if not draw(st.booleans()):
            continue
        cores = core_mask_of_devices(1 << device, per)
        used |= cores
        priority = draw(st.sampled_from([-5, 0, 0, 5]))
        never = draw(st.sampled_from(["", "", "", "a bare pod"]))
        movers[f"p{device}"] = Mover(
            Occupant(cores, 0, priority, float(device)),
            NeuronRequest(NEURON, 1),
            f"ns/p{device}",
            never,
        )
    other_free = draw(st.integers(0, topology.devices))
    other = NodeState(
        core_mask_of_devices(((1 << topology.devices) - 1) >> other_free << other_free, per)
    )
    size = draw(st.sampled_from([2, 4]))
    max_victims = draw(st.integers(1, 4))
    return node_type, movers, NodeState(used), size, max_victims, other.used_cores


@settings(max_examples=300, deadline=None)
@given(worlds())
def test_a_move_is_allowed_and_complete(
    world: tuple[str, dict[str, Mover], NodeState, int, int, int],
) -> None:
    node_type, movers, base, size, max_victims, other_used = world
    topology = CATALOG.resolve(node_type).topology
    request = NeuronRequest(NEURON, size)
    other = Room("other", topology, NodeState(other_used))

    def rooms(uid: str, wanted: NeuronRequest) -> Iterable[Room]:
        return [Room("n", topology, base), other]

    answer = plan_move("n", topology, base, request, 0, movers, rooms, max_victims=max_victims)
    event("move" if isinstance(answer, Move) else "no move")
    if isinstance(answer, Move):
        victims = [movers[v] for v in answer.victims]
        assert len(victims) <= max_victims
        assert all(not m.never and m.occupant.priority <= 0 for m in victims)
        freed = base.used_cores
        for victim in victims:
            freed &= ~victim.occupant.cores
        assert not freed & answer.block.core_mask
        assert is_valid_device_set(topology, answer.block.devices)
        assert len(answer.block.devices) == size
        placed = {d.pod: d for d in answer.destinations}
        assert all(v in placed for v in answer.victims if movers[v].occupant.priority == 0)
        taken = {"n": answer.block.core_mask | freed, "other": other_used}
        for destination in answer.destinations:
            mask = destination.placement.core_mask
            assert not taken[destination.node] & mask, (destination, taken)
            taken[destination.node] |= mask
            assert is_valid_device_set(topology, destination.placement.devices)
        return
    # No move: then no block is held by few enough movable pods of lower priority alone.
    owner = {c: uid for uid, m in movers.items() for c in mask_ids(m.occupant.cores)}
    for block in allowed_blocks(topology, Unit.DEVICE, size):
        holders = {owner[c] for c in mask_ids(block) if c in owner}
        if len(holders) <= max_victims and all(
            not movers[h].never and movers[h].occupant.priority < 0 for h in holders
        ):
            raise AssertionError(f"{answer} although block {block:#x} is held by {holders}")
