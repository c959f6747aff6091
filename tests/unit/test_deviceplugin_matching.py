"""Matching kubelet's id-only requests to the containers the scheduler annotated."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NEURONCORE, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.deviceplugin.assigning import container_response
from neuron_scheduler.deviceplugin.matching import (
    ALLOCATED_CONTAINERS,
    Matched,
    NodeView,
    Rejected,
    Unclaimed,
    decide_allocation,
    kubelet_ids,
    node_view,
    preferred_ids,
)
from neuron_scheduler.kube.objects import Pod

NODE = "n1"
INF2 = Catalog.builtin().resolve("inf2.48xlarge", 12, 24).topology
TRN1 = Catalog.builtin().resolve("trn1.32xlarge", 16, 32).topology


def pod(
    name: str,
    resource: str,
    containers: dict[str, int],
    ids: str | None = None,
    *,
    slices: dict[str, str] | None = None,
    node: str = NODE,
    alloc_time: int = 0,
    allocated: bool = False,
    extra: dict[str, str] | None = None,
    init: dict[str, int] | None = None,
    phase: str = "Pending",
    deleting: bool = False,
) -> Pod:
    annotations: dict[str, str] = {}
    if ids is not None:
        annotations = {
            "AWS_NEURON_IDS": ids,
            "NEURON_RESOURCE_TYPE": resource,
            "NEURON_ALLOC_TIME": str(alloc_time),
            "NEURON_ALLOCATED": "true" if allocated else "false",
            "NEURON_NODE": node,
        }
        if resource == NEURONCORE:
            annotations["NEURON_CORES"] = ids
            annotations["NEURON_DEVS"] = ",".join(
                sorted({str(int(c) // 2) for c in ids.split(",")}, key=int)
            )
        if slices is not None:
            annotations["NEURON_CONTAINER_IDS"] = json.dumps(slices)
    annotations.update(extra or {})

    def spec(items: dict[str, int]) -> list[dict[str, Any]]:
        return [{"name": n, "resources": {"limits": {resource: str(c)}}} for n, c in items.items()]

    metadata: dict[str, Any] = {
        "name": name,
        "namespace": "ns",
        "uid": f"uid-{name}",
        "annotations": annotations,
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return msgspec.convert(
        {
            "metadata": metadata,
            "spec": {
                "nodeName": node,
                "containers": spec(containers),
                "initContainers": spec(init or {}),
            },
            "status": {"phase": phase},
        },
        Pod,
    )


def view(*pods: Pod) -> NodeView:
    return node_view(pods, NODE, INF2)


def decide(v: NodeView, unit: Unit, ids: list[int], topology: Topology = INF2) -> object:
    return decide_allocation(v, unit, ids, 2, topology)


def test_ids_decide_not_bind_order() -> None:
    # The oldest pending pod of that size is "first"; kubelet is starting "second".
    v = view(
        pod("first", NEURONCORE, {"main": 2}, "4,5", slices={"main": "4,5"}, alloc_time=1),
        pod("second", NEURONCORE, {"main": 2}, "6,7", slices={"main": "6,7"}, alloc_time=2),
    )
    decision = decide(v, Unit.CORE, [7, 6])
    assert isinstance(decision, Matched)
    assert decision.slot.pod == "ns/second" and decision.slot.container == "main"
    assert not decision.again


def test_each_container_matches_its_own_slice() -> None:
    v = view(pod("pair", NEURONCORE, {"a": 2, "b": 2}, "0,1,2,3", slices={"a": "0,1", "b": "2,3"}))
    decision = decide(v, Unit.CORE, [2, 3])
    assert isinstance(decision, Matched) and decision.slot.container == "b"
    assert decision.holding.slot_names == {"a", "b"}


def test_ids_of_another_pod_are_refused_even_across_resources() -> None:
    v = view(pod("ours", NEURONCORE, {"main": 2}, "2,3", slices={"main": "2,3"}))
    for unit, ids in ((Unit.CORE, [3, 4]), (Unit.DEVICE, [1])):
        decision = decide(v, unit, ids)
        assert isinstance(decision, Rejected)
        assert "ns/ours" in decision.message and "my-scheduler" in decision.message


def test_ids_that_break_the_topology_rule_are_refused() -> None:
    decision = decide(view(), Unit.DEVICE, [1, 2], TRN1)
    assert isinstance(decision, Rejected)
    assert "trn1.32xlarge" in decision.message and "my-scheduler" in decision.message
    assert isinstance(decide(view(), Unit.CORE, [0, 3]), Rejected)


def test_valid_ids_nobody_holds_are_accepted_unclaimed() -> None:
    assert isinstance(decide(view(), Unit.DEVICE, [4, 5, 6, 7], TRN1), Unclaimed)
    assert isinstance(decide(view(), Unit.CORE, [11, 0]), Rejected)  # cores do not wrap
    assert isinstance(decide(view(), Unit.DEVICE, [11, 0]), Unclaimed)  # inf2 devices do


def test_an_allocated_slice_matches_again_for_a_retry() -> None:
    v = view(pod("done", NEURONCORE, {"main": 2}, "0,1", slices={"main": "0,1"}, allocated=True))
    decision = decide(v, Unit.CORE, [0, 1])
    assert isinstance(decision, Matched) and decision.again


def test_handed_out_containers_are_not_matched_twice() -> None:
    v = view(
        pod("a", NEURONCORE, {"main": 2}, "0,1", slices={"main": "0,1"}, alloc_time=1),
        pod("b", NEURONCORE, {"main": 2}, "0,1", slices={"main": "0,1"}, alloc_time=2),
    )
    decision = decide_allocation(v, Unit.CORE, [0, 1], 2, INF2, frozenset({("uid-a", "main")}))
    assert isinstance(decision, Matched) and decision.slot.pod == "ns/b"


def test_node_view_ignores_what_cannot_hold_ids() -> None:
    v = view(
        pod("elsewhere", NEURONCORE, {"m": 2}, "0,1", node="n2"),
        pod("finished", NEURONCORE, {"m": 2}, "2,3", phase="Succeeded"),
        pod("never-started", NEURONCORE, {"m": 2}, "4,5", deleting=True),
        pod("stopping", NEURONCORE, {"m": 2}, "6,7", deleting=True, allocated=True),
        pod("plain", NEURONCORE, {"m": 2}),
        pod("broken", NEURONCORE, {"m": 2}, extra={"AWS_NEURON_IDS": "x"}),
    )
    assert [h.pod for h in v.holdings] == ["ns/stopping"]
    assert not v.holdings[0].pending
    assert len(v.unreadable) == 1 and "ns/broken" in v.unreadable[0]


def test_upstream_annotations_split_by_container_and_init_containers_come_first() -> None:
    upstream = pod("up", NEURON, {"a": 1, "b": 2}, "3,4,5", init={"setup": 2})
    (holding,) = view(upstream).holdings
    assert [(s.container, s.ids) for s in holding.slots] == [
        ("setup", (3, 4)),
        ("a", (3,)),
        ("b", (4, 5)),
    ]


def test_app_containers_reusing_init_ids_belong_to_the_pod_being_admitted() -> None:
    p = pod(
        "warm",
        NEURONCORE,
        {"a": 2, "b": 2},
        "10,11,12,13",
        slices={"a": "10,11", "b": "12,13"},
        init={"warmup": 4},
        extra={ALLOCATED_CONTAINERS: "warmup"},
    )
    # kubelet hands app containers the init container's ids in its own order, so a request need
    # not equal a slice; ids within the pod that is mid-admission are that pod's.
    decision = decide(view(p), Unit.CORE, [11, 12])
    assert isinstance(decision, Matched)
    assert decision.slot.container == "a" and decision.slot.pod == "ns/warm"
    stranger = pod("other", NEURONCORE, {"m": 2}, "14,15", slices={"m": "14,15"})
    assert isinstance(decide(view(p, stranger), Unit.CORE, [13, 14]), Rejected)


def test_progress_of_a_multi_container_pod() -> None:
    p = pod(
        "pair",
        NEURONCORE,
        {"a": 2, "b": 2},
        "0,1,2,3",
        slices={"a": "0,1", "b": "2,3"},
        extra={ALLOCATED_CONTAINERS: "a"},
    )
    (holding,) = view(p).holdings
    assert holding.pending
    assert [(s.container, s.allocated) for s in holding.slots] == [("a", True), ("b", False)]


def test_preference_is_a_pending_slice_of_that_size_within_what_is_offered() -> None:
    v = view(
        pod("big", NEURONCORE, {"m": 4}, "8,9,10,11", slices={"m": "8,9,10,11"}, alloc_time=1),
        pod("late", NEURONCORE, {"m": 2}, "6,7", slices={"m": "6,7"}, alloc_time=3),
        pod("early", NEURONCORE, {"m": 2}, "4,5", slices={"m": "4,5"}, alloc_time=2),
    )
    every = list(range(24))
    choice = preferred_ids(v, Unit.CORE, every, [], 2, 2, INF2)
    ids, slot = choice.ids, choice.slot
    assert ids == (4, 5) and slot is not None and slot.pod == "ns/early"
    ids = preferred_ids(v, Unit.CORE, [c for c in every if c != 4], [], 2, 2, INF2).ids
    assert ids == (6, 7)
    ids = preferred_ids(v, Unit.CORE, every, [6], 2, 2, INF2).ids
    assert ids == (6, 7)
    ids = preferred_ids(v, Unit.CORE, every, [], 2, 2, INF2, [("uid-early", "m")]).ids
    assert ids == (6, 7)


def test_preference_without_a_matching_pod_avoids_everyone_and_obeys_topology() -> None:
    v = view(pod("held", NEURON, {"m": 4}, "0,1,2,3", slices={"m": "0,1,2,3"}, allocated=True))
    choice = preferred_ids(v, Unit.DEVICE, list(range(16)), [], 4, 2, TRN1)
    ids, slot = choice.ids, choice.slot
    assert slot is None
    assert sorted(ids) in ([4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15])
    ids = preferred_ids(view(), Unit.CORE, [0, 1, 2, 5, 6, 7], [], 3, 2, INF2).ids
    assert list(ids) in ([0, 1, 2], [5, 6, 7])


def test_parse_ids() -> None:
    assert kubelet_ids(["3", "1"]) == (3, 1)
    assert kubelet_ids(["a"]) is None
    assert kubelet_ids(["1", "1"]) is None
    assert kubelet_ids(["-1"]) is None


def test_container_response_for_cores_and_devices() -> None:
    cores = container_response(Unit.CORE, [3, 2], 2)
    assert [(d.container_path, d.host_path, d.permissions) for d in cores.devices] == [
        ("/dev/neuron1", "/dev/neuron1", "rw")
    ]
    assert dict(cores.envs) == {"NEURON_RT_VISIBLE_CORES": "2,3"}
    devices = container_response(Unit.DEVICE, [5, 4], 2)
    assert [d.host_path for d in devices.devices] == ["/dev/neuron4", "/dev/neuron5"]
    assert dict(devices.envs) == {
        "NEURON_RT_VISIBLE_CORES": "8,9,10,11",
        "AWS_NEURON_VISIBLE_DEVICES": "4,5",
    }


def test_ids_the_node_does_not_have_are_never_handed_out() -> None:
    """Any pod may carry annotations: ids beyond this node's cores make the pod unreadable
    here (logged once by the assigner), and kubelet's offer of those ids matches nobody."""
    beyond = pod("beyond", NEURONCORE, {"main": 2}, "30,31", slices={"main": "30,31"})
    v = view(beyond)  # INF2: 24 cores
    assert not v.holdings
    assert len(v.unreadable) == 1 and "ns/beyond" in v.unreadable[0]
    assert "do not exist on inf2.48xlarge" in v.unreadable[0]
    assert isinstance(decide(v, Unit.CORE, [22, 23]), Unclaimed)  # not matched to that pod


