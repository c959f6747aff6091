"""A small Kubernetes API client on aiohttp: JSON requests, watch streams, and the typed calls
this project makes. The only module that builds API paths."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Generic, TypeVar

import aiohttp
import msgspec

from neuron_scheduler.kube.config import KubeConfig
from neuron_scheduler.kube.decoding import decode
from neuron_scheduler.kube.errors import API_ERRORS, NotFound, TooLarge, api_error
from neuron_scheduler.kube.kueue import WorkloadState
from neuron_scheduler.kube.objects import JobClaim, Lease, Node, ObjectRef, Pod, PodList


def pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods/{name}"


def node_path(name: str) -> str:
    return f"/api/v1/nodes/{name}"


def workload_path(namespace: str, name: str) -> str:
    return f"{KUEUE}/namespaces/{namespace}/workloads/{name}"


def leases_path(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"


def resource_claim_path(namespace: str, name: str) -> str:
    return f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"


PODS = "/api/v1/pods"
NODES = "/api/v1/nodes"
# The Workload API's PodGroups, newest version first (`KubeAPI.first_served` picks one): v1beta1
# from Kubernetes 1.37, v1alpha3 beside it, v1alpha2 in 1.36 only (1.37 removed it). None is
# served by default. What we read of one, its gang's minCount, is alike in all three.
POD_GROUP_PATHS = (
    "/apis/scheduling.k8s.io/v1beta1/podgroups",
    "/apis/scheduling.k8s.io/v1alpha3/podgroups",
    "/apis/scheduling.k8s.io/v1alpha2/podgroups",
)


def group_version(path: str) -> str:
    """The API group and version of a path under /apis: `scheduling.k8s.io/v1beta1`."""
    return "/".join(path.split("/")[2:4])


CLAIMS = "/apis/neuron-scheduler.io/v1alpha1/ultraserverclaims"
DISRUPTION_BUDGETS = "/apis/policy/v1/poddisruptionbudgets"
RESOURCE_SLICES = "/apis/resource.k8s.io/v1/resourceslices"
RESOURCE_CLAIMS = "/apis/resource.k8s.io/v1/resourceclaims"
LEASES = "/apis/coordination.k8s.io/v1/leases"
# Kueue (kueue.x-k8s.io/v1beta2: what v0.17 stores), read by the placement admission check.
KUEUE = "/apis/kueue.x-k8s.io/v1beta2"
WORKLOADS = f"{KUEUE}/workloads"
ADMISSION_CHECKS = f"{KUEUE}/admissionchecks"
RESOURCE_FLAVORS = f"{KUEUE}/resourceflavors"
# Whose fields the extender's server-side applies own (Kueue's own managers own the rest).
FIELD_MANAGER = "neuron-scheduler"

T = TypeVar("T")


class ItemList(msgspec.Struct, Generic[T]):
    """A list answer's items, decoded as the caller's type."""

    items: list[T] = []


class ListMeta(msgspec.Struct):
    # `continue` is a Python keyword: msgspec renames it.
    continue_: str = msgspec.field(default="", name="continue")


class ListPage(msgspec.Struct, Generic[T]):
    """One page of a list answer: its items and the token for the next page."""

    metadata: ListMeta = msgspec.field(default_factory=ListMeta)
    items: list[T] = []


class VersionMeta(msgspec.Struct):
    resourceVersion: str = ""


class Versioned(msgspec.Struct):
    """Any object's answer, read for its resourceVersion only."""

    metadata: VersionMeta = msgspec.field(default_factory=VersionMeta)


class ListTooLong(ValueError):
    """A list that goes on past what the caller will hold (a server that never stops paging)."""


