"""The preempt verb's choice of victims (issue 18), on a ledger built from pods as the watch
delivers them."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from neuron_scheduler.core.allocation import NodeState, Placement, Policy, allocate
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import comma_ids, cores_of_devices
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.budgets import DisruptionBudgets
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.extender.verbs.preempting import Preemptor
from neuron_scheduler.extender.verbs.wire import (
    ExtenderPreemptionArgs,
    MetaPod,
    MetaVictims,
    Victims,
)
from neuron_scheduler.kube.objects import Pod, PodDisruptionBudget
from tests.builders import node, pod

CATALOG = Catalog.builtin()


def held(name: str, node_name: str, devices: list[int], priority: int, **extra: Any) -> Pod:
    """A bound pod holding these devices (our annotations), at this priority."""
    per_device = CATALOG.resolve(extra.pop("type", "trn1.32xlarge")).topology.cores_per_device
    cores = cores_of_devices(devices, per_device)
    annotations = {
        "AWS_NEURON_IDS": comma_ids(devices),
        "NEURON_RESOURCE_TYPE": NEURON,
        "NEURON_CORES": comma_ids(cores),
        "NEURON_DEVS": comma_ids(devices),
        "NEURON_NODE": node_name,
    }
    body = pod(name, {NEURON: len(devices)}, node=node_name, uid=name, annotations=annotations)
    body.spec.priority = priority
    body.status.startTime = extra.pop("started", "2026-11-23T10:00:00Z")
    body.metadata.labels = extra.pop("labels", {})
    return body


def preemptor(limits: dict[str, int], priority: int, uid: str = "big") -> Pod:
    body = pod(uid, limits, uid=uid)
    body.spec.priority = priority
    return body


def setup(
    node_type: str, pods: list[Pod], budgets: list[PodDisruptionBudget] = ()
) -> tuple[Ledger, Preemptor]:
    ledger = Ledger(CATALOG)
    ledger.replace_nodes([node("n", node_type)])
    ledger.replace_pods(pods)
    view = DisruptionBudgets()
    view.replace(list(budgets))
    return ledger, Preemptor(ledger, view, Metrics(ledger))


def ask(
    preempt: Preemptor, who: Pod, given: list[str], as_pods: bool = False
) -> dict[str, list[str]]:
    if as_pods:  # nodeCacheCapable false: whole pods
        args = ExtenderPreemptionArgs(
            Pod=who,
            NodeNameToVictims={"n": Victims([pod(u, {NEURON: 1}, uid=u) for u in given])},
        )
    else:
        args = ExtenderPreemptionArgs(
            Pod=who, NodeNameToMetaVictims={"n": MetaVictims([MetaPod(u) for u in given])}
        )
    answer = asyncio.run(preempt.preempt(args))
    return {n: [p.UID for p in v.Pods] for n, v in answer.NodeNameToMetaVictims.items()}


def test_a_whole_row_not_four_pods_from_four_rows() -> None:
    """The issue's case: 16 one-device pods on a torus, a 4-device pod of higher priority.
    kube-scheduler's counting picks one pod per row, which frees no row."""
    pods = [held(f"p{d}", "n", [d], priority=0) for d in range(16)]
    _, preempt = setup("trn1.32xlarge", pods)
    answer = ask(preempt, preemptor({NEURON: 4}, 100), ["p0", "p4", "p8", "p12"])
    (victims,) = answer.values()
    devices = sorted(int(v[1:]) for v in victims)
    assert devices in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15])
    assert preempt.metrics.preempt_nodes.labels("replaced")._value.get() == 1


def test_kube_schedulers_victims_are_kept_when_they_free_a_block() -> None:
    pods = [held(f"p{d}", "n", [d], priority=0) for d in range(16)]
    _, preempt = setup("trn1.32xlarge", pods)
    answer = ask(preempt, preemptor({NEURON: 4}, 100), ["p8", "p9", "p10", "p11"], as_pods=True)
    assert sorted(answer["n"]) == ["p10", "p11", "p8", "p9"]
    assert preempt.metrics.preempt_nodes.labels("kept")._value.get() == 1


