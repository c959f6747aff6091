"""The worlds of the preemption tests (tests/e2e/test_preemption.py) and bench/preemption.py."""

from __future__ import annotations

import time
from typing import Any

from neuron_scheduler.core.resources import NEURON
from tests.e2e.harness import Scenario, ids, wait_for
from tests.testbed.standin import KubeletStandIn

LOW, HIGH = 10, 1000


def running(scenario: Scenario, names: list[str]) -> dict[str, dict[str, Any]]:
    """Wait until the named pods are bound and started; name -> pod."""

    def check() -> dict[str, dict[str, Any]] | None:
        pods = {p["metadata"]["name"]: p for p in scenario.pods()}
        ready = {
            n: pods[n]
            for n in names
            if n in pods and pods[n].get("status", {}).get("startTime") and ids(pods[n])
        }
        return ready if len(ready) == len(names) else None

    return wait_for(check, f"{len(names)} pods running", 120)


def fill(scenario: Scenario, prefix: str, count: int, priority_class: str) -> list[str]:
    names = [f"{prefix}-{i}" for i in range(count)]
    for name in names:
        scenario.create_pod(name, {NEURON: 1}, priority_class=priority_class)
    running(scenario, names)
    return names


def device_owners(scenario: Scenario, node: str) -> dict[int, str]:
    return {
        ids(p)[0]: p["metadata"]["name"]
        for p in scenario.pods()
        if p["spec"].get("nodeName") == node and ids(p) and len(ids(p)) == 1
    }


def replace_youngest(
    scenario: Scenario, node: str, devices: list[int], prefix: str, priority_class: str
) -> list[str]:
    """Churn: the pods on `devices` go and new ones take their places, so the node's youngest
    pods (kube-scheduler's first victims) sit on exactly those devices."""
    owners = device_owners(scenario, node)
    gone = [owners[d] for d in devices]
    for name in gone:
        scenario.delete_pod(name)
    wait_for(lambda: not {p["metadata"]["name"] for p in scenario.pods()} & set(gone), "pods gone")
    time.sleep(1.1)  # start times have second resolution: the new pods must be younger
    names = fill(scenario, prefix, len(devices), priority_class)
    owners = device_owners(scenario, node)
    assert sorted(owners[d] for d in devices) == sorted(names)
    return names


def evicted_devices(stand_in: KubeletStandIn, owners: dict[int, str]) -> list[int]:
    by_name = {name: device for device, name in owners.items()}
    return sorted(by_name[name] for name in stand_in.finished if name in by_name)


def is_row(devices: list[int]) -> bool:
    first = devices[0] if devices else -1
    return first % 4 == 0 and devices == list(range(first, first + 4))


def row_world(scenario: Scenario) -> tuple[str, KubeletStandIn, dict[int, str], str]:
    """Issue 18 (a) and (b): a trn1.32xlarge of 16 one-device low-priority pods, the youngest
    one per row (devices 0, 5, 10, 15). (node, stand-in, device -> pod, high PriorityClass)"""
    low, high = scenario.priority_class("low", LOW), scenario.priority_class("high", HIGH)
    stand_in = scenario.kubelet_stand_in()
    node = scenario.add_node("trn1.32xlarge")
    fill(scenario, "low", 16, low)
    replace_youngest(scenario, node, [0, 5, 10, 15], "young", low)
    return node, stand_in, device_owners(scenario, node), high
