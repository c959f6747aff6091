"""The leader's loop for pods on failed devices (extender/loops/devicefailures): one event per pod
and failure, another when the device recovers, and in mode evict an Eviction for pods a
controller recreates, retried after a disruption budget refuses it."""

from __future__ import annotations

import msgspec

from neuron_scheduler.core import handoff
from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import cores_of_devices
from neuron_scheduler.core.resources import NEURON, NeuronRequest
from neuron_scheduler.extender.loops.devicefailures import (
    FAILED,
    RECOVERED,
    RETRY_SECONDS,
    Action,
    DeviceFailures,
)
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.state.movability import DO_NOT_DISRUPT, Movability
from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.objects import ObjectRef, Pod
from tests.builders import node, pod_json

NODE = "inf2-a"


def running(name: str, devices: list[int], *, owned: bool = True, opted_out: bool = False) -> Pod:
    request = NeuronRequest(NEURON, len(devices))
    placement = Placement(tuple(devices), cores_of_devices(devices, 2), 0)
    annotations = handoff.encode(NODE, request, placement, ["c0"], 1)
    annotations[handoff.ALLOCATED] = "true"
    if opted_out:
        annotations[DO_NOT_DISRUPT] = "true"
    body = pod_json(
        name,
        {NEURON: len(devices)},
        node=NODE,
        annotations=annotations,
        phase="Running",
        uid=f"uid-{name}",
    )
    if owned:
        body["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "name": "rs",
                "uid": "rs-1",
                "controller": True,
            }
        ]
    return msgspec.convert(body, Pod)


class Evictions:
    def __init__(self) -> None:
        self.asked: list[str] = []
        self.refuse = 0

    async def evict(self, namespace: str, name: str, uid: str) -> None:
        self.asked.append(name)
        if self.refuse:
            self.refuse -= 1
            raise api_error("POST", "/eviction", 429, b'{"reason": "TooManyRequests"}')


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(
    action: Action, *pods: Pod
) -> tuple[Ledger, DeviceFailures, list[tuple[ObjectRef, str, str, bool]], Evictions, Clock]:
    ledger = Ledger(Catalog.builtin())
    ledger.replace_nodes([node(NODE, "inf2.48xlarge")])
    movability = Movability()
    ledger.replace_pods(list(pods))
    movability.replace_pods(list(pods))
    events: list[tuple[ObjectRef, str, str, bool]] = []
    evictions = Evictions()
    clock = Clock()
    loop = DeviceFailures(
        ledger, movability, evictions, lambda *e: events.append(e), action, clock=clock
    )
    return ledger, loop, events, evictions, clock


async def test_a_pod_on_a_failed_device_is_told_once_and_again_when_it_recovers() -> None:
    ledger, loop, events, evictions, _ = setup(
        Action.REPORT, running("on", [4, 5, 6, 7]), running("beside", [0, 1])
    )
    await loop.step()
    assert events == []
    ledger.apply_node(node(NODE, "inf2.48xlarge", failed=[5]))
    await loop.step()
    await loop.step()  # nothing new: said once
    ((ref, reason, message, warning),) = events
    assert (ref.name, reason, warning) == ("on", FAILED, True)
    assert message.startswith(f"device 5 of node {NODE}, among this pod's devices, failed")
    assert "only reports it" in message and evictions.asked == []
    ledger.apply_node(node(NODE, "inf2.48xlarge"))
    await loop.step()
    assert [(e[0].name, e[1], e[3]) for e in events[1:]] == [("on", RECOVERED, False)]


async def test_evict_mode_evicts_what_a_controller_recreates_and_retries_after_a_budget() -> None:
    ledger, loop, events, evictions, clock = setup(
        Action.EVICT,
        running("replica", [4, 5]),
        running("bare", [6, 7], owned=False),
        running("kept", [8, 9], opted_out=True),
    )
    evictions.refuse = 1  # a PodDisruptionBudget allows none at first
    ledger.apply_node(node(NODE, "inf2.48xlarge", failed=[5, 7, 9]))
    await loop.step()
    assert evictions.asked == ["replica"]
    texts = {e[0].name: e[2] for e in events}
    assert texts["replica"].endswith("evicting it (Eviction API)")
    assert "not evicted: no controller would recreate it" in texts["bare"]
    assert "not evicted: it opted out" in texts["kept"]
    await loop.step()  # the refusal is not asked again at once
    assert evictions.asked == ["replica"]
    clock.now += RETRY_SECONDS
    await loop.step()
    await loop.step()  # evicted: never asked twice
    assert evictions.asked == ["replica", "replica"]


async def test_only_the_leader_tells() -> None:
    ledger, loop, events, _, _ = setup(Action.REPORT, running("on", [4, 5]))
    ledger.apply_node(node(NODE, "inf2.48xlarge", failed=[5]))
    loop.is_leader = lambda: False
    await loop.step()
    assert events == []
    loop.is_leader = lambda: True
    await loop.step()
    assert [e[1] for e in events] == [FAILED]