def test_lowest_priority_first_then_fewest_pods_then_the_youngest() -> None:
    # Row 0: one pod of priority 5; row 1: two pods of priority 1; rows 2, 3: pods of
    # priority 1, the row-3 ones started later (less work lost).
    pods = [
        held("r0", "n", [0, 1, 2, 3], priority=5),
        held("r1a", "n", [4, 5], priority=1),
        held("r1b", "n", [6, 7], priority=1),
        held("r2", "n", [8, 9, 10, 11], priority=1, started="2026-11-23T08:00:00Z"),
        held("r3", "n", [12, 13, 14, 15], priority=1, started="2026-11-23T11:00:00Z"),
    ]
    _, preempt = setup("trn1.32xlarge", pods)
    assert ask(preempt, preemptor({NEURON: 4}, 10), []) == {"n": ["r3"]}


def test_fewest_budget_violations_before_fewest_pods() -> None:
    pods = [
        held("r0", "n", [0, 1, 2, 3], priority=1, labels={"app": "guarded"}),
        held("r1a", "n", [4, 5], priority=1),
        held("r1b", "n", [6, 7], priority=1),
        *[held(f"x{d}", "n", [d], priority=50) for d in range(8, 16)],
    ]
    budget = msgspec.convert(
        {
            "metadata": {"name": "guard", "namespace": "default"},
            "spec": {"selector": {"matchLabels": {"app": "guarded"}}},
            "status": {"disruptionsAllowed": 0},
        },
        PodDisruptionBudget,
    )
    _, preempt = setup("trn1.32xlarge", pods, [budget])
    (victims,) = ask(preempt, preemptor({NEURON: 4}, 10), []).values()
    assert sorted(victims) == ["r1a", "r1b"]


def test_never_equal_or_higher_priority_and_hopeless_nodes_are_dropped() -> None:
    # Every row has a pod of priority 10: a priority-10 preemptor cannot free one.
    pods = [held(f"p{d}", "n", [d], priority=10 if d % 4 == 0 else 0) for d in range(16)]
    _, preempt = setup("trn1.32xlarge", pods)
    assert ask(preempt, preemptor({NEURON: 4}, 10), ["p1", "p2", "p3", "p5"]) == {}
    assert preempt.metrics.preempt_nodes.labels("dropped")._value.get() == 1
    # A count the torus never allows is dropped too (no eviction can help).
    assert ask(preempt, preemptor({NEURON: 3}, 99), ["p1"]) == {}


def test_the_smallest_contiguous_run_on_a_ring() -> None:
    """Issue e2e (c): an inf2.48xlarge with scattered 1-device pods and a 3-device preemptor."""
    pods = [held(f"p{d}", "n", [d], priority=0, type="inf2.48xlarge") for d in (1, 3, 5, 7, 9, 11)]
    _, preempt = setup("inf2.48xlarge", pods)
    (victims,) = ask(preempt, preemptor({NEURON: 3}, 5), ["p1", "p3"]).values()
    assert len(victims) == 1  # e.g. p1 frees 0,1,2


def test_core_windows_and_pods_with_unknown_ids() -> None:
    # inf1.6xlarge, 4 devices x 4 cores: cores 0-3 by a known pod, 8 cores by a pod placed
    # without us (ids unknown, counted against the total): a 6-core preemptor needs only the
    # known pod gone; a 10-core one cannot fit beside 8 unknown cores, so the stranger goes
    # (alone: devices 1-3 then hold the 10-core window).
    known = held("known", "n", [0], priority=0, type="inf1.6xlarge")
    stranger = pod("stranger", {NEURONCORE: 8}, node="n", uid="stranger")
    stranger.spec.priority = 0
    _, preempt = setup("inf1.6xlarge", [known, stranger])
    (victims,) = ask(preempt, preemptor({NEURONCORE: 6}, 5), []).values()
    assert set(victims) == {"known"}
    (victims,) = ask(preempt, preemptor({NEURONCORE: 10}, 5), []).values()
    assert set(victims) == {"stranger"}
    # 14 cores: both go.
    (victims,) = ask(preempt, preemptor({NEURONCORE: 14}, 5), []).values()
    assert set(victims) == {"known", "stranger"}


