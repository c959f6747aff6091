"""Kueue's queue objects as tests and benchmarks create them: a ResourceFlavor, a ClusterQueue
with Neuron device quota per flavor (listing our placement admission check when asked), a
LocalQueue. One copy of the manifests for tests/e2e/test_kueue.py and bench/kueue_admission.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from neuron_scheduler.core.resources import NEURON

API_VERSION = "kueue.x-k8s.io/v1beta2"


def resource_flavor(name: str, node_labels: Mapping[str, str], topology: str = "") -> Any:
    """`topology`: the Topology its nodes are in (Kueue's topology-aware scheduling), if any."""
    spec: dict[str, Any] = {"nodeLabels": dict(node_labels)}
    if topology:
        spec["topologyName"] = topology
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceFlavor",
        "metadata": {"name": name},
        "spec": spec,
    }


def cluster_queue(
    name: str,
    quotas: Mapping[str, int],
    check: str = "",
    preemption: Mapping[str, str] | None = None,
) -> Any:
    """Quota of `aws.amazon.com/neuron` devices per flavor (`quotas`, in order), for every
    namespace; `check`: an AdmissionCheck every workload must pass; `preemption`: Kueue's own
    (e.g. withinClusterQueue: LowerPriority)."""
    spec: dict[str, Any] = {"namespaceSelector": {}}
    if preemption:
        spec["preemption"] = dict(preemption)
    if check:
        spec["admissionChecksStrategy"] = {"admissionChecks": [{"name": check}]}
    spec["resourceGroups"] = [
        {
            "coveredResources": [NEURON],
            "flavors": [
                {"name": flavor, "resources": [{"name": NEURON, "nominalQuota": str(quota)}]}
                for flavor, quota in quotas.items()
            ],
        }
    ]
    return {
        "apiVersion": API_VERSION,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": spec,
    }


def local_queue(name: str, cluster_queue_name: str) -> Any:
    return {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": {"name": name},
        "spec": {"clusterQueue": cluster_queue_name},
    }
