"""Worker facts from the Kubernetes API: worker pod -> its node -> the UltraServer labels."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import aiohttp
import msgspec

from neuron_scheduler.kubeapi import ApiError, KubeAPI
from neuron_scheduler.objects import Node, Pod
from neuron_scheduler.ultraserver.config import (
    DEFAULT_NODE_ID,
    MODE_LABEL,
    node_id_label,
    normalize_server_id,
    parse_modes,
    server_id_label,
)
from neuron_scheduler.ultraserver.ssh import bounded
from neuron_scheduler.ultraserver.topology import WorkerInfo

NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def default_namespace() -> str:
    try:
        return NAMESPACE_FILE.read_text().strip() or "default"
    except OSError:
        return "default"


def pod_of(host: str, namespace: str) -> tuple[str, str]:
    """(namespace, pod name) for a hostfile host: `<pod>.<service>.<namespace>.svc[...]` as the
    MPI operator writes it, or a bare pod name in `namespace`."""
    labels = host.split(".")
    if len(labels) >= 4 and labels[3] == "svc":
        return labels[2], labels[0]
    return namespace, labels[0]


def from_labels(host: str, node: Node, config: int) -> WorkerInfo:
    labels = node.metadata.labels
    name = node.metadata.name
    mode_text = labels.get(MODE_LABEL)
    modes = parse_modes(mode_text) if mode_text is not None else None
    problem = None
    if mode_text is None:
        problem = f"not an UltraServer node (no {MODE_LABEL} label)"
    elif modes is None:
        problem = f"{MODE_LABEL} is {mode_text!r}: the UltraServer is not available"
    node_id = DEFAULT_NODE_ID
    raw = labels.get(node_id_label(config))
    if raw is not None:
        try:
            node_id = int(raw)
        except ValueError:
            problem = problem or f"{node_id_label(config)} is {raw!r}, not a number"
    return WorkerInfo(
        worker=host,
        fqdn=host,
        node=name,
        modes=modes,
        server_id=normalize_server_id(labels.get(server_id_label(config), "")),
        node_id=node_id,
        problem=problem,
    )


async def node_names(
    api: KubeAPI, hosts: Sequence[str], namespace: str, parallel: int = 16
) -> dict[str, str]:
    """The node each worker's pod is bound to, for the hosts the API can tell about."""

    async def one(host: str) -> str:
        pod_namespace, pod_name = pod_of(host, namespace)
        try:
            raw = await api.get(f"/api/v1/namespaces/{pod_namespace}/pods/{pod_name}")
            return msgspec.json.decode(raw, type=Pod).spec.nodeName
        except (ApiError, aiohttp.ClientError, TimeoutError, OSError, msgspec.DecodeError):
            return ""

    found = await bounded(hosts, parallel, one)
    return {host: node for host, node in zip(hosts, found, strict=True) if node}


async def gather(
    api: KubeAPI, hosts: Sequence[str], config: int, namespace: str, parallel: int = 16
) -> list[WorkerInfo]:
    async def one(host: str) -> WorkerInfo:
        pod_namespace, pod_name = pod_of(host, namespace)
        try:
            pod = msgspec.json.decode(
                await api.get(f"/api/v1/namespaces/{pod_namespace}/pods/{pod_name}"), type=Pod
            )
        except ApiError as error:
            reason = (
                f"no pod {pod_namespace}/{pod_name}"
                if error.status == 404
                else f"cannot read pod {pod_namespace}/{pod_name}: {error.message}"
            )
            return WorkerInfo(host, host, None, None, problem=reason)
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            return WorkerInfo(host, host, None, None, problem=f"API server unreachable: {error}")
        if not pod.spec.nodeName:
            return WorkerInfo(
                host,
                host,
                None,
                None,
                problem=f"pod {pod_namespace}/{pod_name} is not scheduled to a node",
            )
        try:
            node = msgspec.json.decode(
                await api.get(f"/api/v1/nodes/{pod.spec.nodeName}"), type=Node
            )
        except (ApiError, aiohttp.ClientError, TimeoutError, OSError) as error:
            message = error.message if isinstance(error, ApiError) else str(error)
            return WorkerInfo(
                host, host, pod.spec.nodeName, None, problem=f"cannot read the node: {message}"
            )
        return from_labels(host, node, config)

    return await bounded(hosts, parallel, one)
