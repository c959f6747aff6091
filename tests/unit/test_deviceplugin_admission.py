"""Which pod kubelet is admitting: its pod resources first, then its own order (single additions
by binding, its start batch by creation second), and ids it does not offer."""

from __future__ import annotations

import logging

import pytest

from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE, Unit
from neuron_scheduler.deviceplugin.admission import (
    UNRANKED,
    KubeletView,
    Stage,
    Withheld,
    WithheldCause,
    arrival,
    version_rank,
)
from neuron_scheduler.deviceplugin.assigning import AllocationError, Assigner, ContainerRequest
from neuron_scheduler.deviceplugin.devicewatch import DeviceState
from neuron_scheduler.deviceplugin.holdings import HoldingsError, KubeletHoldings, kubelet_view
from neuron_scheduler.deviceplugin.inventory import DeviceHealth
from neuron_scheduler.deviceplugin.matching import (
    Matched,
    Rejected,
    decide_allocation,
    node_view,
    preferred_ids,
)
from neuron_scheduler.deviceplugin.reconciling import CORRECTED
from neuron_scheduler.kube.objects import Node, Pod
from tests.unit.test_deviceplugin_reconciling import (
    INF1,
    NODE,
    FakeLister,
    MemoryPods,
    cores,
    corrector,
    held,
    pod,
)

EVERY_CORE = list(range(16))


def pending(name: str, ids: str, *, version: str, created: str = "2026-11-25T10:00:00Z") -> Pod:
    return pod(name, {"main": ids}, version=version, allocated=False, created=created)


def kubelet_lists(*pods: tuple[str, dict[str, dict[str, list[str]]]]) -> KubeletView:
    return kubelet_view(held(*pods))


def prefer(pods: list[Pod], kubelet: KubeletView, available: list[int] = EVERY_CORE) -> object:
    view = node_view(pods, NODE, INF1)
    return preferred_ids(view, Unit.CORE, available, [], 2, 4, INF1, (), kubelet)


# --- kubelet's own order ---------------------------------------------------------------------


def test_single_additions_go_in_binding_order_whatever_the_bind_time() -> None:
    # "late" took its ids first (older NEURON_ALLOC_TIME) but its binding reached the API
    # server after "early"'s: kubelet's watch delivers "early" first.
    late = pod("late", {"main": "0,1"}, version="20", allocated=False, alloc_time=1)
    early = pod("early", {"main": "2,3"}, version="19", allocated=False, alloc_time=2)
    choice = prefer([late, early], KubeletView())
    assert choice.slot is not None and choice.slot.pod == "ns/early" and choice.ids == (2, 3)


def test_the_start_batch_goes_first_and_by_creation_second() -> None:
    # Created earlier, bound later: within kubelet's start batch creation time decides...
    older = pending("older", "0,1", version="30", created="2026-11-25T10:00:00Z")
    newer = pending("newer", "2,3", version="29", created="2026-11-25T10:00:01Z")
    bound_after = pending("after", "4,5", version="5", created="2026-11-25T09:00:00Z")
    batch = KubeletView(None, frozenset({"uid-older", "uid-newer"}))
    choice = prefer([older, newer, bound_after], batch)
    assert choice.slot is not None and choice.slot.pod == "ns/older"
    # ... and outside it, the binding.
    choice = prefer([older, newer], KubeletView())
    assert choice.slot is not None and choice.slot.pod == "ns/newer"


def test_a_resource_version_that_is_not_a_revision_ranks_last() -> None:
    assert version_rank(pod("p", {"main": "0"}, version="12")) == 12
    for odd in ("", "abc", "1e5", "²", "9" * 40):
        assert version_rank(pod("p", {"main": "0"}, version=odd)) == UNRANKED
    assert arrival(pod("p", {"main": "0"}, created="yesterday"), 0).created == UNRANKED


# --- what kubelet's pod resources say ------------------------------------------------------