def test_the_block_is_held_for_the_nominated_pod() -> None:
    """Issue e2e (e): once nominated, the preemptor's block stays its own while its victims
    terminate: a small pod cannot take it; the preemptor itself can."""
    pods = [held(f"p{d}", "n", [d], priority=0) for d in range(16)]
    ledger, preempt = setup("trn1.32xlarge", pods)
    (victims,) = ask(preempt, preemptor({NEURON: 4}, 100), []).values()
    for uid in victims:  # kube-scheduler deletes them: terminating, then gone
        doomed = next(p for p in pods if p.metadata.uid == uid)
        doomed.metadata.deletionTimestamp = "2026-11-23T12:00:00Z"
        ledger.apply_pod(doomed)
    big = preemptor({NEURON: 4}, 100)
    big.status.nominatedNodeName = "n"
    ledger.apply_pod(big)
    for uid in victims:
        ledger.remove_pod(uid)
    small = NeuronRequest(NEURON, 1)
    topology = ledger.nodes["n"].topology
    assert not isinstance(allocate(topology, ledger.state("n"), small), Placement)
    for priority in (0, 100):  # lower or equal priority: held
        seen = ledger.state_for(Claimant("small", priority), "n")
        assert not isinstance(allocate(topology, seen, small), Placement)
        reason = ledger.hold_reason(Claimant("small", priority), "n", small, Policy.BEST_FIT)
        assert reason is not None and "held for default/big" in reason
    # Higher priority: kube-scheduler lets it take a lower nominated pod's room, and so do we.
    seen = ledger.state_for(Claimant("urgent", 101), "n")
    assert isinstance(allocate(topology, seen, small), Placement)
    assert ledger.hold_reason(Claimant("urgent", 101), "n", small, Policy.BEST_FIT) is None
    mine = allocate(topology, ledger.state_for(Claimant("big", 100), "n"), NeuronRequest(NEURON, 4))
    assert isinstance(mine, Placement)
    assert sorted(mine.devices) == sorted(int(v[1:]) for v in victims)
    # Bound: the hold becomes the pod's own holding.
    big.spec.nodeName = "n"
    ledger.apply_pod(big)
    assert "big" not in ledger.nominations


def test_a_node_that_fits_without_victims_is_not_named() -> None:
    pods = [held("p0", "n", [0], priority=0)]
    _, preempt = setup("trn1.32xlarge", pods)
    assert ask(preempt, preemptor({NEURON: 4}, 100), ["p0"]) == {"n": ["p0"]}  # kept as given
    assert ask(preempt, preemptor({NEURON: 4}, 100), []) == {}


@pytest.mark.parametrize("bad", [{"Pod": None}, {"Pod": {}}])
def test_requests_without_a_pod_or_victims_are_bad(bad: dict[str, Any]) -> None:
    from neuron_scheduler.extender.verbs.wire import BadRequest

    _, preempt = setup("trn1.32xlarge", [])
    args = msgspec.convert(bad, ExtenderPreemptionArgs)
    with pytest.raises(BadRequest):
        asyncio.run(preempt.preempt(args))


def test_victims_free_what_the_state_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer's block really is free once the victims are gone (checked on the ledger)."""
    pods = [held(f"p{d}", "n", [d], priority=d % 3) for d in range(16)]
    ledger, preempt = setup("trn1.32xlarge", pods)
    (victims,) = ask(preempt, preemptor({NEURON: 8}, 3), []).values()
    for uid in victims:
        ledger.remove_pod(uid)
    decision = allocate(ledger.nodes["n"].topology, ledger.state("n"), NeuronRequest(NEURON, 8))
    assert isinstance(decision, Placement)
    assert isinstance(ledger.state("n"), NodeState)


def test_kube_schedulers_victims_for_other_resources_stay() -> None:
    """A victim that holds no Neuron device was chosen for CPU or memory: it stays, after ours;
    where the devices already fit, kube-scheduler's answer stands whole."""
    pods = [held(f"p{d}", "n", [d], priority=0) for d in range(16)]
    _, preempt = setup("trn1.32xlarge", pods)
    answer = ask(preempt, preemptor({NEURON: 4}, 10), ["p0", "p5", "p10", "p15", "cpu-hog"])
    (victims,) = answer.values()
    assert victims[-1] == "cpu-hog"
    assert len(victims) == 5 and len({int(v[1:]) // 4 for v in victims[:-1]}) == 1
    _, preempt = setup("trn1.32xlarge", pods[:4])
    assert ask(preempt, preemptor({NEURON: 4}, 10), ["cpu-hog", "p1"]) == {"n": ["cpu-hog", "p1"]}
