"""The API calls the device plugin makes: this node's pods and Node, patching a pod's annotations
(marking it allocated, correcting its ids), an event on a pod, and its Node's one annotation:
which devices failed (core/health)."""

from __future__ import annotations

from typing import Protocol

from neuron_scheduler.core import health
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.errors import NotFound
from neuron_scheduler.kube.objects import Node, ObjectRef, Pod


class NodePods(Protocol):
    async def list_pods(self) -> list[Pod]: ...

    async def get_pod(self, namespace: str, name: str) -> Pod | None: ...

    async def get_node(self) -> Node | None: ...

    async def patch_annotations(
        self, pod: Pod, values: dict[str, str | None], *, resource_version: bool
    ) -> None: ...

    async def record_event(self, pod: Pod, reason: str, message: str) -> None: ...

    async def publish_unhealthy(self, value: str | None) -> None: ...


class ApiNodePods:
    """Reads straight from the API server on each call: Allocate is rare, and a fresh read is the
    only way to see annotations the extender wrote a moment before kubelet asked."""

    def __init__(self, api: KubeAPI, node: str) -> None:
        self.api = api
        self.node = node

    async def list_pods(self) -> list[Pod]:
        return await self.api.list_pods(f"spec.nodeName={self.node}")

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        try:
            return await self.api.get_pod(namespace, name)
        except NotFound:
            return None

    async def get_node(self) -> Node | None:
        try:
            return await self.api.get_node(self.node)
        except NotFound:
            return None

    async def patch_annotations(
        self, pod: Pod, values: dict[str, str | None], *, resource_version: bool
    ) -> None:
        # With the resourceVersion, a read-modify-write race becomes a Conflict the caller retries.
        meta = pod.metadata
        await self.api.patch_annotations(
            meta.namespace,
            meta.name,
            meta.uid,
            values,
            resource_version=meta.resourceVersion if resource_version else None,
        )

    async def record_event(self, pod: Pod, reason: str, message: str) -> None:
        await self.api.create_event(ObjectRef.of_pod(pod), reason, message, warning=True)

    async def publish_unhealthy(self, value: str | None) -> None:
        await self.api.patch_node_annotation(self.node, health.UNHEALTHY_DEVICES, value)
