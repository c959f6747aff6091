"""Keeps the node's ResourceSlices equal to what `slices.pool_slices` says, through the API.

One pool per node, named after it. Content that changes while the driver runs (device taints)
is updated in place at the pool's generation; anything else (a different device list after a
restart with other hardware or settings) is written as a new generation, all slices of it, then
the old slices are deleted: the scheduler uses only the newest complete generation, so a pool
being rewritten is briefly unusable, never half old and half new.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.dra.slices import (
    SPEC_HASH_ANNOTATION,
    NodeInventory,
    SliceContent,
    pool_slices,
)
from neuron_scheduler.kube.backoff import Backoff
from neuron_scheduler.kube.errors import READ_ERRORS, NotFound

log = logging.getLogger(__name__)

STRUCTURE_ANNOTATION = "neuron-scheduler.io/structure-hash"
MAX_SLICES_READ = 10_000  # a field-selected list of one node's slices; more is not ours to trust


class _Meta(msgspec.Struct):
    name: str = ""
    uid: str = ""
    resourceVersion: str = ""
    annotations: dict[str, str] = {}


class _Pool(msgspec.Struct):
    name: str = ""
    generation: int = 0
    resourceSliceCount: int = 0


class _Device(msgspec.Struct):
    name: str = ""
    taints: list[msgspec.Raw] = []


class _Spec(msgspec.Struct):
    driver: str = ""
    nodeName: str = ""
    pool: _Pool = msgspec.field(default_factory=_Pool)
    sharedCounters: list[msgspec.Raw] = []
    devices: list[_Device] = []


class ExistingSlice(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)
    spec: _Spec = msgspec.field(default_factory=_Spec)


T = TypeVar("T")


class SliceApi(Protocol):
    """The calls the publisher makes (kube.client.KubeAPI has them)."""

    async def list_resource_slices(self, field_selector: str, kind: type[T]) -> list[T]: ...

    async def create_resource_slice(self, body: Any) -> None: ...

    async def replace_resource_slice(self, name: str, body: Any) -> None: ...

    async def delete_resource_slice(self, name: str, uid: str) -> None: ...


class CountersDropped(Exception):
    """The API server stored our slices without their counters: partitionable devices are off,
    and without counters the scheduler could hand out overlapping sets."""


class TaintsDropped(Exception):
    """The API server stored our slices without the taints of a failed device: device taints are
    off, and the scheduler may hand out the sets that hold it. The slices stay (every other
    device is good); the error is logged until the taints are kept."""


@dataclass(frozen=True, slots=True)
class Owner:
    """The Node the slices belong to: deleting it lets the garbage collector remove them."""

    name: str
    uid: str


def structure_hash(content: SliceContent) -> str:
    """What the content is without its taints: equal means an in-place update is safe."""
    devices = tuple({k: v for k, v in d.items() if k != "taints"} for d in content.devices)
    text = repr((content.name, content.shared_counters, devices)).encode()
    return hashlib.sha256(text).hexdigest()[:16]


class Publisher:
    def __init__(self, api: SliceApi, driver: str, owner: Owner) -> None:
        self.api = api
        self.driver = driver
        self.owner = owner
        self.writes = 0  # slices created, replaced or deleted: for logs and tests

    async def existing(self) -> list[ExistingSlice]:
        selector = f"spec.nodeName={self.owner.name},spec.driver={self.driver}"
        found = await self.api.list_resource_slices(selector, ExistingSlice)
        if len(found) > MAX_SLICES_READ:
            found = found[:MAX_SLICES_READ]
        return [s for s in found if s.spec.pool.name == self.owner.name]

    async def publish(self, inventory: NodeInventory) -> bool:
        """Make the API match; True when something was written. Raises API errors."""
        desired = pool_slices(self.driver, inventory)
        existing = await self.existing()
        by_name = {s.metadata.name: s for s in existing}
        count = len(desired)
        generations = {s.spec.pool.generation for s in existing}
        generation = max(generations, default=0)
        same_structure = (
            len(generations) == 1
            and set(by_name) == {c.name for c in desired}
            and all(s.spec.pool.resourceSliceCount == count for s in existing)
            and all(
                by_name[c.name].metadata.annotations.get(STRUCTURE_ANNOTATION) == structure_hash(c)
                for c in desired
            )
        )
        if same_structure:
            # A slice whose taints the API server dropped is written again every time, so that
            # they are kept as soon as device taints are on.
            changed = [
                c
                for c in desired
                if by_name[c.name].metadata.annotations.get(SPEC_HASH_ANNOTATION) != c.fingerprint
                or _untainted(c, by_name[c.name])
            ]
            for content in changed:
                await self._write(content, generation, count, by_name.get(content.name))
            if changed:
                log.info(
                    "updated %d of %d ResourceSlices of pool %s in place (generation %d)",
                    len(changed),
                    count,
                    self.owner.name,
                    generation,
                )
            await self._check_stored(desired, existing if not changed else None)
            return bool(changed)
        generation += 1
        for content in desired:
            await self._write(content, generation, count, by_name.get(content.name))
        wanted = {c.name for c in desired}
        for old in existing:
            if old.metadata.name not in wanted:
                with contextlib.suppress(NotFound):
                    await self.api.delete_resource_slice(old.metadata.name, old.metadata.uid)
                    self.writes += 1
        await self._check_stored(desired, None)
        devices = sum(len(c.devices) for c in desired)
        log.info(
            "published pool %s generation %d: %d ResourceSlices, %d devices (%s)",
            self.owner.name,
            generation,
            count,
            devices,
            inventory.topology.instance_type,
        )
        return True

    async def _check_stored(
        self, desired: list[SliceContent], stored: list[ExistingSlice] | None
    ) -> None:
        """What the API server kept of what we wrote, where a feature gate that is off makes it
        drop fields without an error: counters (CountersDropped), then taints (TaintsDropped)."""
        counters = any(c.shared_counters for c in desired)
        tainted = any(d.get("taints") for c in desired for d in c.devices)
        if not (counters or tainted):
            return
        if stored is None:
            stored = await self.existing()
        try:
            self._check_counters(desired, stored)
        except CountersDropped:
            await self._delete_pool(stored)
            raise
        self._check_taints(desired, stored)

    def _check_taints(self, desired: list[SliceContent], stored: list[ExistingSlice]) -> None:
        """Raise TaintsDropped when a device we taint was kept without its taints, as the API
        server does with device taints off."""
        by_name = {s.metadata.name: s for s in stored}
        dropped = sorted(
            name for c in desired if c.name in by_name for name in _untainted(c, by_name[c.name])
        )
        if not dropped:
            return
        shown = ", ".join(dropped[:4]) + (
            f" and {len(dropped) - 4} more" if len(dropped) > 4 else ""
        )
        raise TaintsDropped(
            f"the API server stored the devices {shown} of pool {self.owner.name} without the "
            "taints that mark their failed device: device taints are off (the DRADeviceTaints "
            "feature gate on kube-apiserver and kube-scheduler: off by default in 1.35, on from "
            "1.36). Until they are kept, the scheduler may give new claims sets that hold it"
        )

    async def _delete_pool(self, stored: list[ExistingSlice]) -> None:
        for old in stored:
            with contextlib.suppress(NotFound):
                await self.api.delete_resource_slice(old.metadata.name, old.metadata.uid)
                self.writes += 1

    def _check_counters(self, desired: list[SliceContent], stored: list[ExistingSlice]) -> None:
        """Raise CountersDropped (the caller then removes the pool) when the API server kept our
        counter slice without its counters, as it does with partitionable devices off."""
        wanted = {c.name for c in desired if c.shared_counters}
        if not wanted:
            return
        dropped = [
            s.metadata.name
            for s in stored
            if s.metadata.name in wanted and not s.spec.sharedCounters
        ]
        if not dropped:
            return
        raise CountersDropped(
            f"the API server stored ResourceSlice {dropped[0]} without its shared counters: "
            "partitionable devices are off (Kubernetes 1.35 needs the DRAPartitionableDevices "
            "feature gate on kube-apiserver and kube-scheduler; 1.36 has it on). Without "
            "counters the scheduler could hand out overlapping device sets, so this node's "
            "slices were removed and nothing is published until it is on"
        )

    def _body(self, content: SliceContent, generation: int, count: int) -> dict[str, Any]:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                "name": content.name,
                "annotations": {
                    SPEC_HASH_ANNOTATION: content.fingerprint,
                    STRUCTURE_ANNOTATION: structure_hash(content),
                },
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": self.owner.name,
                        "uid": self.owner.uid,
                        "controller": True,
                    }
                ],
            },
            "spec": content.spec(self.driver, self.owner.name, generation, count),
        }

    async def _write(
        self,
        content: SliceContent,
        generation: int,
        count: int,
        old: ExistingSlice | None,
    ) -> None:
        body = self._body(content, generation, count)
        if old is None:
            await self.api.create_resource_slice(body)
        else:
            body["metadata"]["resourceVersion"] = old.metadata.resourceVersion
            await self.api.replace_resource_slice(content.name, body)
        self.writes += 1

    async def run(
        self,
        current: Callable[[], NodeInventory],
        changed: asyncio.Event,
        stop: asyncio.Event,
        resync_seconds: float,
    ) -> None:
        """Publish `current()` now, again whenever `changed` is set, and every `resync_seconds`
        (someone may have deleted or edited a slice). A Conflict (a slice changed under us) is
        retried like any other failure, after a short wait."""
        backoff = Backoff(initial=0.5, maximum=30.0, jitter=0.2)
        dropped = Backoff(initial=10.0, maximum=300.0)
        while not stop.is_set():
            changed.clear()
            try:
                await self.publish(current())
            except (CountersDropped, TaintsDropped) as error:
                delay = dropped.failed()
                if dropped.should_log:
                    log.error("%s; checking again in %.0fs", loggable(error), delay)
                await _wait_any(stop, changed, delay)
                continue
            except READ_ERRORS as error:
                delay = backoff.failed()
                if backoff.should_log:
                    log.warning(
                        "publishing ResourceSlices for %s failed: %s; retrying in %.1fs",
                        self.owner.name,
                        loggable(error),
                        delay,
                    )
                await _wait_any(stop, changed, delay)
                continue
            backoff.succeeded()
            dropped.succeeded()
            await _wait_any(stop, changed, resync_seconds)


def _untainted(content: SliceContent, stored: ExistingSlice) -> list[str]:
    """The devices `content` taints that `stored` holds without taints."""
    kept = {d.name for d in stored.spec.devices if d.taints}
    return [d["name"] for d in content.devices if d.get("taints") and d["name"] not in kept]


async def _wait_any(stop: asyncio.Event, changed: asyncio.Event, seconds: float) -> None:
    waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(changed.wait())]
    try:
        await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