def test_ids_beyond_what_the_pod_requests_are_never_handed_out() -> None:
    """Its creator may write any ids: a one-core pod naming eight cores (four devices) would
    otherwise count as their holder here, and each of them could be matched to it. Unreadable
    instead, like ids the node does not have; a pod of the right size beside it is matched."""
    grab = pod(
        "grab", NEURONCORE, {"main": 1}, "0,1,2,3,4,5,6,7", slices={"main": "0,1,2,3,4,5,6,7"}
    )
    fair = pod("fair", NEURONCORE, {"main": 2}, "8,9", slices={"main": "8,9"})
    v = view(grab, fair)
    assert [h.pod for h in v.holdings] == ["ns/fair"]
    assert len(v.unreadable) == 1 and "ns/grab" in v.unreadable[0]
    assert "ids for 8 cores, more than the pod's 1 core" in v.unreadable[0]
    assert isinstance(decide(v, Unit.CORE, [2, 3]), Unclaimed)  # not matched to the grab
    assert not isinstance(decide(v, Unit.CORE, [8, 9]), Unclaimed)  # the fair pod's own


def test_ids_on_a_pod_asking_for_none_or_not_matching_its_cores_are_never_handed_out() -> None:
    """A pod asking for no Neuron resource holds none whatever its annotations say; a device pod
    whose NEURON_CORES leave out half its device would leave that half to another pod, and is
    unreadable as well."""
    none = pod("none", NEURONCORE, {"main": 1}, "4", slices={"main": "4"})
    none.spec.containers[0].resources.limits = {}
    half = pod("half", NEURON, {"main": 1}, "3", extra={"NEURON_CORES": "6", "NEURON_DEVS": "3"})
    v = view(none, half)
    assert not v.holdings
    problems = sorted(v.unreadable)
    assert problems[0] == (
        "ns/half: AWS_NEURON_IDS 3, NEURON_CORES 6 and NEURON_DEVS 3 do not name the same devices"
    )
    assert problems[1] == "ns/none: ids on a pod that requests no Neuron resource"
    assert isinstance(decide(v, Unit.CORE, [4]), Unclaimed)
