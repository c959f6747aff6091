"""Pure builders for the objects the testbed feeds to Kubernetes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NEURON = "aws.amazon.com/neuron"
NEURONCORE = "aws.amazon.com/neuroncore"
NEURONDEVICE = "aws.amazon.com/neurondevice"
NEURON_RESOURCES = (NEURON, NEURONCORE, NEURONDEVICE)


def scheduler_config(
    *,
    scheduler_name: str = "my-scheduler",
    extender_url: str | None = None,
    node_cache_capable: bool = False,
    kubeconfig: str | None = None,
) -> dict[str, Any]:
    """A KubeSchedulerConfiguration with one profile and, optionally, our extender.

    Without kubeconfig the scheduler uses its in-cluster service account, which
    is what the Helm chart deploys; the testbed passes one.
    """
    config: dict[str, Any] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "leaderElection": {"leaderElect": False},
        "profiles": [{"schedulerName": scheduler_name}],
    }
    if kubeconfig is not None:
        config["clientConnection"] = {"kubeconfig": kubeconfig}
    if extender_url is not None:
        config["extenders"] = [
            {
                "urlPrefix": extender_url,
                "filterVerb": "filter",
                "prioritizeVerb": "prioritize",
                "weight": 1,
                "bindVerb": "bind",
                "nodeCacheCapable": node_cache_capable,
                # A down extender must fail scheduling, not silently bypass it.
                "ignorable": False,
                # ignoredByScheduler false: the in-tree fit check still counts
                # these, so the extender only sees nodes with enough capacity.
                "managedResources": [
                    {"name": r, "ignoredByScheduler": False} for r in NEURON_RESOURCES
                ],
            }
        ]
    return config


def fake_neuron_node(
    name: str,
    instance_type: str,
    neuron: int,
    neuroncore: int,
    extra_labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Ready Node with Neuron capacity, to POST to /api/v1/nodes.

    The status is accepted on create; no kubelet or node controller exists to
    change it later, so the node stays Ready and untainted.
    """
    resources = {
        "cpu": "192",
        "memory": "768Gi",
        "pods": "110",
        NEURON: str(neuron),
        NEURONDEVICE: str(neuron),
        NEURONCORE: str(neuroncore),
    }
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": instance_type,
        **(extra_labels or {}),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "spec": {},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "fake node created by neuron_scheduler.testbed",
                }
            ],
        },
    }
