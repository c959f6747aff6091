"""Assigner and the ListAndWatch stream, with the API server replaced by an in-memory stand-in."""

from __future__ import annotations

import asyncio
import json
from typing import Any, cast

import aiohttp
import msgspec
import pytest

from neuron_scheduler.core.resources import NEURONCORE, Unit
from neuron_scheduler.deviceplugin.assigning import AllocationError, Assigner, ContainerRequest
from neuron_scheduler.deviceplugin.devicewatch import DeviceState
from neuron_scheduler.deviceplugin.inventory import DeviceHealth
from neuron_scheduler.deviceplugin.matching import ALLOCATED_CONTAINERS
from neuron_scheduler.deviceplugin.service import Context, NeuronDevicePlugin
from neuron_scheduler.deviceplugin.v1beta1 import api_pb2
from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.objects import Node, Pod

NODE = "n1"


class MemoryPods:
    """Pods held in memory; `failures` makes the next calls fail like an unreachable server."""

    def __init__(self, pods: list[Pod]) -> None:
        self.pods = {p.metadata.name: p for p in pods}
        self.list_failures = 0
        self.patch_failures: list[Exception] = []
        self.patches: list[dict[str, str | None]] = []

    async def list_pods(self) -> list[Pod]:
        if self.list_failures:
            self.list_failures -= 1
            raise aiohttp.ClientConnectionError("connection refused")
        return list(self.pods.values())

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        return self.pods.get(name)

    async def get_node(self) -> Node | None:
        return msgspec.convert(
            {
                "metadata": {
                    "name": NODE,
                    "labels": {"node.kubernetes.io/instance-type": "inf2.48xlarge"},
                }
            },
            Node,
        )

    async def patch_annotations(
        self, pod: Pod, values: dict[str, str | None], *, resource_version: bool
    ) -> None:
        if self.patch_failures:
            raise self.patch_failures.pop(0)
        current = self.pods[pod.metadata.name]
        if resource_version and pod.metadata.resourceVersion != current.metadata.resourceVersion:
            raise api_error("PATCH", "/pods", 409, b'{"reason": "Conflict"}')
        merged = {**current.metadata.annotations}
        for key, value in values.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
        version = str(int(current.metadata.resourceVersion or "0") + 1)
        raw = msgspec.to_builtins(current)
        raw["metadata"]["annotations"] = merged
        raw["metadata"]["resourceVersion"] = version
        self.pods[pod.metadata.name] = msgspec.convert(raw, Pod)
        self.patches.append(values)

    def bump(self, name: str) -> None:
        """Someone else changed the pod: its resourceVersion moves on."""
        raw = msgspec.to_builtins(self.pods[name])
        raw["metadata"]["resourceVersion"] = str(int(raw["metadata"]["resourceVersion"]) + 1)
        self.pods[name] = msgspec.convert(raw, Pod)


