"""The API calls the device plugin makes: this node's pods and Node, and marking a pod allocated."""

from __future__ import annotations

from typing import Protocol

import msgspec

from neuron_scheduler.kubeapi import ApiError, KubeAPI
from neuron_scheduler.objects import Node, Pod


class PodList(msgspec.Struct):
    items: list[Pod] = []


class NodePods(Protocol):
    async def list_pods(self) -> list[Pod]: ...

    async def get_pod(self, namespace: str, name: str) -> Pod | None: ...

    async def get_node(self) -> Node | None: ...

    async def patch_annotations(
        self, pod: Pod, values: dict[str, str | None], *, resource_version: bool
    ) -> None: ...


class ApiNodePods:
    """Reads straight from the API server on each call: Allocate is rare, and a fresh read is the
    only way to see annotations the extender wrote a moment before kubelet asked."""

    def __init__(self, api: KubeAPI, node: str) -> None:
        self.api = api
        self.node = node

    async def list_pods(self) -> list[Pod]:
        payload = await self.api.request(
            "GET", "/api/v1/pods", params={"fieldSelector": f"spec.nodeName={self.node}"}
        )
        return msgspec.json.decode(payload, type=PodList).items

    async def get_pod(self, namespace: str, name: str) -> Pod | None:
        try:
            payload = await self.api.request("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        return msgspec.json.decode(payload, type=Pod)

    async def get_node(self) -> Node | None:
        try:
            payload = await self.api.request("GET", f"/api/v1/nodes/{self.node}")
        except ApiError as error:
            if error.status == 404:
                return None
            raise
        return msgspec.json.decode(payload, type=Node)

    async def patch_annotations(
        self, pod: Pod, values: dict[str, str | None], *, resource_version: bool
    ) -> None:
        # A merge patch names only our keys, so other components' annotations survive. The uid
        # keeps a pod recreated under the same name untouched; the resourceVersion, when asked
        # for, turns a read-modify-write race into a 409 the caller retries.
        metadata: dict[str, object] = {"uid": pod.metadata.uid, "annotations": values}
        if resource_version:
            metadata["resourceVersion"] = pod.metadata.resourceVersion
        await self.api.request(
            "PATCH",
            f"/api/v1/namespaces/{pod.metadata.namespace}/pods/{pod.metadata.name}",
            body={"metadata": metadata},
            content_type="application/merge-patch+json",
        )
