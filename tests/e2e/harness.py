"""One end-to-end test's world: its namespace, its fake Neuron nodes, its pods."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from neuron_scheduler.core.allocation import torus_count_warning
from tests.builders import node_json, pod_json
from tests.testbed import ControlPlane, KubeError, Stack
from tests.testbed.standin import KubeletStandIn

ROOT = Path(__file__).resolve().parents[2]
WARNING_7 = torus_count_warning("trn1.32xlarge", 7)

T = TypeVar("T")

# Stacks of modules with a control plane of their own (test_kueue): a failed test shows their
# logs too, as it shows the session stack's (conftest).
own_stacks: list[Stack] = []


def wait_for(check: Callable[[], T | None], what: str, seconds: float = 60.0) -> T:
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {seconds:.0f}s waiting for {what}")
        time.sleep(0.1)


class Scenario:
    """One test's nodes and namespace, isolated from other tests by a label and a selector."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.cp = stack.cp
        self.id = uuid.uuid4().hex[:8]
        self.namespace = f"t-{self.id}"
        self.cp.client.ensure_namespace(self.namespace)
        self.nodes: list[str] = []
        self.priority_classes: list[str] = []
        self.stand_ins: list[KubeletStandIn] = []

    def add_node(self, instance_type: str, name: str | None = None) -> str:
        name = name or f"{instance_type.replace('.', '-')}-{self.id}-{len(self.nodes)}"
        body = node_json(name, instance_type, labels={"neuron-test": self.id})
        self.cp.request("POST", "/api/v1/nodes", body)
        self.nodes.append(name)
        return name

    def priority_class(self, name: str, value: int) -> str:
        """A PriorityClass for this test (cluster-wide, so named with the test's id)."""
        full = f"{self.id}-{name}"
        body = {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": full},
            "value": value,
        }
        self.cp.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", body)
        self.priority_classes.append(full)
        return full

    def kubelet_stand_in(self, finish_after: float = 0.0) -> KubeletStandIn:
        """Starts this namespace's bound pods and finishes its terminating ones (named as what
        it is: tests/testbed/standin.py); stopped at cleanup."""
        stand_in = KubeletStandIn(self.cp.client, self.namespace, finish_after)
        stand_in.__enter__()
        self.stand_ins.append(stand_in)
        return stand_in

    def pod_body(
        self,
        name: str,
        limits: dict[str, int] | list[dict[str, int]],
        annotations: dict[str, str] | None = None,
        scheduler: str = "my-scheduler",
        priority_class: str = "",
        isolated: bool = True,
    ) -> dict[str, Any]:
        """isolated: a nodeSelector keeps the pod on this test's nodes."""
        body = pod_json(
            name,
            limits,
            namespace=self.namespace,
            annotations=annotations,
            scheduler=scheduler,
            node_selector={"neuron-test": self.id} if isolated else None,
        )
        for server_side in ("uid", "labels"):
            del body["metadata"][server_side]
        del body["status"]
        if priority_class:
            body["spec"]["priorityClassName"] = priority_class
        return body

    def create_pod(
        self, name: str, limits: dict[str, int] | list[dict[str, int]], **kwargs: Any
    ) -> dict[str, Any]:
        body = self.pod_body(name, limits, **kwargs)
        created: dict[str, Any] = self.cp.request(
            "POST", f"/api/v1/namespaces/{self.namespace}/pods", body
        )
        return created

    def pod(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.cp.request(
            "GET", f"/api/v1/namespaces/{self.namespace}/pods/{name}"
        )
        return found

    def pods(self) -> list[dict[str, Any]]:
        listed: dict[str, Any] = self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/pods")
        return list(listed["items"])

    def wait_bound(self, name: str, seconds: float = 60) -> dict[str, Any]:
        def bound() -> dict[str, Any] | None:
            pod = self.pod(name)
            return pod if pod["spec"].get("nodeName") else None

        return wait_for(bound, f"pod {name} to be bound", seconds)

    def wait_all_bound(self, seconds: float) -> None:
        """Every pod of the scenario bound; on time-out, says which are not and why."""
        try:
            wait_for(
                lambda: all(p["spec"].get("nodeName") for p in self.pods()),
                "every pod to be bound",
                seconds,
            )
        except AssertionError:
            pending = [p["metadata"]["name"] for p in self.pods() if not p["spec"].get("nodeName")]
            reasons = {n: [e.get("message", "") for e in self.events(n)][-2:] for n in pending[:5]}
            raise AssertionError(f"{len(pending)} pods not bound, e.g. {dump(reasons)}") from None

    def events(self, name: str) -> list[dict[str, Any]]:
        listed = self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/events")
        return [e for e in listed["items"] if e["involvedObject"].get("name") == name]

    def wait_event(
        self, name: str, reason: str, contains: str = "", seconds: float = 60
    ) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            for event in self.events(name):
                if event["reason"] == reason and contains in event.get("message", ""):
                    return event
            return None

        return wait_for(find, f"{reason} event on {name} containing {contains!r}", seconds)

    def delete_pod(self, name: str) -> None:
        with contextlib.suppress(KubeError):
            self.cp.request(
                "DELETE", f"/api/v1/namespaces/{self.namespace}/pods/{name}?gracePeriodSeconds=0"
            )

    def cleanup(self) -> None:
        for stand_in in self.stand_ins:
            stand_in.stop()
        remove_pods_and_nodes(self.cp, self.namespace, self.nodes)
        for name in self.priority_classes:
            with contextlib.suppress(KubeError):
                self.cp.request("DELETE", f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")


def remove_pods_and_nodes(cp: ControlPlane, namespace: str, nodes: list[str]) -> None:
    """A test's leftovers: every pod in its namespace (at once), then its nodes."""
    listed = cp.request("GET", f"/api/v1/namespaces/{namespace}/pods")
    for item in listed["items"]:
        with contextlib.suppress(KubeError):
            cp.request(
                "DELETE",
                f"/api/v1/namespaces/{namespace}/pods/{item['metadata']['name']}"
                "?gracePeriodSeconds=0",
            )
    for node in nodes:
        with contextlib.suppress(KubeError):
            cp.request("DELETE", f"/api/v1/nodes/{node}")


def bound(scenario: Scenario, prefix: str) -> dict[int, str]:
    """device -> name of the running pod whose name starts with `prefix` holding it (pods of
    one device each)."""
    return {
        ids(p)[0]: p["metadata"]["name"]
        for p in scenario.pods()
        if p["metadata"]["name"].startswith(prefix)
        and p["spec"].get("nodeName")
        and not p["metadata"].get("deletionTimestamp")
        and ids(p)
    }


def ids(pod: dict[str, Any], key: str = "AWS_NEURON_IDS") -> list[int]:
    text = pod["metadata"].get("annotations", {}).get(key, "")
    return [int(x) for x in text.split(",") if x]


def dump(value: Any) -> str:
    return json.dumps(value, indent=1)[:4000]


def command_json(cp: ControlPlane, *args: str) -> dict[str, Any]:
    """`neuron-scheduler ARGS --json` as a person runs it (`status`, `why POD -n NS`), with the
    admin kubeconfig; its JSON answer."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_scheduler",
            *args,
            "--json",
            "--kubeconfig",
            str(cp.kubeconfig_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    answer: dict[str, Any] = json.loads(out.stdout)
    return answer