def test_the_pod_kubelet_lists_without_ids_is_the_one_it_admits() -> None:
    # Same creation second, so kubelet's batch order is its map's: b came first this time. It
    # has taken b into its pod manager and not a (later in the batch).
    a = pending("a", "0,1", version="10")
    b = pending("b", "2,3", version="11")
    choice = prefer([a, b], kubelet_lists(("b", {"main": {}}), ("running", {"main": cores(8, 9)})))
    assert choice.slot is not None and choice.slot.pod == "ns/b" and choice.ids == (2, 3)
    assert not choice.withheld
    # Then a, once b holds its ids.
    choice = prefer(
        [a, b], kubelet_lists(("b", {"main": cores(2, 3)}), ("a", {"main": {}})), [0, 1, 4, 5]
    )
    assert choice.slot is not None and choice.slot.pod == "ns/a" and choice.ids == (0, 1)


def test_stages_from_the_listing() -> None:
    view = kubelet_lists(("a", {"main": {}}), ("b", {"main": cores(2, 3)}))
    slots = {
        s.pod: s
        for h in node_view(
            [
                pending("a", "0,1", version="1"),
                pending("b", "2,3", version="2"),
                pending("c", "4,5", version="3"),
            ],
            NODE,
            INF1,
        ).holdings
        for s in h.slots
    }
    assert slots["ns/a"].stage(Unit.CORE, view) is Stage.ADMITTING
    assert slots["ns/b"].stage(Unit.CORE, view) is Stage.SERVED
    assert slots["ns/c"].stage(Unit.CORE, view) is Stage.NOT_ADDED
    assert slots["ns/c"].stage(Unit.CORE, KubeletView()) is Stage.UNKNOWN
    # Init containers are not listed: one is served while no container of its pod holds ids.
    init = pod("i", {"main": "6,7"}, init={"setup": 2}, allocated=False)
    (holding,) = node_view([init], NODE, INF1).holdings
    setup = holding.slots[0]
    assert setup.init and setup.container == "setup"
    assert setup.stage(Unit.CORE, kubelet_lists(("i", {"main": {}}))) is Stage.ADMITTING
    assert setup.stage(Unit.CORE, kubelet_lists(("i", {"main": cores(6, 7)}))) is Stage.SERVED


def test_when_kubelet_admits_none_of_them_nobodys_ids_are_preferred() -> None:
    # kubelet is admitting a pod placed without the scheduler: the pending pods keep their ids.
    a = pending("a", "0,1", version="10")
    choice = prefer([a], kubelet_lists(("stray", {"main": {}})))
    assert choice.slot is None and not set(choice.ids) & {0, 1}


def test_annotated_ids_kubelet_does_not_offer_are_avoided_and_said() -> None:
    # kubelet still counts 0-3 for pods deleted while it was down.
    a = pending("a", "0,1", version="10")
    b = pending("b", "2,3", version="11")
    choice = prefer([a, b], kubelet_lists(("a", {"main": {}})), list(range(4, 16)))
    assert choice.slot is not None and choice.slot.pod == "ns/a" and choice.withheld
    assert len(choice.ids) == 2 and min(choice.ids) >= 4


def test_a_container_kubelet_allocates_again_gets_its_annotated_ids() -> None:
    # Admitted before, its device record lost: kubelet asks again at container start.
    admitted = pod("admitted", {"main": "4,5"}, version="3")
    choice = prefer([admitted], kubelet_lists(("admitted", {"main": {}})))
    assert choice.slot is not None and choice.slot.pod == "ns/admitted" and choice.ids == (4, 5)
    # A pending pod kubelet admits goes before it.
    new = pending("new", "0,1", version="9")
    choice = prefer([admitted, new], kubelet_lists(("admitted", {"main": {}}), ("new", {})))
    assert choice.slot is not None and choice.slot.pod == "ns/new"


def decide(pods: list[Pod], ids: list[int], kubelet: KubeletView) -> object:
    view = node_view(pods, NODE, INF1)
    return decide_allocation(view, Unit.CORE, ids, 4, INF1, frozenset(), kubelet)


