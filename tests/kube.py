"""Builders for Kubernetes objects as the API server returns them (JSON dicts), for tests."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from neuron_scheduler.objects import Node, Pod

_uids = itertools.count(1)

CAPACITY = {
    "inf1.6xlarge": (4, 16),
    "inf1.24xlarge": (16, 64),
    "inf2.24xlarge": (6, 12),
    "inf2.48xlarge": (12, 24),
    "trn1.32xlarge": (16, 32),
    "trn2.48xlarge": (16, 64),
}


def node_json(
    name: str, instance_type: str, *, allocatable_cores: int | None = None
) -> dict[str, Any]:
    capacity = {"cpu": "192", "memory": "768Gi", "pods": "110"}
    if instance_type in CAPACITY:  # other types are CPU-only nodes
        devices, cores = CAPACITY[instance_type]
        capacity["aws.amazon.com/neuron"] = str(devices)
        capacity["aws.amazon.com/neurondevice"] = str(devices)
        capacity["aws.amazon.com/neuroncore"] = str(cores)
    allocatable = dict(capacity)
    if allocatable_cores is not None:
        allocatable["aws.amazon.com/neuroncore"] = str(allocatable_cores)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"node.kubernetes.io/instance-type": instance_type}},
        "status": {"capacity": capacity, "allocatable": allocatable},
    }


def pod_json(
    name: str,
    limits: dict[str, int] | list[dict[str, int]],
    *,
    namespace: str = "default",
    node: str = "",
    annotations: dict[str, str] | None = None,
    phase: str = "Pending",
    uid: str | None = None,
) -> dict[str, Any]:
    per_container = limits if isinstance(limits, list) else [limits]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{next(_uids)}",
            "annotations": annotations or {},
        },
        "spec": {
            "nodeName": node,
            "schedulerName": "my-scheduler",
            "containers": [
                {
                    "name": f"c{i}",
                    "image": "busybox",
                    "resources": {"limits": {k: str(v) for k, v in c.items()}},
                }
                for i, c in enumerate(per_container)
            ],
        },
        "status": {"phase": phase},
    }


def node(name: str, instance_type: str, **kwargs: Any) -> Node:
    return msgspec.convert(node_json(name, instance_type, **kwargs), Node)


def pod(name: str, limits: dict[str, int] | list[dict[str, int]], **kwargs: Any) -> Pod:
    return msgspec.convert(pod_json(name, limits, **kwargs), Pod)