class KubeAPI:
    """JSON over HTTPS to one API server, sharing a connection pool across callers."""

    TOKEN_REFRESH_SECONDS = 60.0  # bound service-account tokens rotate; re-read the file

    def __init__(self, config: KubeConfig, *, timeout: float = 10.0) -> None:
        self.config = config
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None
        self._token: str | None = config.token
        self._token_read = 0.0

    async def __aenter__(self) -> KubeAPI:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict[str, str]:
        file = self.config.token_file
        if file is not None and time.monotonic() - self._token_read > self.TOKEN_REFRESH_SECONDS:
            self._token = file.read_text().strip()
            self._token_read = time.monotonic()
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(ssl=self.config.ssl_context(), limit=64)
            self._session = aiohttp.ClientSession(connector=connector)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> bytes:
        """The answer's body; raises a `kube.errors` ApiError for an HTTP error status."""
        headers = self._headers()
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = msgspec.json.encode(body)
        async with self.session().request(
            method,
            self.config.server + path,
            params=params,
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=self._timeout),
        ) as response:
            payload = await _read_bounded(response, method, path)
            if response.status >= 400:
                raise api_error(method, path, response.status, payload)
            return payload

    async def stream(
        self, path: str, params: dict[str, str], *, idle_timeout: float
    ) -> AsyncIterator[bytes]:
        """Lines of a watch response; raises on HTTP errors or when nothing arrives in time."""
        async with self.session().get(
            self.config.server + path,
            params=params,
            headers=self._headers(),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=self._timeout, sock_read=idle_timeout
            ),
        ) as response:
            if response.status >= 400:
                raise api_error(
                    "GET", path, response.status, await _read_bounded(response, "GET", path)
                )
            while line := await response.content.readline(max_line_length=MAX_EVENT_BYTES):
                if line.strip():
                    yield line

    async def first_served(self, paths: Sequence[str]) -> str | None:
        """The first of `paths` (one resource in several API versions) the server does not
        answer 404 for; None when it answers 404 for all. Any other answer (no permission, an
        error) ends the search there too: the caller's own requests meet it again and say so."""
        for path in paths:
            try:
                await self.request("GET", path, params={"limit": "1"})
            except NotFound:
                continue
            except API_ERRORS:
                return path
            return path
        return None

    # --- typed calls -------------------------------------------------------------------------

    async def get_pod(self, namespace: str, name: str) -> Pod:
        return decode(await self.request("GET", pod_path(namespace, name)), Pod)

    async def get_node(self, name: str) -> Node:
        return decode(await self.request("GET", node_path(name)), Node)

    async def list_all(
        self,
        path: str,
        kind: type[T],
        *,
        params: dict[str, str] | None = None,
        page: int = 500,
        most: int = 1_000_000,
    ) -> list[T]:
        """Every object of a list, asked for `page` at a time (the API's `limit`/`continue`);
        ListTooLong past `most` objects or as many pages, whatever the server says."""
        items: list[T] = []
        token = ""
        for _ in range(most // page + 1):
            asked = {**(params or {}), "limit": str(page)}
            if token:
                asked["continue"] = token
            payload = await self.request("GET", path, params=asked)
            answer = decode(payload, ListPage[kind])  # type: ignore[valid-type]
            items.extend(answer.items)
            if len(items) > most:
                break
            token = answer.metadata.continue_
            if not token:
                return items
        raise ListTooLong(f"GET {path}: more than {most} objects (or pages); not read")

    async def list_pods(self, field_selector: str) -> list[Pod]:
        payload = await self.request("GET", PODS, params={"fieldSelector": field_selector})
        return decode(payload, PodList).items

    async def patch_annotations(
        self,
        namespace: str,
        name: str,
        uid: str,
        values: dict[str, str | None],
        *,
        resource_version: str | None = None,
    ) -> str:
        """A JSON merge patch of only these annotation keys (None deletes one), so other
        components' annotations survive. The uid in the body is a precondition: a pod recreated
        under the same name is never touched; a resourceVersion, when given, turns a
        read-modify-write race into a Conflict the caller retries. Returns the pod's
        resourceVersion after the patch."""
        metadata: dict[str, object] = {"uid": uid, "annotations": values}
        if resource_version is not None:
            metadata["resourceVersion"] = resource_version
        answer = await self.request(
            "PATCH",
            pod_path(namespace, name),
            body={"metadata": metadata},
            content_type="application/merge-patch+json",
        )
        version = decode(answer, Versioned).metadata.resourceVersion
        if not version:  # as a precondition "" means none: never let a caller condition on it
            raise msgspec.DecodeError(f"PATCH {namespace}/{name}: no resourceVersion in the answer")
        return version

    async def patch_node_annotation(self, name: str, key: str, value: str | None) -> None:
        """A JSON merge patch of one annotation key of a Node (None deletes it); nothing else of
        the Node is sent, so other writers' keys, labels and taints are never touched."""
        await self.request(
            "PATCH",
            f"{NODES}/{name}",
            body={"metadata": {"annotations": {key: value}}},
            content_type="application/merge-patch+json",
        )

    async def patch_nominated_node(self, namespace: str, name: str, uid: str, node: str) -> None:
        """Sets (or, with "", clears) the pod's status.nominatedNodeName: kube-scheduler tries
        that node first and holds the pod's resources there by count (KEP-5278). A merge patch
        of the status subresource, the uid as precondition."""
        await self.request(
            "PATCH",
            pod_path(namespace, name) + "/status",
            body={"metadata": {"uid": uid}, "status": {"nominatedNodeName": node or None}},
            content_type="application/merge-patch+json",
        )

    async def create_pod(self, namespace: str, body: dict[str, Any]) -> Pod:
        answer = await self.request("POST", f"/api/v1/namespaces/{namespace}/pods", body=body)
        return decode(answer, Pod)

    async def patch_pod_condition(
        self, namespace: str, name: str, uid: str, condition: dict[str, str]
    ) -> None:
        """Sets one condition in the pod's status (a strategic merge patch keyed by type)."""
        await self.request(
            "PATCH",
            pod_path(namespace, name) + "/status",
            body={"metadata": {"uid": uid}, "status": {"conditions": [condition]}},
            content_type="application/strategic-merge-patch+json",
        )

    async def evict(self, namespace: str, name: str, uid: str) -> None:
        """An Eviction (policy/v1): the API server deletes the pod gracefully only if its
        PodDisruptionBudgets allow it (else 429, TooManyRequests), and only the pod with this
        uid (a pod recreated under the name is left alone: 409)."""
        await self.request(
            "POST",
            pod_path(namespace, name) + "/eviction",
            body={
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": name, "namespace": namespace},
                "deleteOptions": {"preconditions": {"uid": uid}},
            },
        )

    async def mark_preempted(self, namespace: str, name: str, uid: str, message: str) -> None:
        """The pod's DisruptionTarget condition, reason PreemptionByScheduler, as kube-scheduler
        sets it on its victims before deleting them (a strategic merge of that one condition,
        the uid as precondition)."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        condition = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "PreemptionByScheduler",
            "message": message[:1024],
            "lastTransitionTime": now,
        }
        await self.request(
            "PATCH",
            pod_path(namespace, name) + "/status",
            body={"metadata": {"uid": uid}, "status": {"conditions": [condition]}},
            content_type="application/strategic-merge-patch+json",
        )

    async def delete_pod(
        self, namespace: str, name: str, uid: str, *, dry_run: bool = False
    ) -> None:
        """A graceful delete (the pod's own grace period) of only the pod with this uid (a pod
        recreated under the name is left alone: Conflict). `dry_run`: asked of the API server's
        admission (policies, webhooks, authorization) without deleting anything."""
        options: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "preconditions": {"uid": uid},
        }
        if dry_run:
            options["dryRun"] = ["All"]
        await self.request("DELETE", pod_path(namespace, name), body=options)

    async def bind(
        self, namespace: str, name: str, uid: str, node: str, *, resource_version: str
    ) -> None:
        """A Binding that lands only on the pod as it was at `resource_version` (kube-apiserver
        checks the Binding's uid and resourceVersion as preconditions): once the pod has changed
        since, a Binding still on its way can no longer land."""
        await self.request(
            "POST",
            pod_path(namespace, name) + "/binding",
            body={
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "uid": uid,
                    "resourceVersion": resource_version,
                },
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            },
        )

    async def create_event(
        self, ref: ObjectRef, reason: str, message: str, warning: bool, name: str = ""
    ) -> None:
        """`name`: the event's own name (a second event of that name is a Conflict); "" for a
        generated one."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        # Events about cluster-scoped objects (Nodes) live in "default", as kubelet's do.
        namespace = ref.namespace or "default"
        involved = {"apiVersion": "v1", "kind": ref.kind, "name": ref.name, "uid": ref.uid}
        if ref.namespace:
            involved["namespace"] = ref.namespace
        await self.request(
            "POST",
            f"/api/v1/namespaces/{namespace}/events",
            body={
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": (
                    {"name": name, "namespace": namespace}
                    if name
                    else {"generateName": f"{ref.name}.", "namespace": namespace}
                ),
                "involvedObject": involved,
                "reason": reason,
                "message": message[:1024],
                "type": "Warning" if warning else "Normal",
                "source": {"component": "neuron-scheduler"},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            },
        )

    async def list_leases(self, label_selector: str) -> list[Lease]:
        """Leases of every namespace with this label (read by `kubectl neuron status`)."""
        payload = await self.request(
            "GET", LEASES, params={"labelSelector": label_selector, "limit": "50"}
        )
        return decode(payload, ItemList[Lease]).items

    async def get_lease(self, namespace: str, name: str) -> Lease:
        path = f"{leases_path(namespace)}/{name}"
        return decode(await self.request("GET", path), Lease)

    async def create_lease(self, lease: Lease) -> Lease:
        path = leases_path(lease.metadata.namespace)
        answer = await self.request("POST", path, body=msgspec.to_builtins(lease))
        return decode(answer, Lease)

    async def replace_lease(self, lease: Lease) -> Lease:
        """PUT with the resourceVersion the lease carries: a Conflict if it changed since."""
        path = f"{leases_path(lease.metadata.namespace)}/{lease.metadata.name}"
        answer = await self.request("PUT", path, body=msgspec.to_builtins(lease))
        return decode(answer, Lease)

    # --- neuron-scheduler.io/v1alpha1 UltraServerClaims (cluster-scoped, one per node) --------

    async def create_claim(self, claim: JobClaim) -> JobClaim:
        answer = await self.request("POST", CLAIMS, body=msgspec.to_builtins(claim))
        return decode(answer, JobClaim)

    async def replace_claim(self, claim: JobClaim) -> JobClaim:
        """PUT with the resourceVersion the claim carries: a Conflict if it changed since."""
        path = f"{CLAIMS}/{claim.metadata.name}"
        answer = await self.request("PUT", path, body=msgspec.to_builtins(claim))
        return decode(answer, JobClaim)

    async def delete_claim(self, name: str, uid: str, resource_version: str) -> None:
        """Only the claim of this uid, as it was at this resourceVersion (a Conflict if it
        changed since, NotFound if it is gone)."""
        await self.request(
            "DELETE",
            f"{CLAIMS}/{name}",
            body={
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "preconditions": {"uid": uid, "resourceVersion": resource_version},
            },
        )

    # --- kueue.x-k8s.io/v1beta2: a Workload read (`why`), the placement check's writes --------

    async def get_workload_state(self, namespace: str, name: str) -> WorkloadState:
        """The Workload's metadata and status (its pod sets are not read)."""
        answer = await self.request("GET", workload_path(namespace, name))
        return decode(answer, WorkloadState)

    async def apply_check_state(
        self, namespace: str, name: str, uid: str, resource_version: str, state: dict[str, Any]
    ) -> None:
        """One admission check's state in the Workload's status, by server-side apply: only
        that entry of status.admissionChecks (a list keyed by name) is ours, so Kueue's fields
        and other checks' states are never touched; the uid and resourceVersion are
        preconditions (a Conflict when the workload changed since it was read)."""
        await self.request(
            "PATCH",
            workload_path(namespace, name) + "/status",
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            body={
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "Workload",
                "metadata": {
                    "name": name,
                    "namespace": namespace,
                    "uid": uid,
                    "resourceVersion": resource_version,
                },
                "status": {"admissionChecks": [state]},
            },
            content_type="application/apply-patch+yaml",
        )

    async def apply_check_condition(self, name: str, condition: dict[str, Any]) -> None:
        """One condition (Active) in an AdmissionCheck's status, by server-side apply."""
        await self.request(
            "PATCH",
            f"{ADMISSION_CHECKS}/{name}/status",
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            body={
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "AdmissionCheck",
                "metadata": {"name": name},
                "status": {"conditions": [condition]},
            },
            content_type="application/apply-patch+yaml",
        )

    # --- resource.k8s.io/v1 (the DRA driver): wire types are the caller's -----------------------

    async def get_resource_claim(self, namespace: str, name: str, kind: type[T]) -> T:
        payload = await self.request("GET", resource_claim_path(namespace, name))
        return decode(payload, kind)

    async def list_resource_slices(self, field_selector: str, kind: type[T]) -> list[T]:
        payload = await self.request(
            "GET", RESOURCE_SLICES, params={"fieldSelector": field_selector}
        )
        return decode(payload, ItemList[kind]).items  # type: ignore[valid-type]

    async def create_resource_slice(self, body: Any) -> None:
        await self.request("POST", RESOURCE_SLICES, body=body)

    async def replace_resource_slice(self, name: str, body: Any) -> None:
        """PUT; the body's resourceVersion makes a concurrent change a Conflict."""
        await self.request("PUT", f"{RESOURCE_SLICES}/{name}", body=body)

    async def delete_resource_slice(self, name: str, uid: str) -> None:
        """Only the slice with this uid: one re-created under the same name is left alone."""
        await self.request(
            "DELETE",
            f"{RESOURCE_SLICES}/{name}",
            body={
                "apiVersion": "v1",
                "kind": "DeleteOptions",
                "preconditions": {"uid": uid},
            },
        )


# etcd keeps objects under 1.5 MiB (its default request limit): a list page of 500 such objects
# (the most we ask for) fits, with room for the envelope; a watch event is one object.
MAX_ANSWER_BYTES = 800 * 1024 * 1024
# aiohttp's default line limit is 128 KiB, less than one pod with its 256 KiB of annotations.
MAX_EVENT_BYTES = 4 * 1024 * 1024


async def _read_bounded(response: aiohttp.ClientResponse, method: str, path: str) -> bytes:
    if response.content_length is not None and response.content_length > MAX_ANSWER_BYTES:
        raise TooLarge(method, path, MAX_ANSWER_BYTES)
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise TooLarge(method, path, MAX_ANSWER_BYTES)
        chunks.append(chunk)
    return b"".join(chunks)