def test_other_ids_for_the_pod_kubelet_admits_are_its_when_legal_and_nobody_elses() -> None:
    a = pending("a", "0,1", version="10")
    b = pending("b", "2,3", version="11")
    admitting_a = kubelet_lists(("a", {"main": {}}))
    decision = decide([a, b], [4, 5], admitting_a)
    assert isinstance(decision, Matched) and decision.substitute and not decision.again
    assert decision.slot.pod == "ns/a"
    # Another pod's annotated ids are never given as a substitute.
    refused = decide([a, b, pod("c", {"main": "4,5"})], [5, 6], admitting_a)
    assert isinstance(refused, Rejected) and "ns/c holds core 5" in refused.message
    # Without pod resources the plugin cannot name the pod: as before, the ids are refused when
    # they overlap someone's and accepted as unclaimed otherwise.
    assert not isinstance(decide([a, b], [4, 5], KubeletView()), Matched)


def test_device_pods_use_device_resources() -> None:
    d = pod("d", {"main": "1"}, resource=NEURON, version="4", allocated=False)
    view = node_view([d], NODE, INF1)
    kubelet = kubelet_lists(("d", {"main": {NEURONCORE: ["0"]}}))  # cores are not devices
    choice = preferred_ids(view, Unit.DEVICE, [0, 1, 2, 3], [], 1, 4, INF1, (), kubelet)
    assert choice.slot is not None and choice.ids == (1,)


# --- the Assigner asks kubelet on each call ----------------------------------------------------


class Pods(MemoryPods):
    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        return self.pods.get(name)

    async def get_node(self) -> Node | None:
        return None


def inf1() -> DeviceState:
    return DeviceState(4, {d: DeviceHealth(d, True) for d in range(4)})


async def test_withheld_ids_end_in_an_event_that_says_so(caplog: pytest.LogCaptureFixture) -> None:
    pods = Pods([pending("a", "0,1", version="10"), pending("b", "2,3", version="11")])
    kubelet = FakeLister(held(("a", {"main": {}})))
    subject = Assigner(pods, NODE, inf1(), kubelet=kubelet)  # type: ignore[arg-type]
    offered = tuple(str(i) for i in range(4, 16))
    with caplog.at_level(logging.WARNING, "neuron_scheduler.deviceplugin"):
        (ids,) = await subject.preferred(NEURONCORE, [ContainerRequest(offered, (), 2)])
    assert "kubelet is admitting ns/a container main but did not offer its annotated core 0,1 " in (
        caplog.text
    )
    assert "(it offered 12 of 16)" in caplog.text
    await subject.allocate(NEURONCORE, Unit.CORE, [ids])
    # No kubelet restart was seen: kubelet counted them as in use.
    assert subject.withheld == {("uid-a", "main"): Withheld((0, 1), 12, 16, WithheldCause.IN_USE)}
    assert pods.pods["a"].metadata.annotations["NEURON_ALLOCATED"] == "true"
    # b: kubelet offers exactly two cores, so it asks no preference; it allocates 6,7.
    kubelet.answer = held(("a", {"main": cores(*map(int, ids))}), ("b", {"main": {}}))
    rest = [str(i) for i in range(4, 8) if str(i) not in ids]
    await subject.allocate(NEURONCORE, Unit.CORE, [rest])
    assert ("uid-b", "main") in subject.withheld
    kubelet.answer = held(
        ("a", {"main": cores(*map(int, ids))}), ("b", {"main": cores(*map(int, rest))})
    )

    fixer = corrector(pods, kubelet)
    fixer.withheld = subject.withheld
    await fixer.reconcile()
    assert [(n, r) for n, r, _ in pods.events] == [("a", CORRECTED), ("b", CORRECTED)]
    assert all(m.startswith("kubelet did not offer") for _, _, m in pods.events)
    assert "kubelet offered 12 of 16 cores" in pods.events[0][2]
    await subject.close()


async def test_an_unreadable_pod_resources_socket_falls_back_to_the_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pods = Pods([pending("a", "0,1", version="10"), pending("b", "2,3", version="11")])
    kubelet = FakeLister(KubeletHoldings())
    kubelet.error = HoldingsError("/x/kubelet.sock does not exist")
    subject = Assigner(pods, NODE, inf1(), kubelet=kubelet)  # type: ignore[arg-type]
    every = tuple(str(i) for i in range(16))
    with caplog.at_level(logging.WARNING, "neuron_scheduler.deviceplugin"):
        for _ in range(2):
            assert await subject.preferred(NEURONCORE, [ContainerRequest(every, (), 2)]) == [
                ["0", "1"]
            ]
    assert caplog.text.count("cannot ask kubelet which pod it is admitting") == 1
    await subject.close()