def core_pod(name: str, slices: dict[str, str]) -> Pod:
    ids = ",".join(slices.values())
    return msgspec.convert(
        {
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": f"uid-{name}",
                "resourceVersion": "1",
                "annotations": {
                    "AWS_NEURON_IDS": ids,
                    "NEURON_RESOURCE_TYPE": NEURONCORE,
                    "NEURON_ALLOCATED": "false",
                    "NEURON_NODE": NODE,
                    "NEURON_CORES": ids,
                    "NEURON_DEVS": ",".join(sorted({str(int(c) // 2) for c in ids.split(",")})),
                    "NEURON_CONTAINER_IDS": json.dumps(slices),
                },
            },
            "spec": {
                "nodeName": NODE,
                "containers": [
                    {"name": c, "resources": {"limits": {NEURONCORE: str(len(v.split(",")))}}}
                    for c, v in slices.items()
                ],
            },
        },
        Pod,
    )


def state() -> DeviceState:
    return DeviceState(2, {d: DeviceHealth(d, True) for d in range(12)})


def assigner(pods: MemoryPods) -> Assigner:
    return Assigner(pods, NODE, state())


async def test_unreachable_api_fails_allocate_with_a_clear_reason() -> None:
    pods = MemoryPods([core_pod("p", {"main": "2,3"})])
    pods.list_failures = 10
    subject = assigner(pods)
    subject.LIST_ATTEMPTS = 2
    with pytest.raises(AllocationError, match="cannot read the pods of node n1"):
        await subject.allocate(NEURONCORE, Unit.CORE, [["2", "3"]])


async def test_a_brief_api_outage_is_ridden_out() -> None:
    pods = MemoryPods([core_pod("p", {"main": "2,3"})])
    pods.list_failures = 1
    (response,) = await assigner(pods).allocate(NEURONCORE, Unit.CORE, [["2", "3"]])
    assert response.envs["NEURON_RT_VISIBLE_CORES"] == "2,3"
    assert pods.pods["p"].metadata.annotations["NEURON_ALLOCATED"] == "true"


async def test_preference_survives_an_unreachable_api() -> None:
    pods = MemoryPods([])
    pods.list_failures = 1
    answers = await assigner(pods).preferred(
        NEURONCORE, [ContainerRequest(tuple(str(c) for c in range(24)), (), 2)]
    )
    assert len(answers[0]) == 2


async def test_multi_container_progress_survives_a_conflicting_write() -> None:
    pods = MemoryPods([core_pod("pair", {"a": "0,1", "b": "2,3"})])
    subject = assigner(pods)
    await subject.allocate(NEURONCORE, Unit.CORE, [["0", "1"]])
    assert pods.pods["pair"].metadata.annotations[ALLOCATED_CONTAINERS] == "a"
    assert pods.pods["pair"].metadata.annotations["NEURON_ALLOCATED"] == "false"
    original = pods.list_pods

    async def list_then_bump() -> list[Pod]:
        listed = await original()
        pods.bump("pair")  # another writer lands between our read and our patch
        return listed

    pods.list_pods = list_then_bump  # type: ignore[method-assign]
    await subject.allocate(NEURONCORE, Unit.CORE, [["2", "3"]])
    annotations = pods.pods["pair"].metadata.annotations
    assert annotations[ALLOCATED_CONTAINERS] == "a,b"
    assert annotations["NEURON_ALLOCATED"] == "true"


async def test_a_pod_whose_container_slices_nest_deep_never_fails_its_nodes_allocates() -> None:
    """Any pod's creator may write NEURON_CONTAINER_IDS: 60,000 "[" (under its 64 KiB bound)
    made a generic JSON decode raise RecursionError, which no reader expected, so every Allocate
    on the node failed while that pod existed. Now its ids are unreadable; the others' stand."""
    hostile = core_pod("hostile", {"main": "4,5"})
    hostile.metadata.annotations["NEURON_CONTAINER_IDS"] = "[" * 60_000
    pods = MemoryPods([core_pod("good", {"main": "2,3"}), hostile])
    (response,) = await assigner(pods).allocate(NEURONCORE, Unit.CORE, [["2", "3"]])
    assert response.envs["NEURON_RT_VISIBLE_CORES"] == "2,3"


async def test_a_failed_mark_is_retried_in_the_background() -> None:
    pods = MemoryPods([core_pod("p", {"main": "2,3"})])
    pods.patch_failures = [aiohttp.ClientConnectionError("reset")]
    subject = assigner(pods)
    (response,) = await subject.allocate(NEURONCORE, Unit.CORE, [["2", "3"]])
    assert response.envs["NEURON_RT_VISIBLE_CORES"] == "2,3"
    assert pods.pods["p"].metadata.annotations["NEURON_ALLOCATED"] == "false"
    # Until the mark lands, the same ids for another container are not this pod's any more.
    again = await subject.allocate(NEURONCORE, Unit.CORE, [["2", "3"]])
    assert again[0].envs["NEURON_RT_VISIBLE_CORES"] == "2,3"
    for _ in range(600):  # the first retry comes after 1 s; this is only a guard against a hang
        if pods.pods["p"].metadata.annotations["NEURON_ALLOCATED"] == "true":
            break
        await asyncio.sleep(0.05)
    assert pods.pods["p"].metadata.annotations["NEURON_ALLOCATED"] == "true"
    await subject.close()


async def test_list_and_watch_sends_only_changes() -> None:
    devices = state()
    plugin = NeuronDevicePlugin(NEURONCORE, devices, assigner(MemoryPods([])))
    stream = plugin.ListAndWatch(api_pb2.Empty(), cast(Context, None))
    first = await anext(stream)
    assert len(first.devices) == 24 and all(d.health == "Healthy" for d in first.devices)
    assert not devices.update(devices.health)  # nothing changed: nothing to send
    changed = devices.health
    changed[5] = DeviceHealth(5, False, "gone")
    assert devices.update(changed)
    second = await anext(stream)
    unhealthy: dict[str, Any] = {d.ID: d.health for d in second.devices if d.health != "Healthy"}
    assert unhealthy == {"10": "Unhealthy", "11": "Unhealthy"}
    await stream.aclose()
