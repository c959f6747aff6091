"""Worker facts from the Kubernetes API: worker pod -> its node -> the UltraServer labels."""

from __future__ import annotations

from collections.abc import Sequence

from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.errors import READ_ERRORS, NotFound, error_text
from neuron_scheduler.kube.objects import Node
from neuron_scheduler.ultraserver.labels import (
    DEFAULT_NODE_ID,
    MODE_LABEL,
    node_id_label,
    normalize_server_id,
    parse_modes,
    server_id_label,
)
from neuron_scheduler.ultraserver.launcher.ranking import WorkerInfo
from neuron_scheduler.ultraserver.launcher.ssh import bounded


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
            return (await api.get_pod(pod_namespace, pod_name)).spec.nodeName
        except READ_ERRORS:
            return ""

    found = await bounded(hosts, parallel, one)
    return {host: node for host, node in zip(hosts, found, strict=True) if node}


async def gather(
    api: KubeAPI, hosts: Sequence[str], config: int, namespace: str, parallel: int = 16
) -> list[WorkerInfo]:
    async def one(host: str) -> WorkerInfo:
        pod_namespace, pod_name = pod_of(host, namespace)
        try:
            pod = await api.get_pod(pod_namespace, pod_name)
        except NotFound:
            return WorkerInfo(host, host, None, None, problem=f"no pod {pod_namespace}/{pod_name}")
        except READ_ERRORS as error:
            reason = f"cannot read pod {pod_namespace}/{pod_name}: {error_text(error)}"
            return WorkerInfo(host, host, None, None, problem=reason)
        if not pod.spec.nodeName:
            return WorkerInfo(
                host,
                host,
                None,
                None,
                problem=f"pod {pod_namespace}/{pod_name} is not scheduled to a node",
            )
        try:
            node = await api.get_node(pod.spec.nodeName)
        except READ_ERRORS as error:
            return WorkerInfo(
                host,
                host,
                pod.spec.nodeName,
                None,
                problem=f"cannot read the node: {error_text(error)}",
            )
        return from_labels(host, node, config)

    return await bounded(hosts, parallel, one)