async def test_kubelet_start_takes_the_pods_bound_by_then_as_its_batch() -> None:
    older = pending("older", "0,1", version="30", created="2026-11-25T10:00:00Z")
    newer = pending("newer", "2,3", version="29", created="2026-11-25T10:00:01Z")
    pods = Pods([older, newer])
    subject = Assigner(pods, NODE, inf1())  # type: ignore[arg-type]
    every = tuple(str(i) for i in range(16))
    assert await subject.preferred(NEURONCORE, [ContainerRequest(every, (), 2)]) == [["2", "3"]]
    await subject.kubelet_started()
    assert await subject.preferred(NEURONCORE, [ContainerRequest(every, (), 2)]) == [["0", "1"]]
    await subject.close()


# --- ids another pod holds through another resource ----------------------------------------------
# kubelet keeps ids apart within one resource only: to it, device 0 of `neuron` and cores 0-3 of
# `neuroncore` are unrelated. A pod placed without the scheduler holds ids no annotation records.


def device_pod(name: str, ids: str, version: str = "20") -> Pod:
    return pod(name, {"main": ids}, resource=NEURON, version=version, allocated=False)


def decide_devices(pods: list[Pod], ids: list[int], kubelet: KubeletView) -> object:
    view = node_view(pods, NODE, INF1)
    return decide_allocation(view, Unit.DEVICE, ids, 4, INF1, frozenset(), kubelet)


def test_annotated_ids_another_pod_holds_through_another_resource_are_refused() -> None:
    d = device_pod("d", "0")
    kubelet = kubelet_lists(("stray", {"main": cores(1, 2)}), ("d", {"main": {}}))
    refused = decide_devices([d], [0], kubelet)
    assert isinstance(refused, Rejected)
    assert "pod ns/d container main" in refused.message
    assert "ns/stray holds cores 1,2" in refused.message and "my-scheduler" in refused.message
    # Ids no assignment names are refused the same way, and accepted where nobody is.
    assert isinstance(decide_devices([], [0], kubelet), Rejected)
    assert not isinstance(decide_devices([d], [1], kubelet), Rejected)
    # Without pod resources nothing is known of them.
    assert isinstance(decide_devices([d], [0], KubeletView()), Matched)


def test_a_pods_own_listed_ids_are_its_own_unless_its_name_is_listed_twice() -> None:
    # Whatever kubelet asks for a pod, the ids it lists for that pod never count against it.
    admitted = pod("admitted", {"main": "4,5"}, version="3")
    kubelet = kubelet_lists(("admitted", {"main": cores(4, 5)}), ("other", {"main": cores(8)}))
    assert kubelet.holders(("ns", "admitted"), 4, NEURONCORE) == {"ns/other": 1 << 8}
    again = decide([admitted], [4, 5], kubelet)
    assert isinstance(again, Matched) and again.again
    # An older pod of the same name still holds device 0 while the new one is admitted.
    new = device_pod("p", "0")
    twice = kubelet_lists(("p", {"main": cores(0, 1)}), ("p", {"main": {}}))
    assert twice.shadowed == {("ns", "p"): {NEURONCORE: frozenset({0, 1})}}
    refused = decide_devices([new], [0], twice)
    assert isinstance(refused, Rejected) and "ns/p holds cores 0,1" in refused.message


def test_a_device_held_through_neuron_is_not_given_through_neurondevice() -> None:
    # Both are devices: the ids match a's slice exactly, but a holds them through `neuron`.
    a = pod("a", {"main": "0"}, resource=NEURON, version="3")
    kubelet = kubelet_lists(("a", {"main": {NEURON: ["0"]}}), ("stray", {"main": {}}))
    view = node_view([a], NODE, INF1)
    refused = decide_allocation(
        view, Unit.DEVICE, [0], 4, INF1, frozenset(), kubelet, resource=NEURONDEVICE
    )
    assert isinstance(refused, Rejected) and "ns/a holds cores 0-3" in refused.message
    # Through `neuron` they are a's own: kubelet asks again for it.
    again = decide_allocation(
        view, Unit.DEVICE, [0], 4, INF1, frozenset(), kubelet, resource=NEURON
    )
    assert isinstance(again, Matched) and again.again


