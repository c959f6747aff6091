"""A fake of the part of kube-apiserver the extender's bind writes to, kept as the real one keeps
pods for what bind touches: merge patches of annotations with uid and resourceVersion
preconditions (409 when they do not hold), Bindings that set nodeName once (409 on a bound pod; uid
and resourceVersion preconditions as Binding.metadata carries them), and a resourceVersion bumped
on every write, each write also queued as a watch event."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

import msgspec

from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.objects import Pod


class FakeAPI:
    """The pod calls bind makes, on pods kept as JSON (name -> pod), with the faults a test
    queues in `faults`, one per write call: "fail" (500, before it takes effect), "lost" (takes
    effect, its answer lost: a timeout), "garbled" (takes effect, its answer does not decode),
    "late" (a timeout while the request is still on its way: `in_flight` holds it, and calling it
    lands it, or fails it by its preconditions, later)."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}  # name -> pod JSON
        self.version = itertools.count(1)
        self.faults: list[str] = []  # consumed one per write call
        self.then = "none"  # every write's fault once `faults` ran out ("fail": the API is down)
        self.events: list[tuple[str, dict[str, Any]]] = []  # (MODIFIED|DELETED, pod) not yet seen
        self.in_flight: list[Callable[[], str]] = []  # late writes, each applied at a later step

    def _fault(self) -> str:
        return self.faults.pop(0) if self.faults else self.then

    def _changed(self, body: dict[str, Any]) -> str:
        version = str(next(self.version))
        body["metadata"]["resourceVersion"] = version
        self.events.append(("MODIFIED", msgspec.json.decode(msgspec.json.encode(body))))
        return version

    async def get_pod(self, namespace: str, name: str) -> Pod:
        await asyncio.sleep(0)
        if name not in self.pods:
            raise api_error("GET", name, 404, b'{"reason": "NotFound"}')
        return msgspec.convert(self.pods[name], Pod)

    async def patch_annotations(
        self,
        namespace: str,
        name: str,
        uid: str,
        values: dict[str, str | None],
        *,
        resource_version: str | None = None,
    ) -> str:
        await asyncio.sleep(0)
        fault = self._fault()
        if fault == "fail":
            raise api_error("PATCH", name, 500, b'{"message": "injected"}')

        def apply() -> str:
            body = self.pods.get(name)
            if body is None:
                raise api_error("PATCH", name, 404, b"{}")
            meta = body["metadata"]
            if meta["uid"] != uid or (
                resource_version is not None and meta["resourceVersion"] != resource_version
            ):
                raise api_error("PATCH", name, 409, b'{"reason": "Conflict"}')
            annotations = meta.setdefault("annotations", {})
            for key, value in values.items():
                if value is None:
                    annotations.pop(key, None)
                else:
                    annotations[key] = value
            return self._changed(body)

        return self._deliver(fault, apply)

    async def bind(
        self,
        namespace: str,
        name: str,
        uid: str,
        node_name: str,
        *,
        resource_version: str,
    ) -> None:
        await asyncio.sleep(0)
        fault = self._fault()
        if fault == "fail":
            raise api_error("POST", name, 500, b'{"message": "injected"}')

        def apply() -> str:
            body = self.pods.get(name)
            if body is None or body["metadata"]["uid"] != uid:
                raise api_error("POST", name, 404, b"{}")
            if body["metadata"]["resourceVersion"] != resource_version:
                raise api_error("POST", name, 409, b'{"reason": "Conflict"}')
            if body["spec"].get("nodeName"):
                raise api_error("POST", name, 409, b'{"message": "already assigned"}')
            body["spec"]["nodeName"] = node_name
            return self._changed(body)

        self._deliver(fault, apply)

    def _deliver(self, fault: str, apply: Callable[[], str]) -> str:
        """Applies a write now (its answer lost or garbled) or, on "late", at a later step."""
        if fault == "late":
            self.in_flight.append(apply)
            raise TimeoutError("injected: no answer yet, the request is still on its way")
        version = apply()
        if fault == "lost":
            raise TimeoutError("injected: answer lost")
        if fault == "garbled":
            raise msgspec.DecodeError("injected: the answer is not JSON")
        return version

    async def create_event(self, *_: object) -> None:
        return None
