"""The device plugin when a device fails: the kubelet offers it to nobody, so a pod annotated with
it gets a legal set of what the kubelet offers (its own annotated ids among them), or a refusal
that names the failed device; and the Node says which devices failed (core/health)."""

from __future__ import annotations

import asyncio

from neuron_scheduler.core import handoff, health
from neuron_scheduler.core.allocation import Placement, is_valid_device_set
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import cores_of_devices
from neuron_scheduler.core.resources import NEURON, NeuronRequest, Unit
from neuron_scheduler.deviceplugin.admission import KubeletView
from neuron_scheduler.deviceplugin.devicewatch import DeviceState
from neuron_scheduler.deviceplugin.inventory import DeviceHealth
from neuron_scheduler.deviceplugin.matching import (
    Matched,
    Rejected,
    decide_allocation,
    node_view,
    preferred_ids,
)
from neuron_scheduler.deviceplugin.publishing import HealthPublisher
from neuron_scheduler.kube.backoff import Backoff
from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.objects import Pod
from tests.builders import pod

NODE = "inf2-a"
INF2 = Catalog.builtin().resolve("inf2.48xlarge", 12, 24).topology  # a ring of 12 x 2 cores


def annotated(name: str, devices: list[int], *, allocated: bool = False) -> Pod:
    """A pod the extender bound to NODE with these devices."""
    request = NeuronRequest(NEURON, len(devices))
    placement = Placement(tuple(devices), cores_of_devices(devices, 2), 0)
    annotations = handoff.encode(NODE, request, placement, ["c0"], 1)
    if allocated:
        annotations[handoff.ALLOCATED] = "true"
    return pod(
        name,
        {NEURON: len(devices)},
        node=NODE,
        namespace="ns",
        uid=f"uid-{name}",
        annotations=annotations,
        phase="Pending" if not allocated else "Running",
    )


def admitting(name: str) -> KubeletView:
    """kubelet's pod resources: it is admitting this pod, no ids given yet."""
    return KubeletView({("ns", name): {}})


def test_the_pods_own_annotated_ids_count_as_available_when_one_of_them_failed() -> None:
    # The case: an 8-device pod annotated 0-7 on an empty ring, device 5 fails; kubelet
    # offers every device but 5. Legal 8-blocks avoiding 5 exist (6..1, 7..2, 8..3, 9..4): the
    # plugin must prefer one of them, not 0-4,6-8.
    eight = annotated("eight", list(range(8)))
    view = node_view([eight], NODE, INF2)
    offered = [d for d in range(12) if d != 5]
    choice = preferred_ids(view, Unit.DEVICE, offered, [], 8, 2, INF2, (), admitting("eight"))
    assert choice.withheld and choice.slot is not None and choice.slot.pod == "ns/eight"
    assert 5 not in choice.ids and is_valid_device_set(INF2, list(choice.ids)), choice.ids
    decision = decide_allocation(
        view, Unit.DEVICE, choice.ids, 2, INF2, frozenset(), admitting("eight"), unhealthy=1 << 5
    )
    assert isinstance(decision, Matched) and decision.substitute


def test_other_pods_ids_stay_taken() -> None:
    # A 3-device pod annotated 4-6 beside pods on 0-3 and 7-11; device 5 failed. The healthy
    # free devices are 4 and 6: no legal set of 3 exists, and the refusal says why.
    three = annotated("three", [4, 5, 6])
    others = [annotated("left", [0, 1, 2, 3], allocated=True)]
    others.append(annotated("right", [7, 8, 9, 10, 11], allocated=True))
    view = node_view([three, *others], NODE, INF2)
    offered = [4, 6]
    choice = preferred_ids(view, Unit.DEVICE, offered, [], 3, 2, INF2, (), admitting("three"))
    assert choice.withheld  # nothing legal: kubelet picks (it offers too few anyway)
    decision = decide_allocation(
        view, Unit.DEVICE, [4, 6, 7], 2, INF2, frozenset(), admitting("three"), unhealthy=1 << 5
    )
    assert isinstance(decision, Rejected)
    message = decision.message
    assert message.startswith("pod ns/three container c0 was annotated devices 4-6"), message
    assert "device 5 failed" in message
    assert "ns/right holds" in message and "are not connected" in message
    assert "schedulerName" not in message and "ns/three holds" not in message


def test_without_a_failed_device_the_refusal_says_kubelet_counted_them_in_use() -> None:
    three = annotated("three", [4, 5, 6])
    view = node_view([three, annotated("right", [7], allocated=True)], NODE, INF2)
    decision = decide_allocation(
        view, Unit.DEVICE, [3, 5, 7], 2, INF2, frozenset(), admitting("three")
    )
    assert isinstance(decision, Rejected)
    assert "kubelet still counted them as in use" in decision.message
    assert "failed" not in decision.message


# --- publishing on the Node ------------------------------------------------------------------


class Sink:
    def __init__(self, failures: int = 0) -> None:
        self.values: list[str | None] = []
        self.failures = failures

    async def publish_unhealthy(self, value: str | None) -> None:
        if self.failures:
            self.failures -= 1
            raise api_error("PATCH", "/api/v1/nodes/n", 503, b"{}")
        self.values.append(value)


def state(*failed: int) -> DeviceState:
    return DeviceState(2, {d: DeviceHealth(d, d not in failed, "gone") for d in range(12)})


async def test_health_is_published_at_start_on_each_change_and_again_after_errors() -> None:
    devices = state()
    sink = Sink()
    publisher = HealthPublisher(sink, devices, Backoff(initial=0.01, maximum=0.02))
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))

    async def until(expected: list[str | None]) -> None:
        for _ in range(500):
            if sink.values == expected:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(sink.values)

    await until([None])  # at start: clears what a plugin before this one left
    devices.update(state(5).health)
    await until([None, "5"])
    sink.failures = 3  # the API server refuses three writes: the latest health still lands
    devices.update(state(3, 5).health)
    await until([None, "5", "3,5"])
    devices.update(state().health)
    await until([None, "5", "3,5", None])
    stop.set()
    await asyncio.wait_for(task, 5)
    assert health.decode("3,5", 12) == 0b101000
