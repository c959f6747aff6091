"""The consolidation planner (core/consolidation) and the plan's persisted form
(core/planrecord): which pods may move for a stranded pod, where each goes again."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest

from neuron_scheduler.core import planrecord
from neuron_scheduler.core.allocation import NodeState
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.consolidation import (
    Move,
    Mover,
    NoMove,
    Room,
    fits_by_count,
    plan_move,
)
from neuron_scheduler.core.eviction import Occupant
from neuron_scheduler.core.ids import cores_of_devices, ids_mask
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest
from neuron_scheduler.core.topology import Topology

CATALOG = Catalog.builtin()
TRN1 = CATALOG.resolve("trn1.32xlarge").topology
INF2 = CATALOG.resolve("inf2.48xlarge").topology
ONE = NeuronRequest(NEURON, 1)
FOUR = NeuronRequest(NEURON, 4)


def mover(
    topology: Topology, name: str, devices: list[int], priority: int = 0, never: str = ""
) -> Mover:
    cores = ids_mask(cores_of_devices(devices, topology.cores_per_device))
    return Mover(
        Occupant(cores, 0, priority, 1000.0 + devices[0]),
        NeuronRequest(NEURON, len(devices)),
        f"ns/{name}",
        never,
    )


def node_of(topology: Topology, movers: dict[str, Mover]) -> NodeState:
    used = 0
    for m in movers.values():
        used |= m.occupant.cores
    return NodeState(used)


def empty_rooms(*topologies: Topology) -> object:
    def rooms(uid: str, request: NeuronRequest) -> Iterable[Room]:
        del uid, request
        return [Room(f"other-{i}", t, NodeState()) for i, t in enumerate(topologies)]

    return rooms


def no_rooms(uid: str, request: NeuronRequest) -> Sequence[Room]:
    del uid, request
    return []


def torus_one_free_per_row() -> dict[str, Mover]:
    """A trn1 whose rows each have one free device (3, 7, 11, 15): 12 devices taken."""
    return {f"p{d}": mover(TRN1, f"p{d}", [d]) for d in range(16) if d % 4 != 3}


def test_a_torus_with_one_free_device_per_row_is_stranded_by_count() -> None:
    movers = torus_one_free_per_row()
    state = node_of(TRN1, movers)
    assert fits_by_count(TRN1, state, FOUR)
    assert not fits_by_count(TRN1, state, NeuronRequest(NEURON, 5))
    assert fits_by_count(TRN1, state, NeuronRequest(NEURONCORE, 8))


def test_equal_priority_pods_move_only_when_placed_again() -> None:
    movers = torus_one_free_per_row()
    state = node_of(TRN1, movers)
    refused = plan_move("n", TRN1, state, FOUR, 0, movers, no_rooms)
    assert isinstance(refused, NoMove)
    assert "cannot be placed again" in refused.reason
    move = plan_move("n", TRN1, state, FOUR, 0, movers, empty_rooms(TRN1))
    assert isinstance(move, Move)
    assert len(move.victims) == 3  # one row's three pods, not four
    assert sorted(move.block.devices) in (
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    )
    assert {d.pod for d in move.destinations} == set(move.victims)
    assert {d.node for d in move.destinations} == {"other-0"}
    taken = [c for d in move.destinations for c in d.placement.cores]
    assert len(taken) == len(set(taken))  # each placement counted for the next


def test_moved_pods_may_go_back_to_the_same_node_outside_the_block() -> None:
    """The node's own free devices are a room too: three pods out of one row fit in the other
    rows' free devices (3 free besides the freed row)."""
    movers = torus_one_free_per_row()
    state = node_of(TRN1, movers)

    def rooms(uid: str, request: NeuronRequest) -> list[Room]:
        return [Room("n", TRN1, state)]

    move = plan_move("n", TRN1, state, FOUR, 0, movers, rooms)
    assert isinstance(move, Move)
    block = set(move.block.cores)
    for destination in move.destinations:
        assert destination.node == "n"
        assert not block & set(destination.placement.cores)


