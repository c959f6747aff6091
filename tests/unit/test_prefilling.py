"""Decisions made ahead while filter is idle (extender/loops/prefilling): the shapes the cluster
asks for most get a kept decision on every node, a chunk a turn, never while kube-scheduler is
calling, and filter then decides nothing itself."""

from __future__ import annotations

import pytest

from neuron_scheduler.core.allocation import Policy, allocate
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest
from neuron_scheduler.extender.loops import prefilling
from neuron_scheduler.extender.loops.prefilling import Prefiller
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.verbs.judging import Judge
from neuron_scheduler.extender.verbs.wire import ExtenderArgs
from tests.builders import node, pod

TYPES = ("inf2.48xlarge", "trn1.32xlarge", "inf1.6xlarge")
NAMES = [f"n{i}" for i in range(9)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet() -> tuple[Ledger, Judge, Prefiller, Clock]:
    clock = Clock()
    ledger = Ledger(Catalog.builtin())
    ledger.replace_nodes([node(name, TYPES[i % 3]) for i, name in enumerate(NAMES)])
    bound = pod("bound", {NEURONCORE: 2}, node="n0")
    ledger.replace_pods([bound, pod("a", {NEURONCORE: 2}), pod("b", {NEURON: 1}, uid="uid-b")])
    judge = Judge(ledger, Metrics(ledger), clock=clock)
    return ledger, judge, Prefiller(ledger, Policy.BEST_FIT, lambda: judge.last_call, clock), clock


def test_turns_decide_the_shapes_asked_for_on_every_node_a_chunk_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(prefilling, "CHUNK", 4)
    ledger, _, prefiller, _ = fleet()
    shapes = prefiller.shapes()
    assert {(s.resource, s.count) for s in shapes} == {(NEURONCORE, 2), (NEURON, 1)}
    turns = 0
    while prefiller.turn():
        turns += 1
        assert turns <= 10, "turns never end"
    assert turns == 6  # 9 nodes in chunks of 4, for each of the two shapes
    assert ledger.decisions == 18
    for request in shapes:
        decisions = ledger.verdicts(request, Policy.BEST_FIT).decisions
        assert set(decisions) == set(NAMES)
        for name in NAMES:  # the allocator's own answer for the node as it is
            expected = allocate(
                ledger.nodes[name].topology,
                ledger.state(name),
                request,
                Policy.BEST_FIT,
                ledger.demand.weights,
            )
            assert decisions[name] == expected
    assert not prefiller.turn()


def test_a_filter_after_the_turns_decides_nothing_itself() -> None:
    ledger, judge, prefiller, _ = fleet()
    while prefiller.turn():
        pass
    made = ledger.decisions
    asking = pod("c", {NEURONCORE: 2}, uid="uid-c")
    result = judge.filter(ExtenderArgs(Pod=asking, NodeNames=NAMES))
    assert sorted(result.passed) == NAMES
    assert ledger.decisions == made
    # A node that changes is decided again by the next filter, as before.
    ledger.apply_pod(pod("d", {NEURONCORE: 2}, uid="uid-d", node="n1"))
    judge.filter(ExtenderArgs(Pod=asking, NodeNames=NAMES))
    assert ledger.decisions == made + 1


def test_no_turn_is_taken_until_filter_and_prioritize_have_been_idle() -> None:
    _, judge, prefiller, clock = fleet()
    assert prefiller.idle_for() == 0.0  # never called
    judge.prioritize(ExtenderArgs(Pod=pod("c", {NEURONCORE: 2}), NodeNames=["n0"]))
    assert prefiller.idle_for() == pytest.approx(prefilling.IDLE)
    clock.now += prefilling.IDLE / 2
    judge.filter(ExtenderArgs(Pod=pod("c", {NEURONCORE: 2}), NodeNames=["n0"]))
    assert prefiller.idle_for() == pytest.approx(prefilling.IDLE)
    clock.now += prefilling.IDLE
    assert prefiller.idle_for() == 0.0


def test_only_the_most_asked_for_shapes_are_decided_ahead() -> None:
    ledger = Ledger(Catalog.builtin())
    for turn in range(12):
        for count in range(1, 13):
            if turn < count:  # count n is asked for n times, the largest the most
                ledger.demand.record(NeuronRequest(NEURON, count).unit, count)
    counts = [s.count for s in Prefiller(ledger, Policy.BEST_FIT, lambda: 0.0).shapes()]
    assert len(counts) == prefilling.MAX_SHAPES == 8
    assert set(counts) == set(range(5, 13))  # the four asked for least are left out
    weight = {count: w for _, count, w in ledger.demand.weights}
    assert [weight[c] for c in counts] == sorted((weight[c] for c in counts), reverse=True)
