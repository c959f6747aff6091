"""The extender under the real kube-scheduler: each scenario of the end-to-end issue."""

from __future__ import annotations

import itertools

import pytest

from neuron_scheduler.core.resources import NEURON, NEURONCORE
from tests.e2e.harness import WARNING_7, Scenario, ids, wait_for


@pytest.mark.compat
def test_seed_nine_cores_on_empty_inf1(scenario: Scenario) -> None:
    node = scenario.add_node("inf1.6xlarge")
    scenario.create_pod("nrt-test", {NEURONCORE: 9})
    pod = scenario.wait_bound("nrt-test")
    assert pod["spec"]["nodeName"] == node
    assert ids(pod) == list(range(9))
    assert ids(pod, "NEURON_DEVS") == [0, 1, 2]
    annotations = pod["metadata"]["annotations"]
    assert annotations["NEURON_RESOURCE_TYPE"] == NEURONCORE
    assert annotations["NEURON_ALLOCATED"] == "false"
    assert annotations["NEURON_NODE"] == node
    scenario.wait_event("nrt-test", "NeuronAllocated", "0,1,2,3,4,5,6,7,8")


def test_trn1_seven_devices_stays_pending_with_the_warning(scenario: Scenario) -> None:
    scenario.add_node("trn1.32xlarge")
    scenario.create_pod("seven", {NEURON: 7})
    event = scenario.wait_event("seven", "FailedScheduling", WARNING_7)
    assert WARNING_7 in event["message"]
    assert not scenario.pod("seven")["spec"].get("nodeName")


def test_ring_three_device_stream_is_always_contiguous(scenario: Scenario) -> None:
    nodes = [scenario.add_node("inf2.48xlarge") for _ in range(2)]
    for i in range(8):
        scenario.create_pod(f"ring-{i}", {NEURON: 3})
    for i in range(8):
        pod = scenario.wait_bound(f"ring-{i}")
        got = ids(pod)
        assert len(got) == 3
        assert all((b - a) % 12 == 1 for a, b in itertools.pairwise(got)), got
    per_node: dict[str, set[int]] = {n: set() for n in nodes}
    for pod in scenario.pods():
        taken = set(ids(pod))
        assert not per_node[pod["spec"]["nodeName"]] & taken
        per_node[pod["spec"]["nodeName"]] |= taken


def test_prioritize_after_a_filter_is_answered_from_it(scenario: Scenario, mode: bool) -> None:
    """kube-scheduler's prioritize is, byte for byte, its filter request with the nodes that
    passed (wire.next_request; issue 50: the extender then answers from what filter kept). Pods
    one at a time, so no bind lands between a pod's two calls. With whole NodeLists
    (nodeCacheCapable false) every prioritize is judged."""
    for _ in range(2):
        scenario.add_node("inf2.48xlarge")
    extender = scenario.stack.extender
    calls = 'neuron_scheduler_request_seconds_count{verb="prioritize"}'
    before = extender.metric(calls)
    kept = extender.metric("neuron_scheduler_prioritize_from_filter_total")
    for i in range(3):
        scenario.create_pod(f"one-{i}", {NEURON: 2})
        scenario.wait_bound(f"one-{i}")
    assert extender.metric(calls) - before >= 3
    answered = extender.metric("neuron_scheduler_prioritize_from_filter_total") - kept
    assert (answered >= 1) if mode else (answered == 0)


def test_torus_rows_and_halves(scenario: Scenario) -> None:
    scenario.add_node("trn1.32xlarge")
    scenario.create_pod("half", {NEURON: 8})
    half = ids(scenario.wait_bound("half"))
    assert half in (list(range(8)), list(range(8, 16)))
    for i in range(2):
        scenario.create_pod(f"row-{i}", {NEURON: 4})
    rows = sorted(ids(scenario.wait_bound(f"row-{i}")) for i in range(2))
    other = [d for d in range(16) if d not in half]
    assert rows == [other[:4], other[4:]]


def test_deleting_a_pod_frees_its_ids(scenario: Scenario) -> None:
    scenario.add_node("inf2.24xlarge")
    scenario.create_pod("all", {NEURON: 6})
    assert ids(scenario.wait_bound("all")) == [0, 1, 2, 3, 4, 5]
    scenario.create_pod("next", {NEURON: 2})
    scenario.wait_event("next", "FailedScheduling")
    scenario.delete_pod("all")
    assert ids(scenario.wait_bound("next", seconds=90)) == [0, 1]


def test_pods_without_neuron_skip_the_extender(scenario: Scenario) -> None:
    node = scenario.add_node("inf1.6xlarge")
    before = scenario.stack.extender.metric('neuron_scheduler_request_seconds_count{verb="filter"}')
    scenario.create_pod("web", {"cpu": 1})
    assert scenario.wait_bound("web")["spec"]["nodeName"] == node
    after = scenario.stack.extender.metric('neuron_scheduler_request_seconds_count{verb="filter"}')
    assert after == before
    assert "AWS_NEURON_IDS" not in scenario.pod("web")["metadata"].get("annotations", {})


def test_other_annotations_are_kept(scenario: Scenario) -> None:
    scenario.add_node("inf1.6xlarge")
    scenario.create_pod("tagged", {NEURONCORE: 2}, annotations={"team.example/owner": "ml"})
    pod = scenario.wait_bound("tagged")
    assert pod["metadata"]["annotations"]["team.example/owner"] == "ml"
    assert ids(pod) == [0, 1]


def test_multi_container_pod_gets_one_contiguous_allocation_split_in_order(
    scenario: Scenario,
) -> None:
    scenario.add_node("inf2.48xlarge")
    scenario.create_pod("multi", [{NEURON: 2}, {"cpu": 1}, {NEURON: 1}])
    pod = scenario.wait_bound("multi")
    assert ids(pod) == [0, 1, 2]
    import json

    slices = json.loads(pod["metadata"]["annotations"]["NEURON_CONTAINER_IDS"])
    assert slices == {"c0": "0,1", "c2": "2"}


def test_restart_rebuilds_the_same_allocations(scenario: Scenario) -> None:
    scenario.add_node("inf1.6xlarge")
    scenario.create_pod("first", {NEURONCORE: 5})
    first = ids(scenario.wait_bound("first"))
    extender = scenario.stack.extender
    extender.kill()
    extender.start()
    scenario.create_pod("second", {NEURONCORE: 5})
    second = ids(scenario.wait_bound("second"))
    assert not set(first) & set(second)
    wait_for(lambda: extender.metric("neuron_scheduler_cached_pods") >= 2, "cache rebuilt")