def test_lower_priority_pods_may_go_without_a_place() -> None:
    movers = {u: mover(TRN1, u, [int(u[1:])], priority=-5) for u in torus_one_free_per_row()}
    state = node_of(TRN1, movers)
    move = plan_move("n", TRN1, state, FOUR, 0, movers, no_rooms)
    assert isinstance(move, Move) and move.destinations == ()


def test_pods_never_moved_and_budgets_say_why() -> None:
    movers = torus_one_free_per_row()
    movers = {
        u: mover(TRN1, u, [int(u[1:])], never="a bare pod (no controller recreates it)")
        if int(u[1:]) < 8
        else m
        for u, m in movers.items()
    }
    state = node_of(TRN1, movers)
    # Rows 2 and 3 are movable; row 0/1 pods are bare.
    move = plan_move("n", TRN1, state, FOUR, 0, movers, empty_rooms(TRN1))
    assert isinstance(move, Move) and min(move.block.devices) >= 8

    def budget(victims: Sequence[str]) -> int:
        return sum(1 for v in victims if int(v[1:]) >= 8)

    refused = plan_move("n", TRN1, state, FOUR, 0, movers, empty_rooms(TRN1), budget)
    assert isinstance(refused, NoMove)
    assert "is a bare pod" in refused.reason or "PodDisruptionBudget" in refused.reason
    every_budget = plan_move(
        "n", TRN1, state, FOUR, 0, torus_one_free_per_row(), empty_rooms(TRN1), lambda v: len(v)
    )
    assert isinstance(every_budget, NoMove)
    assert (
        "PodDisruptionBudget" in every_budget.reason
        and "allows no disruption" in every_budget.reason
    )


def test_higher_priority_pods_are_never_moved_and_max_victims_bounds_a_set() -> None:
    movers = {u: mover(TRN1, u, [int(u[1:])], priority=10) for u in torus_one_free_per_row()}
    state = node_of(TRN1, movers)
    assert isinstance(plan_move("n", TRN1, state, FOUR, 0, movers, empty_rooms(TRN1)), NoMove)
    refused = plan_move(
        "n", TRN1, state, FOUR, 0, torus_one_free_per_row(), empty_rooms(TRN1), max_victims=2
    )
    assert isinstance(refused, NoMove) and "at most 2" in refused.reason


def test_a_ring_run_is_freed_with_the_fewest_pods() -> None:
    """inf2.48xlarge (ring of 12): pods on 0,2,4,...: a 4-device pod needs a run of 4; two pods
    block any run of 4 (e.g. 1-4 holds 2 and 4)."""
    movers = {f"p{d}": mover(INF2, f"p{d}", [d]) for d in range(0, 12, 2)}
    state = node_of(INF2, movers)
    assert fits_by_count(INF2, state, FOUR)
    move = plan_move("n", INF2, state, FOUR, 0, movers, empty_rooms(INF2))
    assert isinstance(move, Move) and len(move.victims) == 2


def test_the_record_round_trips_and_rejects_hostile_text() -> None:
    record = planrecord.PlanRecord(
        "trn1-a",
        (4, 5, 6, 7),
        tuple(range(8, 16)),
        1700000000.5,
        1700000300.5,
        (
            planrecord.Replacement("u1", "ns/a", "rs-1", ONE, "trn1-b", (0, 1)),
            planrecord.Replacement("u2", "ns/b", "rs-1", ONE),
        ),
    )
    text = planrecord.encode(record)
    assert planrecord.decode(text) == record
    assert record.summary == "ns/a, ns/b from node trn1-a to free devices 4-7"
    for bad in (
        "",
        "{}",
        text.replace('"v":1', '"v":2'),
        text.replace('"devices":"4-7"', '"devices":"0-99999999"'),
        text.replace('"count":1', '"count":-1', 1),
        text.replace('"ns/a"', '"ns/\\u0000a"'),
        text.replace("1700000300.5", "1600000000"),
        "[" * 10000,
        text.replace('"cores":"0,1"', '"cores":""'),
    ):
        with pytest.raises(planrecord.PlanError):
            planrecord.decode(bad)
