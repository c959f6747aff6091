"""The preempt verb under the real kube-scheduler, with PriorityClasses (issue 18).

Victims on the testbed's fake nodes need a kubelet to start them (kube-scheduler picks the youngest
first) and to finish their termination: tests/testbed/standin.py stands in for it.

Which cases reach the verb on kube-scheduler 1.36: only nodes where its own dry run, counting
resources, finds victims. A node that has enough free devices by count but no allowed block fails
only our filter; the dry run then finds no victims there and kube-scheduler never asks us
(test_a_node_short_only_of_contiguity_never_reaches_the_verb; kubernetes/kubernetes#135486 changes
this in a later release, and the verb already answers such nodes).
"""

from __future__ import annotations

import itertools
import os
import signal

import pytest

from neuron_scheduler.core.ids import format_ids
from neuron_scheduler.core.resources import NEURON
from tests.e2e.harness import Scenario, ids, wait_for
from tests.e2e.preemption import (
    HIGH,
    LOW,
    device_owners,
    evicted_devices,
    fill,
    is_row,
    replace_youngest,
    row_world,
)

GUARD = 2000
CACHED_ONLY = pytest.mark.parametrize("mode", [True], ids=["nodeCacheCapable"], indirect=True)


@pytest.mark.compat
def test_one_whole_row_not_four_scattered_pods(scenario: Scenario) -> None:
    """(a) 16 one-device low-priority pods on a trn1.32xlarge, the youngest one per row; a
    high-priority 4-device pod. kube-scheduler alone would evict the four youngest (one per
    row) and still not fit; with the verb exactly the four pods of one row go."""
    _, stand_in, owners, high = row_world(scenario)
    extender = scenario.stack.extender
    replaced = extender.metric('neuron_scheduler_preempt_nodes_total{outcome="replaced"}')

    scenario.create_pod("big", {NEURON: 4}, priority_class=high)
    big = scenario.wait_bound("big", seconds=120)
    placed = ids(big)
    assert is_row(placed), placed
    assert evicted_devices(stand_in, owners) == placed
    assert len(stand_in.finished) == 4
    after = extender.metric('neuron_scheduler_preempt_nodes_total{outcome="replaced"}')
    assert after == replaced + 1
    scenario.wait_event("big", "NeuronBlockHeld", f"devices {format_ids(placed)} ")
    for name in stand_in.finished:  # kube-scheduler's own notice on each victim
        scenario.wait_event(name, "Preempted")


@CACHED_ONLY
def test_without_the_verb_kube_scheduler_evicts_by_count(scenario: Scenario) -> None:
    """(b) The same world with the preempt verb off: the "before" figure. kube-scheduler evicts
    the four youngest pods, one per row; the pod then fits by count but has no row, the dry run
    finds no victims, and it stays pending with four pods dead for nothing."""
    stack = scenario.stack
    stack.use_scheduler(True, preemption=False)
    try:
        _, stand_in, owners, high = row_world(scenario)
        scenario.create_pod("big", {NEURON: 4}, priority_class=high)
        wait_for(lambda: len(stand_in.finished) >= 4, "kube-scheduler's victims", 120)
        assert evicted_devices(stand_in, owners) == [0, 5, 10, 15]
        # Its next attempt: our filter refuses (no whole row), and the dry run finds no victims.
        no_victims = "preemption: expected at least one victim pod"
        scenario.wait_event("big", "FailedScheduling", no_victims, 120)
        big = scenario.pod("big")
        assert not big["spec"].get("nodeName")
        assert len(stand_in.finished) == 4
        print(f"\nverb off: {len(stand_in.finished)} evicted, preemptor pending")
    finally:
        stack.use_scheduler(True)


@CACHED_ONLY
def test_the_smallest_contiguous_run_on_a_ring(scenario: Scenario) -> None:
    """(c) An inf2.48xlarge full of one-device pods, the youngest three apart (1, 5, 9): a
    3-device preemptor gets three neighbours evicted, not kube-scheduler's scattered three."""
    low, high = scenario.priority_class("low", LOW), scenario.priority_class("high", HIGH)
    stand_in = scenario.kubelet_stand_in()
    node = scenario.add_node("inf2.48xlarge")
    fill(scenario, "low", 12, low)
    replace_youngest(scenario, node, [1, 5, 9], "young", low)
    owners = device_owners(scenario, node)
    scenario.create_pod("big", {NEURON: 3}, priority_class=high)
    placed = ids(scenario.wait_bound("big", seconds=120))
    assert len(stand_in.finished) == 3
    assert evicted_devices(stand_in, owners) == sorted(placed)
    assert all((b - a) % 12 == 1 for a, b in itertools.pairwise(placed)), placed


