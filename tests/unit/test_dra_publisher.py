"""The publisher against an in-memory API: generations, in-place taint updates, removal of
slices no longer wanted, refusing to publish when the API server drops the counters, and saying
so when it drops the taints."""

from __future__ import annotations

import copy
import itertools
import json
from typing import Any, TypeVar

import msgspec
import pytest

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra.publisher import CountersDropped, Owner, Publisher, TaintsDropped
from neuron_scheduler.dra.slices import NodeInventory
from neuron_scheduler.kube.errors import Conflict, NotFound

T = TypeVar("T")
DRIVER = "neuron.example.com"
NODE = "node-a"


class MemoryApi:
    """ResourceSlices the way the API server keeps them: resourceVersions, uid preconditions,
    and (with partitionable devices off) counters silently dropped."""

    def __init__(self, *, drop_counters: bool = False, drop_taints: bool = False) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.drop_counters = drop_counters
        self.drop_taints = drop_taints  # device taints off (1.35 without DRADeviceTaints)
        self._versions = itertools.count(1)

    def _store(self, body: Any) -> None:
        body = copy.deepcopy(body)
        if self.drop_counters:
            body["spec"].pop("sharedCounters", None)
            for device in body["spec"].get("devices", []):
                device.pop("consumesCounters", None)
        if self.drop_taints:
            for device in body["spec"].get("devices", []):
                device.pop("taints", None)
        body["metadata"]["resourceVersion"] = str(next(self._versions))
        old = self.slices.get(body["metadata"]["name"])
        body["metadata"]["uid"] = (
            old["metadata"]["uid"] if old else f"uid-{body['metadata']['name']}"
        )
        self.slices[body["metadata"]["name"]] = body

    async def list_resource_slices(self, field_selector: str, kind: type[T]) -> list[T]:
        wanted = dict(part.split("=") for part in field_selector.split(","))
        items = [
            s
            for s in self.slices.values()
            if s["spec"]["nodeName"] == wanted["spec.nodeName"]
            and s["spec"]["driver"] == wanted["spec.driver"]
        ]
        return msgspec.json.decode(json.dumps(items), type=list[kind])  # type: ignore[valid-type]

    async def create_resource_slice(self, body: Any) -> None:
        if body["metadata"]["name"] in self.slices:
            raise Conflict("POST", "/", 409, b"{}")
        self._store(body)

    async def replace_resource_slice(self, name: str, body: Any) -> None:
        old = self.slices.get(name)
        if old is None:
            raise NotFound("PUT", "/", 404, b"{}")
        if body["metadata"].get("resourceVersion") != old["metadata"]["resourceVersion"]:
            raise Conflict("PUT", "/", 409, b"{}")
        self._store(body)

    async def delete_resource_slice(self, name: str, uid: str) -> None:
        old = self.slices.get(name)
        if old is None:
            raise NotFound("DELETE", "/", 404, b"{}")
        if old["metadata"]["uid"] != uid:
            raise Conflict("DELETE", "/", 409, b"{}")
        del self.slices[name]

    def generations(self) -> set[int]:
        return {s["spec"]["pool"]["generation"] for s in self.slices.values()}


def topology(instance_type: str) -> Topology:
    return Catalog.builtin().resolve(instance_type).topology


async def test_publish_once_then_nothing_then_taints_in_place() -> None:
    api = MemoryApi()
    publisher = Publisher(api, DRIVER, Owner(NODE, "node-uid"))
    inventory = NodeInventory(NODE, topology("inf2.48xlarge"))
    assert await publisher.publish(inventory)
    assert len(api.slices) == 4 and api.generations() == {1}
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in api.slices.values()} == {4}
    owner = next(iter(api.slices.values()))["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", NODE, "node-uid")
    writes = publisher.writes
    assert not await publisher.publish(inventory)
    assert publisher.writes == writes
    # neuron11 unhealthy: only slices holding shapes with device 11 change, same generation.
    sick = NodeInventory(NODE, inventory.topology, unhealthy={11: "gone"})
    assert await publisher.publish(sick)
    assert api.generations() == {1}
    assert publisher.writes == writes + 3  # the counter slice has no devices to taint
    tainted = {
        d["name"]
        for s in api.slices.values()
        for d in s["spec"].get("devices", [])
        if d.get("taints")
    }
    assert "window-3-at-10" in tainted and "single-11" in tainted and "single-0" not in tainted


async def test_other_devices_are_a_new_generation_and_old_slices_go() -> None:
    api = MemoryApi()
    publisher = Publisher(api, DRIVER, Owner(NODE, "u"))
    await publisher.publish(NodeInventory(NODE, topology("inf2.48xlarge")))
    await publisher.publish(NodeInventory(NODE, topology("inf2.24xlarge")))
    assert api.generations() == {2}
    assert len(api.slices) == 2
    assert all(s["spec"]["pool"]["resourceSliceCount"] == 2 for s in api.slices.values())


async def test_a_deleted_slice_is_put_back() -> None:
    api = MemoryApi()
    publisher = Publisher(api, DRIVER, Owner(NODE, "u"))
    inventory = NodeInventory(NODE, topology("trn1.32xlarge"))
    await publisher.publish(inventory)
    api.slices.pop(sorted(api.slices)[-1])
    assert await publisher.publish(inventory)
    assert len(api.slices) == 2 and api.generations() == {2}


async def test_dropped_counters_mean_nothing_is_published() -> None:
    api = MemoryApi(drop_counters=True)
    publisher = Publisher(api, DRIVER, Owner(NODE, "u"))
    with pytest.raises(CountersDropped, match="DRAPartitionableDevices"):
        await publisher.publish(NodeInventory(NODE, topology("trn1.32xlarge")))
    assert api.slices == {}
    # A single-device node needs no counters: it is published as usual.
    await publisher.publish(NodeInventory(NODE, topology("inf2.xlarge")))
    assert len(api.slices) == 1


async def test_dropped_taints_are_said_and_written_again_until_kept() -> None:
    api = MemoryApi(drop_taints=True)
    publisher = Publisher(api, DRIVER, Owner(NODE, "u"))
    inventory = NodeInventory(NODE, topology("inf2.48xlarge"))
    assert await publisher.publish(inventory)  # nothing tainted: nothing to drop
    sick = NodeInventory(NODE, inventory.topology, unhealthy={11: "gone"})
    with pytest.raises(TaintsDropped, match="DRADeviceTaints") as raised:
        await publisher.publish(sick)
    assert "single-11" in str(raised.value)
    assert len(api.slices) == 4  # every other device stays usable
    writes = publisher.writes
    with pytest.raises(TaintsDropped):
        await publisher.publish(sick)
    assert publisher.writes == writes + 3  # written again, not left as the server kept them
    api.drop_taints = False  # the gate turned on
    assert await publisher.publish(sick)
    assert any(d.get("taints") for s in api.slices.values() for d in s["spec"].get("devices", []))
    assert not await publisher.publish(sick)
