"""The one place tests build Kubernetes Nodes and Pods: as JSON dicts (what the API server takes and
returns) or decoded into our structs. A node's Neuron capacity comes from the built-in catalog, so
a test never restates an instance type's devices and cores."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from neuron_scheduler.core.catalog import INSTANCE_TYPE_LABEL, Catalog
from neuron_scheduler.core.health import UNHEALTHY_DEVICES
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE
from neuron_scheduler.kube.objects import Node, Pod

_uids = itertools.count(1)
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"
# Instance types whose device count the catalog takes from the node (trn3) need one given.
SWITCH_DEVICES = 16


def neuron_capacity(instance_type: str) -> tuple[int, int]:
    """(devices, cores) a node of this type advertises, from the built-in catalog."""
    catalog = Catalog.builtin()
    if not catalog.knows(instance_type):
        raise KeyError(f"{instance_type} is not in the built-in catalog")
    devices = catalog.device_count(instance_type) or SWITCH_DEVICES
    topology = catalog.resolve(instance_type, devices).topology
    return topology.devices, topology.total_cores


def node_json(
    name: str,
    instance_type: str,
    *,
    devices: int | None = None,
    cores: int | None = None,
    allocatable_cores: int | None = None,
    labels: Mapping[str, str] | None = None,
    failed: Sequence[int] = (),
    published: bool = True,
) -> dict[str, Any]:
    """A Ready node. Neuron capacity: `devices`/`cores` when given, else the catalog's for its
    type; a type the catalog does not know is a CPU-only node. `failed` devices are left out of
    allocatable, as the kubelet leaves out devices its plugin reports Unhealthy, and named in the
    plugin's annotation when `published`."""
    capacity = {"cpu": "192", "memory": "768Gi", "pods": "110"}
    if devices is None and cores is None and Catalog.builtin().knows(instance_type):
        devices, cores = neuron_capacity(instance_type)
    if devices is not None:
        capacity[NEURON] = str(devices)
        capacity[NEURONDEVICE] = str(devices)
    if cores is not None:
        capacity[NEURONCORE] = str(cores)
    allocatable = dict(capacity)
    if failed and devices is not None and cores is not None:
        allocatable[NEURON] = allocatable[NEURONDEVICE] = str(devices - len(failed))
        allocatable[NEURONCORE] = str(cores - len(failed) * (cores // devices))
    if allocatable_cores is not None:
        allocatable[NEURONCORE] = str(allocatable_cores)
    annotations = {UNHEALTHY_DEVICES: ",".join(map(str, failed))} if failed and published else {}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                INSTANCE_TYPE_LABEL: instance_type,
                **(labels or {}),
            },
            "annotations": annotations,
        },
        "spec": {},
        # Accepted on create; with no kubelet or node controller to change it, the node stays
        # Ready and untainted.
        "status": {
            "capacity": capacity,
            "allocatable": allocatable,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "fake node created by a neuron-scheduler test",
                }
            ],
        },
    }


def pod_json(
    name: str,
    limits: Mapping[str, int] | list[Mapping[str, int]],
    *,
    namespace: str = "default",
    node: str = "",
    annotations: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    phase: str = "Pending",
    uid: str | None = None,
    scheduler: str = "my-scheduler",
    node_selector: Mapping[str, str] | None = None,
    init_limits: list[Mapping[str, int]] | None = None,
    gates: Sequence[str] = (),
) -> dict[str, Any]:
    """A pod with one container per entry of `limits` (`c0`, `c1`, ...). `uid` and `status` are
    what the API server would fill in; it ignores them on create."""

    def containers(prefix: str, each: list[Mapping[str, int]]) -> list[dict[str, Any]]:
        return [
            {
                "name": f"{prefix}{i}",
                "image": PAUSE_IMAGE,
                "resources": {"limits": {k: str(v) for k, v in c.items()}},
            }
            for i, c in enumerate(each)
        ]

    spec: dict[str, Any] = {
        "schedulerName": scheduler,
        "containers": containers("c", limits if isinstance(limits, list) else [limits]),
    }
    if node:
        spec["nodeName"] = node
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if init_limits:
        spec["initContainers"] = containers("init", init_limits)
    if gates:
        spec["schedulingGates"] = [{"name": gate} for gate in gates]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{next(_uids)}",
            "labels": dict(labels or {}),
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
        "status": {"phase": phase},
    }


def node(name: str, instance_type: str, **kwargs: Any) -> Node:
    return msgspec.convert(node_json(name, instance_type, **kwargs), Node)


def pod(name: str, limits: Mapping[str, int] | list[Mapping[str, int]], **kwargs: Any) -> Pod:
    return msgspec.convert(pod_json(name, limits, **kwargs), Pod)