@CACHED_ONLY
def test_a_node_short_only_of_contiguity_never_reaches_the_verb(scenario: Scenario) -> None:
    """(c, on 1.36) Scattered pods with free devices between them: the count fits, only our
    filter refuses, kube-scheduler's dry run finds no victims and never calls the verb. The
    verb itself, asked about such a node with no victims (as later releases will), answers the
    minimal run."""
    low, high = scenario.priority_class("low", LOW), scenario.priority_class("high", HIGH)
    scenario.kubelet_stand_in()
    node = scenario.add_node("inf2.48xlarge")
    fill(scenario, "low", 12, low)
    owners = device_owners(scenario, node)
    for device in range(0, 12, 2):
        scenario.delete_pod(owners[device])
    wait_for(lambda: len(scenario.pods()) == 6, "the even devices free")
    extender = scenario.stack.extender
    calls = extender.metric("neuron_scheduler_preemptions_total")
    big = scenario.create_pod("big", {NEURON: 3}, priority_class=high)
    scenario.wait_event("big", "FailedScheduling", "needs 3 contiguous devices", 120)
    scenario.wait_event("big", "FailedScheduling", "expected at least one victim pod", 120)
    assert extender.metric("neuron_scheduler_preemptions_total") == calls
    assert not scenario.pod("big")["spec"].get("nodeName")
    status, answer = extender.call(
        "preempt",
        {"Pod": big, "NodeNameToMetaVictims": {node: {"Pods": [], "NumPDBViolations": 0}}},
    )
    assert status == 200, answer
    (victims,) = answer["NodeNameToMetaVictims"].values()
    assert len(victims["Pods"]) == 1


@CACHED_ONLY
def test_a_node_no_eviction_can_help_is_never_chosen(scenario: Scenario) -> None:
    """(d) Node X: every row has a pod of higher priority than the preemptor (no row can be
    freed), though by count kube-scheduler finds victims there. Node Y: low pods only. The
    verb drops X; the preemptor goes to Y and nothing on X is evicted."""
    low, high = scenario.priority_class("low", LOW), scenario.priority_class("high", HIGH)
    guard = scenario.priority_class("guard", GUARD)
    stand_in = scenario.kubelet_stand_in()
    x = scenario.add_node("trn1.32xlarge")
    fill(scenario, "x-low", 16, low)
    replace_youngest(scenario, x, [0, 4, 8, 12], "x-guard", guard)
    on_x = set(device_owners(scenario, x).values())
    y = scenario.add_node("trn1.32xlarge")
    fill(scenario, "y-low", 16, low)
    extender = scenario.stack.extender
    dropped = extender.metric('neuron_scheduler_preempt_nodes_total{outcome="dropped"}')
    scenario.create_pod("big", {NEURON: 4}, priority_class=high)
    big = scenario.wait_bound("big", seconds=120)
    assert big["spec"]["nodeName"] == y
    assert is_row(ids(big))
    assert not set(stand_in.finished) & on_x
    assert len(stand_in.finished) == 4
    after = extender.metric('neuron_scheduler_preempt_nodes_total{outcome="dropped"}')
    assert after >= dropped + 1


@CACHED_ONLY
def test_a_small_pod_does_not_take_the_block_held_for_the_preemptor(scenario: Scenario) -> None:
    """(e) While the preemptor waits for its victims, and after they are gone but before it is
    bound, a small pod gets neither the freed row from filter nor from bind. kube-scheduler is
    paused (SIGSTOP) after the victims go, so the window is held open for as long as the checks
    take rather than won or lost in a race."""
    low, high = scenario.priority_class("low", LOW), scenario.priority_class("high", HIGH)
    stand_in = scenario.kubelet_stand_in()
    stand_in.finishing.clear()  # victims stay Terminating until the test lets them go
    node = scenario.add_node("trn1.32xlarge")
    fill(scenario, "low", 16, low)
    scenario.create_pod("big", {NEURON: 4}, priority_class=high)
    big = wait_for(
        lambda: (p := scenario.pod("big"))["status"].get("nominatedNodeName") and p,
        "the preemptor nominated",
        120,
    )
    assert big["status"]["nominatedNodeName"] == node
    held = scenario.wait_event("big", "NeuronBlockHeld")["message"]
    block = held.split("devices ", 1)[1].split(" (", 1)[0]  # e.g. 4-7
    small = scenario.create_pod("small", {NEURON: 1}, priority_class=low)
    args = {"Pod": small, "NodeNames": [node]}
    # Victims terminating: the row is still theirs.
    status, answer = scenario.stack.extender.call("filter", args)
    assert status == 200 and answer["NodeNames"] == [], answer

    scheduler = scenario.stack.scheduler
    assert scheduler is not None and scheduler.process.pid is not None
    os.kill(scheduler.process.pid, signal.SIGSTOP)
    try:
        stand_in.finishing.set()
        wait_for(lambda: len(stand_in.finished) == 4, "the victims gone", 60)

        def held_for_big() -> str | None:
            _, answer = scenario.stack.extender.call("filter", args)
            reason = str(answer.get("FailedNodes", {}).get(node, ""))
            return reason if "held for" in reason else None

        reason = wait_for(held_for_big, "filter to name the hold", 60)
        assert f"{scenario.namespace}/big" in reason
        error = scenario.stack.extender.bind(scenario.pod("small"), node)
        assert "held for" in error, error
    finally:
        os.kill(scheduler.process.pid, signal.SIGCONT)
    big = scenario.wait_bound("big", seconds=120)
    assert is_row(ids(big)) and format_ids(ids(big)) == block, (ids(big), held)
    assert not scenario.pod("small")["spec"].get("nodeName")
