"""Worker facts from the Kubernetes API: worker pod -> its node -> the UltraServer labels."""

from __future__ import annotations

from collections.abc import Sequence

from neuron_scheduler.jobs.units import MODE_LABEL, node_id_label, server_id_label
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.errors import READ_ERRORS, NotFound, error_text
from neuron_scheduler.kube.objects import Node
from neuron_scheduler.ultraserver.launcher.ranking import FactNames, WorkerInfo, read_worker
from neuron_scheduler.ultraserver.launcher.ssh import bounded


def pod_of(host: str, namespace: str) -> tuple[str, str]:
    """(namespace, pod name) for a hostfile host: `<pod>.<service>.<namespace>.svc[...]` as the
    MPI operator writes it, or a bare pod name in `namespace`."""
    labels = host.split(".")
    if len(labels) >= 4 and labels[3] == "svc":
        return labels[2], labels[0]
    return namespace, labels[0]


def from_labels(host: str, node: Node, config: int) -> WorkerInfo:
    names = FactNames(
        no_modes=f"not an UltraServer node (no {MODE_LABEL} label)",
        modes=f"{MODE_LABEL} is",
        node_id=node_id_label(config),
    )
    keys = (MODE_LABEL, server_id_label(config), node_id_label(config))
    return read_worker(host, host, node.metadata.name, node.metadata.labels, keys, names)


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
