"""Annotations against what kubelet's pod resources API says each container holds: reading the
answer, finding the pods that disagree, and correcting them (with a fake lister and an in-memory
API)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import msgspec
import pytest

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.deviceplugin.admission import Withheld, WithheldCause
from neuron_scheduler.deviceplugin.correcting import Corrector
from neuron_scheduler.deviceplugin.holdings import (
    HoldingsError,
    KubeletHoldings,
    holdings_of,
)
from neuron_scheduler.deviceplugin.podresources.v1 import api_pb2
from neuron_scheduler.deviceplugin.reconciling import CORRECTED, review
from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.objects import Pod

NODE = "n1"
INF1 = Catalog.builtin().resolve("inf1.6xlarge", 4, 16).topology  # 4 devices x 4 cores
RESOURCES = frozenset({NEURONCORE, NEURON, NEURONDEVICE})


def pod(
    name: str,
    slices: dict[str, str],
    *,
    version: str = "1",
    resource: str = NEURONCORE,
    init: dict[str, int] | None = None,
    allocated: bool = True,
    node: str = NODE,
    phase: str = "Running",
    alloc_time: int = 0,
    created: str = "2026-11-25T10:00:00Z",
) -> Pod:
    """A pod as the extender annotates it; `slices` is container -> ids in the pod's unit."""
    ids = ",".join(slices.values())
    numbers = [int(i) for i in ids.split(",")]
    if resource == NEURONCORE:
        cores, devices = numbers, sorted({c // 4 for c in numbers})
    else:
        devices, cores = numbers, [c for d in numbers for c in range(d * 4, d * 4 + 4)]

    def spec(items: dict[str, int]) -> list[dict[str, Any]]:
        return [{"name": n, "resources": {"limits": {resource: str(c)}}} for n, c in items.items()]

    return msgspec.convert(
        {
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": f"uid-{name}",
                "resourceVersion": version,
                "creationTimestamp": created,
                "annotations": {
                    "AWS_NEURON_IDS": ids,
                    "NEURON_RESOURCE_TYPE": resource,
                    "NEURON_ALLOC_TIME": str(alloc_time),
                    "NEURON_ALLOCATED": "true" if allocated else "false",
                    "NEURON_NODE": node,
                    "NEURON_CORES": ",".join(map(str, cores)),
                    "NEURON_DEVS": ",".join(map(str, devices)),
                    "NEURON_CONTAINER_IDS": json.dumps(slices),
                },
            },
            "spec": {
                "nodeName": node,
                "containers": spec({c: len(v.split(",")) for c, v in slices.items()}),
                "initContainers": spec(init or {}),
            },
            "status": {"phase": phase},
        },
        Pod,
    )


def listed(*pods: tuple[str, dict[str, dict[str, list[str]]]]) -> list[api_pb2.PodResources]:
    """kubelet's List answer: (pod name, container -> resource -> ids), one entry per id as
    kubelet sends it when the plugin reports topology."""
    return [
        api_pb2.PodResources(
            name=name,
            namespace="ns",
            containers=[
                api_pb2.ContainerResources(
                    name=container,
                    devices=[
                        api_pb2.ContainerDevices(resource_name=resource, device_ids=[i])
                        for resource, ids in held.items()
                        for i in ids
                    ],
                )
                for container, held in containers.items()
            ],
        )
        for name, containers in pods
    ]


def held(*pods: tuple[str, dict[str, dict[str, list[str]]]]) -> KubeletHoldings:
    return holdings_of(listed(*pods), RESOURCES)


def cores(*ids: int) -> dict[str, list[str]]:
    return {NEURONCORE: [str(i) for i in ids]}


# --- reading kubelet's answer -----------------------------------------------------------------


def test_ids_are_gathered_per_container_and_other_resources_dropped() -> None:
    answer = listed(
        ("p", {"main": {NEURONCORE: ["3", "2"], "nvidia.com/gpu": ["GPU-1"]}, "side": {}})
    )
    found = holdings_of(answer, RESOURCES)
    assert found.pods == {("ns", "p"): {"main": {NEURONCORE: (2, 3)}, "side": {}}}
    assert not found.skipped and not found.ambiguous


def test_a_pod_listed_twice_is_ambiguous_and_dropped() -> None:
    found = held(("p", {"main": cores(0, 1)}), ("p", {"main": cores(2, 3)}), ("q", {}))
    assert found.ambiguous == {("ns", "p")}
    assert set(found.pods) == {("ns", "q")}
    # What the two pods of that name hold still counts against every other pod.
    assert found.shadowed == {("ns", "p"): {NEURONCORE: frozenset({0, 1, 2, 3})}}


@pytest.mark.parametrize("ids", [["x"], ["-1"], ["1", "1"], [str(i) for i in range(2000)]], ids=str)
def test_ids_that_are_not_ours_leave_the_pod_out(ids: list[str]) -> None:
    found = held(("p", {"main": {NEURONCORE: ids}}))
    assert found.pods == {}
    assert found.skipped


def test_unusable_names_are_skipped() -> None:
    answer = listed(("", {"main": cores(0)}), ("p", {"": cores(1)}), ("q" * 300, {}))
    found = holdings_of(answer, RESOURCES)
    assert found.pods == {} and len(found.skipped) == 3


# --- comparing -------------------------------------------------------------------------------


def test_a_swapped_pair_is_corrected_to_what_each_container_holds() -> None:
    pods = [pod("a", {"main": "0,1"}), pod("b", {"main": "4,5"})]
    found = review(
        pods, held(("a", {"main": cores(4, 5)}), ("b", {"main": cores(0, 1)})), NODE, INF1
    )
    assert found.agreeing == 0 and not found.problems
    by_pod = {c.pod.metadata.name: c for c in found.corrections}
    assert by_pod["a"].values == {
        "AWS_NEURON_IDS": "4,5",
        "NEURON_CORES": "4,5",
        "NEURON_DEVS": "1",
        "NEURON_CONTAINER_IDS": '{"main":"4,5"}',
        "NEURON_ALLOCATED": "true",
    }
    assert by_pod["b"].values["NEURON_DEVS"] == "0"
    assert by_pod["a"].message.startswith("kubelet admitted this pod in another order")
    assert (
        "container main holds cores 4,5, not the annotated 0,1 (kubelet gave those to ns/b "
        "container main)" in by_pod["a"].message
    )
    assert "did not offer" not in by_pod["a"].message


def test_ids_kubelet_did_not_offer_are_named_as_the_cause() -> None:
    # Pods deleted while kubelet was down still hold 0-3 in its checkpoint: a and b, bound onto
    # them, got 4,5 and 6,7. No container kubelet lists holds 0-3.
    pods = [pod("a", {"main": "0,1"}), pod("b", {"main": "2,3"})]
    kubelet = held(("a", {"main": cores(4, 5)}), ("b", {"main": cores(6, 7)}))
    withheld = {("uid-a", "main"): Withheld((0, 1), offered=12, total=16)}
    by_pod = {
        c.pod.metadata.name: c for c in review(pods, kubelet, NODE, INF1, withheld).corrections
    }
    assert by_pod["a"].message.startswith("kubelet did not offer the annotated ids")
    assert (
        "container main holds cores 4,5, not the annotated 0,1 (kubelet offered 12 of 16 cores)"
        in by_pod["a"].message
    )
    # Without the plugin's record: ids no container holds were not offered either.
    assert by_pod["b"].message.startswith("kubelet did not offer the annotated ids")
    assert "another order" not in by_pod["a"].message + by_pod["b"].message
    assert by_pod["b"].values["AWS_NEURON_IDS"] == "6,7"


def test_a_failed_device_is_named_as_the_cause_with_or_without_the_record() -> None:
    # Device 0 (cores 0-3) failed: kubelet offered it to nobody, so a got 4,5 and b got 8,9.
    pods = [pod("a", {"main": "0,1"}), pod("b", {"main": "2,3"}), pod("c", {"main": "12,13"})]
    kubelet = held(
        ("a", {"main": cores(4, 5)}), ("b", {"main": cores(8, 9)}), ("c", {"main": cores(6, 7)})
    )
    withheld = {("uid-a", "main"): Withheld((0, 1), 12, 16, WithheldCause.FAILED, (0,))}
    found = review(pods, kubelet, NODE, INF1, withheld, unhealthy=0b0001)
    by_pod = {c.pod.metadata.name: c.message for c in found.corrections}
    for name in ("a", "b"):  # b: the plugin restarted since, its record is gone
        assert by_pod[name].startswith(
            "kubelet did not offer the annotated ids: device 0 failed (the device plugin reports "
            "it unhealthy"
        ), by_pod[name]
        assert "restart" not in by_pod[name]
    # c's annotated ids are on a healthy device: without a record, nothing says it failed.
    assert "failed" not in by_pod["c"]


def test_a_record_of_withheld_ids_wins_over_a_later_holder() -> None:
    pods = [pod("a", {"main": "0,1"}), pod("c", {"main": "0,1"}, allocated=False)]
    kubelet = held(("a", {"main": cores(4, 5)}), ("c", {"main": cores(0, 1)}))
    withheld = {("uid-a", "main"): Withheld((0, 1))}
    (correction,) = review(pods, kubelet, NODE, INF1, withheld).corrections
    assert correction.message.startswith("kubelet did not offer")
    assert "(kubelet" not in correction.message


def test_pods_that_agree_or_are_not_admitted_are_left_alone() -> None:
    pods = [
        pod("agrees", {"main": "0,1"}),
        pod("pending", {"main": "2,3"}, allocated=False),  # kubelet has not admitted it
        pod("halfway", {"a": "4,5", "b": "6,7"}, allocated=False),
        pod("elsewhere", {"main": "8,9"}, node="n2"),
        pod("done", {"main": "10,11"}, phase="Succeeded"),
    ]
    kubelet = held(
        ("agrees", {"main": cores(1, 0)}),
        ("halfway", {"a": cores(4, 5), "b": {}}),
        ("elsewhere", {"main": cores(0, 1)}),
        ("done", {"main": cores(0, 1)}),
    )
    found = review(pods, kubelet, NODE, INF1)
    assert found.corrections == () and found.agreeing == 1 and not found.problems


def test_a_pod_kubelet_has_not_started_is_not_given_an_older_pods_ids_of_its_name() -> None:
    # web-0 recreated (new uid, new ids) before kubelet has seen the old web-0 go: kubelet's
    # List, which names no uid, still shows the old one's cores.
    new = pod("web-0", {"main": "4,5"}, allocated=False)
    kubelet = held(("web-0", {"main": cores(0, 1)}))
    assert review([new], kubelet, NODE, INF1).corrections == ()
    # Once kubelet has started it, its annotations follow what it holds, marked allocated or not
    # (the plugin's mark can be lost).
    started = msgspec.structs.replace(
        new, status=msgspec.structs.replace(new.status, startTime="2026-11-25T10:00:05Z")
    )
    (correction,) = review([started], kubelet, NODE, INF1).corrections
    assert correction.values["AWS_NEURON_IDS"] == "0,1"


def test_each_container_of_a_multi_container_pod_gets_its_own_slice() -> None:
    pods = [pod("pair", {"a": "0,1", "b": "2,3"})]
    (correction,) = review(
        pods, held(("pair", {"a": cores(2, 3), "b": cores(0, 1)})), NODE, INF1
    ).corrections
    assert json.loads(str(correction.values["NEURON_CONTAINER_IDS"])) == {"a": "2,3", "b": "0,1"}
    assert correction.values["AWS_NEURON_IDS"] == "0,1,2,3"


def test_init_containers_reuse_the_app_ids_or_are_left_alone() -> None:
    # kubelet's List leaves out init containers; their ids are the app containers' when the
    # apps need at least as many.
    reused = pod("reused", {"main": "0,1"}, init={"setup": 2})
    (correction,) = review(
        [reused], held(("reused", {"main": cores(8, 9)})), NODE, INF1
    ).corrections
    assert correction.values["AWS_NEURON_IDS"] == "8,9"
    bigger = pod("bigger", {"main": "0,1"}, init={"setup": 4})
    found = review([bigger], held(("bigger", {"main": cores(8, 9)})), NODE, INF1)
    assert found.corrections == () and "init containers" in found.problems[0]


def test_device_pods_are_compared_in_devices() -> None:
    pods = [pod("d", {"train": "0,1"}, resource=NEURON)]
    kubelet = held(("d", {"train": {NEURON: ["2", "3"]}}))
    (correction,) = review(pods, kubelet, NODE, INF1).corrections
    assert correction.values["NEURON_DEVS"] == "2,3"
    assert correction.values["NEURON_CORES"] == "8,9,10,11,12,13,14,15"


@pytest.mark.parametrize(
    ("kubelet", "why"),
    [
        (held(("p", {"main": cores(0, 1, 2)})), "not 2"),
        (held(("p", {"main": cores(40, 41)})), "do not fit"),
        (held(("p", {"main": cores(0, 1)}), ("p", {"main": cores(2, 3)})), "two pods"),
    ],
    ids=["count", "beyond-the-node", "ambiguous"],
)
def test_answers_that_cannot_be_right_change_nothing(kubelet: KubeletHoldings, why: str) -> None:
    found = review([pod("p", {"main": "4,5"})], kubelet, NODE, INF1)
    assert found.corrections == ()
    assert why in found.problems[0]


# --- correcting ------------------------------------------------------------------------------


class FakeLister:
    """kubelet's pod resources, as a test sets them."""

    def __init__(self, answer: KubeletHoldings) -> None:
        self.answer = answer
        self.error: Exception | None = None
        self.during_read: list[Any] = []  # called while "kubelet" answers

    async def read(self) -> KubeletHoldings:
        for action in self.during_read:
            action()
        if self.error is not None:
            raise self.error
        return self.answer


class MemoryPods:
    def __init__(self, pods: list[Pod]) -> None:
        self.pods = {p.metadata.name: p for p in pods}
        self.patches: list[tuple[str, dict[str, str | None], bool]] = []
        self.events: list[tuple[str, str, str]] = []
        self.lists = 0

    async def list_pods(self) -> list[Pod]:
        self.lists += 1
        return list(self.pods.values())

    async def patch_annotations(
        self, pod: Pod, values: dict[str, str | None], *, resource_version: bool
    ) -> None:
        current = self.pods[pod.metadata.name]
        if resource_version and pod.metadata.resourceVersion != current.metadata.resourceVersion:
            raise api_error("PATCH", "/pods", 409, b'{"reason": "Conflict"}')
        raw = msgspec.to_builtins(current)
        raw["metadata"]["annotations"].update(values)
        raw["metadata"]["resourceVersion"] = str(int(current.metadata.resourceVersion) + 1)
        self.pods[pod.metadata.name] = msgspec.convert(raw, Pod)
        self.patches.append((pod.metadata.name, values, resource_version))

    async def record_event(self, pod: Pod, reason: str, message: str) -> None:
        self.events.append((pod.metadata.name, reason, message))

    def bump(self, name: str) -> None:
        raw = msgspec.to_builtins(self.pods[name])
        raw["metadata"]["resourceVersion"] = str(int(raw["metadata"]["resourceVersion"]) + 1)
        self.pods[name] = msgspec.convert(raw, Pod)


SWAPPED = held(("a", {"main": cores(4, 5)}), ("b", {"main": cores(0, 1)}))


def corrector(pods: MemoryPods, lister: FakeLister) -> Corrector:
    async def topology() -> Topology:
        return INF1

    return Corrector(pods, lister, NODE, topology, settle=0.01, interval=3600)  # type: ignore[arg-type]


async def test_corrections_are_preconditioned_patches_with_an_event() -> None:
    pods = MemoryPods([pod("a", {"main": "0,1"}), pod("b", {"main": "4,5"})])
    fixer = corrector(pods, FakeLister(SWAPPED))
    found = await fixer.reconcile()
    assert found is not None and len(found.corrections) == 2
    assert [(name, rv) for name, _, rv in pods.patches] == [("a", True), ("b", True)]
    assert pods.pods["a"].metadata.annotations["AWS_NEURON_IDS"] == "4,5"
    assert pods.pods["b"].metadata.annotations["AWS_NEURON_IDS"] == "0,1"
    assert [(name, reason) for name, reason, _ in pods.events] == [
        ("a", CORRECTED),
        ("b", CORRECTED),
    ]
    assert fixer.corrected == 2
    # Now they agree: a second pass writes nothing.
    again = await fixer.reconcile()
    assert again is not None and again.agreeing == 2 and len(pods.patches) == 2


async def test_a_pod_changed_meanwhile_is_not_overwritten() -> None:
    pods = MemoryPods([pod("a", {"main": "0,1"}), pod("b", {"main": "4,5"})])
    fixer = corrector(pods, FakeLister(SWAPPED))
    original_list = pods.list_pods

    async def list_then_bump() -> list[Pod]:
        listed_pods = await original_list()
        pods.bump("a")  # someone writes "a" after the pass read it
        return listed_pods

    pods.list_pods = list_then_bump  # type: ignore[method-assign]
    await fixer.reconcile()
    assert [name for name, _, _ in pods.patches] == ["b"]
    assert pods.pods["a"].metadata.annotations["AWS_NEURON_IDS"] == "0,1"
    assert [name for name, _, _ in pods.events] == ["b"]


async def test_a_pass_overlapping_an_allocate_is_dropped() -> None:
    pods = MemoryPods([pod("a", {"main": "0,1"}), pod("b", {"main": "4,5"})])
    lister = FakeLister(SWAPPED)
    fixer = corrector(pods, lister)
    lister.during_read.append(fixer.allocating)
    assert await fixer.reconcile() is None
    assert pods.patches == []


async def test_an_unreadable_socket_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    pods = MemoryPods([pod("a", {"main": "0,1"})])
    lister = FakeLister(KubeletHoldings())
    lister.error = HoldingsError("/x/kubelet.sock does not exist")
    fixer = corrector(pods, lister)
    with caplog.at_level(logging.WARNING, "neuron_scheduler"):
        assert await fixer.reconcile() is None
        assert await fixer.reconcile() is None
    assert [r.getMessage() for r in caplog.records].count(
        "cannot compare annotations with kubelet's pod resources: /x/kubelet.sock does not exist"
    ) == 1


async def test_run_corrects_soon_after_an_allocate_and_stops() -> None:
    pods = MemoryPods([pod("a", {"main": "0,1"}), pod("b", {"main": "4,5"})])
    fixer = corrector(pods, FakeLister(SWAPPED))
    stop = asyncio.Event()
    task = asyncio.create_task(fixer.run(stop))
    fixer.allocating()
    fixer.allocating()
    for _ in range(200):
        if fixer.corrected == 2:
            break
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert fixer.corrected == 2


async def test_an_unchanged_agreeing_answer_does_not_ask_the_api_again() -> None:
    pods = MemoryPods([pod("a", {"main": "0,1"}), pod("b", {"main": "4,5"})])
    lister = FakeLister(SWAPPED)
    fixer = corrector(pods, lister)
    await fixer.reconcile()  # corrects: the next pass must read the API again
    await fixer.reconcile()  # agrees
    assert pods.lists == 2
    for _ in range(3):
        found = await fixer.reconcile()
        assert found is not None and found.agreeing == 2
    assert pods.lists == 2
    lister.answer = held(("a", {"main": cores(4, 5)}))  # b is gone from kubelet
    await fixer.reconcile()
    assert pods.lists == 3


async def test_a_pod_kubelet_starts_after_a_pass_is_corrected_though_kubelet_says_the_same() -> (
    None
):
    """b, admitted without the plugin's allocated mark (a crash), is not compared while kubelet
    has not recorded its start; that pass agrees on nothing else to do, and kubelet's answer
    stays the same: the next pass still lists the pods again, and corrects b once it started."""
    b = pod("b", {"main": "4,5"}, allocated=False)
    pods = MemoryPods([b])
    fixer = corrector(pods, FakeLister(held(("b", {"main": cores(0, 1)}))))
    found = await fixer.reconcile()
    assert found is not None and found.unstarted == 1 and not found.corrections
    pods.pods["b"] = msgspec.structs.replace(
        b, status=msgspec.structs.replace(b.status, startTime="2026-11-25T10:00:05Z")
    )
    found = await fixer.reconcile()
    assert pods.lists == 2 and found is not None and len(found.corrections) == 1