def test_the_preference_steers_kubelet_off_ids_another_pod_holds() -> None:
    d = device_pod("d", "0")
    kubelet = kubelet_lists(("stray", {"main": cores(0, 1)}), ("d", {"main": {}}))
    view = node_view([d], NODE, INF1)
    choice = preferred_ids(view, Unit.DEVICE, [0, 1, 2, 3], [], 1, 4, INF1, (), kubelet)
    assert choice.slot is not None and choice.slot.pod == "ns/d" and choice.withheld
    assert choice.ids != (0,)
    # kubelet admits a pod placed without the scheduler: it is steered off them too.
    stranger = kubelet_lists(("stray", {"main": cores(0, 1)}), ("other", {"main": {}}))
    choice = preferred_ids(node_view([], NODE, INF1), Unit.CORE, EVERY_CORE, [], 2, 4, INF1)
    assert choice.ids == (0, 1)  # nothing known: kubelet's first
    choice = preferred_ids(
        node_view([], NODE, INF1), Unit.CORE, EVERY_CORE, [], 2, 4, INF1, (), stranger
    )
    assert not set(choice.ids) & {0, 1}


async def test_a_pod_steered_off_another_pods_ids_runs_and_its_annotations_are_corrected() -> None:
    pods = Pods([device_pod("d", "0")])
    kubelet = FakeLister(held(("stray", {"main": cores(0, 1)}), ("d", {"main": {}})))
    subject = Assigner(pods, NODE, inf1(), kubelet=kubelet)  # type: ignore[arg-type]
    every = ("0", "1", "2", "3")
    # Had kubelet ignored the preference, device 0 is refused: two pods would share its cores.
    with pytest.raises(AllocationError, match="ns/stray holds cores 0,1"):
        await subject.allocate(NEURON, Unit.DEVICE, [["0"]])
    (ids,) = await subject.preferred(NEURON, [ContainerRequest(every, (), 1)])
    assert ids != ["0"]
    await subject.allocate(NEURON, Unit.DEVICE, [ids])
    record = subject.withheld[("uid-d", "main")]
    assert record.cause is WithheldCause.HELD_ELSEWHERE and record.annotated == (0,)

    kubelet.answer = held(("stray", {"main": cores(0, 1)}), ("d", {"main": {NEURON: ids}}))
    fixer = corrector(pods, kubelet)
    fixer.withheld = subject.withheld
    await fixer.reconcile()
    (event,) = pods.events
    assert event[1] == CORRECTED
    assert event[2].startswith(
        "kubelet offered the annotated ids, but another pod's containers held them through "
        f"another Neuron resource (kubelet keeps ids apart within one resource only); the device "
        f"plugin gave a legal set of what it offered instead: container main holds device "
        f"{ids[0]}, not the annotated 0."
    ), event[2]
    assert pods.pods["d"].metadata.annotations["AWS_NEURON_IDS"] == ids[0]
    await subject.close()


async def test_ids_another_pod_holds_through_the_same_resource_are_kubelets_to_withhold() -> None:
    # kubelet itself keeps them apart: it does not offer them, and the cause says so.
    pods = Pods([pending("a", "0,1", version="10")])
    kubelet = FakeLister(held(("stray", {"main": cores(0, 1)}), ("a", {"main": {}})))
    subject = Assigner(pods, NODE, inf1(), kubelet=kubelet)  # type: ignore[arg-type]
    offered = tuple(str(i) for i in range(2, 16))
    (ids,) = await subject.preferred(NEURONCORE, [ContainerRequest(offered, (), 2)])
    await subject.allocate(NEURONCORE, Unit.CORE, [ids])
    record = subject.withheld[("uid-a", "main")]
    assert record.cause is WithheldCause.IN_USE and record.offered == 14
    await subject.close()
