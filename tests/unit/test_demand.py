"""What the cluster asks for (core.demand), and how best-fit weighs it (core.allocation)."""

from __future__ import annotations

from neuron_scheduler.core.allocation import NodeState, Placement, allocate, demand_score
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import DRIFT, MAX_SHAPES, REFRESH, SCALE, Demand
from neuron_scheduler.core.ids import cores_of_devices, ids_mask
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest, Unit

CATALOG = Catalog.builtin()


def test_weights_follow_what_is_asked_and_sum_to_the_scale() -> None:
    demand = Demand()
    assert demand.weights == ()
    for _ in range(3):
        demand.record(Unit.CORE, 2)
    demand.record(Unit.DEVICE, 8)  # a new shape, a quarter of what is asked: a snapshot at once
    weights = {(unit, count): weight for unit, count, weight in demand.weights}
    assert set(weights) == {(Unit.CORE, 2), (Unit.DEVICE, 8)}
    assert weights[(Unit.CORE, 2)] > 2.5 * weights[(Unit.DEVICE, 8)]
    assert abs(sum(weights.values()) - SCALE) <= len(weights)


def test_snapshot_changes_at_most_every_refresh_for_known_shapes() -> None:
    demand = Demand()
    demand.record(Unit.CORE, 1)
    demand.record(Unit.DEVICE, 4)
    version, weights = demand.version, demand.weights
    for _ in range(REFRESH - 1):
        demand.record(Unit.DEVICE, 4)
    assert (demand.version, demand.weights) == (version, weights)  # kept decisions stay valid
    demand.record(Unit.DEVICE, 4)
    assert demand.version == version + 1
    assert dict(((u, c), w) for u, c, w in demand.weights)[(Unit.DEVICE, 4)] > 900  # 17 of 18


def test_old_asks_fade() -> None:
    demand = Demand()
    for _ in range(1000):
        demand.record(Unit.DEVICE, 16)
    for _ in range(1000):
        demand.record(Unit.CORE, 1)
    weights = dict(((u, c), w) for u, c, w in demand.weights)
    assert weights[(Unit.CORE, 1)] > 0.9 * SCALE  # four half-lives later


def test_shapes_are_bounded_whatever_pods_ask_for() -> None:
    demand = Demand()
    for count in range(1, 10_000):
        demand.record(Unit.CORE, count)
    assert len(demand.weights) <= MAX_SHAPES
    # Each new shape is one pod in ~32: never a twentieth of what is asked, so the snapshot (and
    # with it every decision the extender keeps) is not replaced at every pod.
    assert demand.version < 50


def test_a_new_shape_replaces_the_snapshot_once_it_is_a_twentieth_of_what_is_asked() -> None:
    demand = Demand()
    for _ in range(2_000):
        demand.record(Unit.CORE, 1)
    version = demand.version
    demand.record(Unit.DEVICE, 8)
    assert demand.version == version  # one pod of a shape is no reason to start over
    asked = 1
    while demand.version == version:
        demand.record(Unit.DEVICE, 8)
        asked += 1
    # ~19 pods in a row make a twentieth of the decayed counts; the snapshot is compared at
    # the next multiple of REFRESH.
    assert 19 <= asked <= 19 + REFRESH
    weight = dict(((u, c), w) for u, c, w in demand.weights)[(Unit.DEVICE, 8)]
    assert DRIFT <= weight < 2 * DRIFT


def test_demand_keeps_room_for_the_shapes_asked_for() -> None:
    """inf2.48xlarge with free runs of 5 (1-5) and 3 (7-9): best-fit alone takes a single from
    the run of 3, keeping the run of 5 whole; when the cluster asks for 3 devices it takes it from
    the run of 5, so both runs still serve a 3."""
    topology = CATALOG.resolve("inf2.48xlarge").topology
    state = NodeState(ids_mask(cores_of_devices([0, 6, 10, 11], topology.cores_per_device)))
    one = NeuronRequest(NEURON, 1)
    plain = allocate(topology, state, one)
    assert isinstance(plain, Placement) and plain.devices[0] in (7, 9)
    threes = ((Unit.DEVICE, 3, SCALE),)
    steered = allocate(topology, state, one, demand=threes)
    assert isinstance(steered, Placement) and steered.devices[0] in (1, 5)
    # By demand alone it breaks no run of 3 and wastes only the device it takes: 9. But the
    # node's tightest block for one device is a run of 3 (best-fit's score 3), and that is the
    # ceiling for a small device pod.
    assert demand_score(topology, state.used_cores, steered.core_mask, threes) == 9
    assert steered.score == plain.score == 3


def test_a_small_device_pod_scores_no_higher_than_best_fit() -> None:
    """A 4-device pod on a whole inf2.48xlarge ring of 12 leaves 8 that still serve the 8s asked
    for, so demand alone rates it 6; best-fit rates cutting a ring of 12 for 4 at 3, and the
    lower one stands. Where a run of exactly 4 is free both agree it is a good place."""
    topology = CATALOG.resolve("inf2.48xlarge").topology
    fours_and_eights = ((Unit.DEVICE, 4, SCALE // 2), (Unit.DEVICE, 8, SCALE // 2))
    four = NeuronRequest(NEURON, 4)
    whole = allocate(topology, NodeState(), four, demand=fours_and_eights)
    assert isinstance(whole, Placement)
    assert demand_score(topology, 0, whole.core_mask, fours_and_eights) == 6
    assert whole.score == 3
    run_of_four = NodeState(ids_mask(cores_of_devices(range(8), topology.cores_per_device)))
    tight = allocate(topology, run_of_four, four, demand=fours_and_eights)
    assert isinstance(tight, Placement) and tight.devices == (8, 9, 10, 11)
    # Best-fit scores the exact run 10, so its ceiling does not bind; the 8 is demand's: the pod
    # takes a block the 4s asked for could use.
    assert tight.score == 8
    # Five devices are past the ceiling: demand alone scores them (5 here, best-fit's 4).
    five = NeuronRequest(NEURON, 5)
    ones = ((Unit.DEVICE, 1, SCALE),)
    assert allocate(topology, NodeState(), five).score == 4
    past = allocate(topology, NodeState(), five, demand=ones)
    assert isinstance(past, Placement) and past.score == 5
    # Core pods keep the score by demand alone (best-fit's ceiling sent them to the tightest
    # core run anywhere, measured worse): one core pair on an empty node scores 9, not 1.
    pairs = ((Unit.CORE, 2, SCALE),)
    pair = NeuronRequest(NEURONCORE, 2)
    assert allocate(topology, NodeState(), pair).score == 1
    on_empty = allocate(topology, NodeState(), pair, demand=pairs)
    assert isinstance(on_empty, Placement) and on_empty.score == 9


def test_a_core_pod_fills_a_device_nothing_else_can_use() -> None:
    """A free core of a partly used device serves no device request: taking it wastes nothing
    for a cluster of device pods, so the node that has one scores 10, an empty one less."""
    topology = CATALOG.resolve("inf2.24xlarge").topology
    devices = ((Unit.DEVICE, 2, SCALE),)
    half_used = NodeState(ids_mask([0]))
    one_core = NeuronRequest(NEURONCORE, 1)
    filled = allocate(topology, half_used, one_core, demand=devices)
    assert isinstance(filled, Placement) and filled.cores == (1,) and filled.score == 10
    empty = allocate(topology, NodeState(), one_core, demand=devices)
    assert isinstance(empty, Placement) and empty.score < filled.score
