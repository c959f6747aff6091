"""The training-job world of the end-to-end tests (issues 32, 40 and 47): nodes, jobs' member
pods, what got bound where, claims, events and `status`, on a testbed control plane with the
extender and my-scheduler. Used by test_ultraserver_gangs.py (UltraServer units) and
test_training_jobs.py (nodes of their own, in network domains)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from tests.builders import node_json
from tests.e2e.chart import EXTENDER, apply, find, render
from tests.e2e.harness import wait_for
from tests.testbed import (
    ControlPlane,
    ExtenderProcess,
    KubeError,
    Scheduler,
    Stack,
    scheduler_config,
)
from tests.testbed.kubeversion import WorkloadApi
from tests.testbed.standin import KubeletStandIn

PREFIX = "neuron.amazonaws.com/ultraserver-"
S4 = PREFIX + "server-id-4"
CLAIMS = "/apis/neuron-scheduler.io/v1alpha1/ultraserverclaims"
SETTLE = 8.0  # seconds a refused job is watched to stay unplaced (a check, never a speed bound)


class Gangs:
    """A module's cluster: its nodes (`units` names UltraServers a, b, ...), an extender and
    my-scheduler."""

    def __init__(
        self,
        cp: ControlPlane,
        stack: Stack,
        units: tuple[str, ...] = ("a", "b"),
        workload: WorkloadApi | None = None,
    ) -> None:
        self.cp, self.stack = cp, stack
        self.workload = workload  # the Workload API this cluster serves, if any
        self.units: dict[str, str] = {}  # node -> its UltraServer, or its layer-3 domain
        for unit in units:
            self.add_unit(unit)
        self.namespace = ""

    def add_unit(self, unit: str) -> list[str]:
        """Four trn2u nodes of one UltraServer (server id `unit` x 16); their names."""
        names = []
        for i in range(4):
            name = f"trn2u-{unit}{i}"
            labels = {PREFIX + "mode": "1_2_4", S4: f"{unit}" * 16, PREFIX + "node-id-4": str(i)}
            self.cp.request(
                "POST", "/api/v1/nodes", node_json(name, "trn2u.48xlarge", labels=labels)
            )
            self.units[name] = unit
            names.append(name)
        return names

    def add_nodes(
        self, names: list[str], domain: str = "", instance_type: str = "trn1.32xlarge"
    ) -> list[str]:
        """Nodes of their own (no UltraServer labels), in layer-3 domain `domain` (EKS's network
        labels: one layer-1 and one layer-2 domain for all; "" none)."""
        labels = {}
        if domain:
            labels = {
                "topology.k8s.aws/network-node-layer-1": "nn-1",
                "topology.k8s.aws/network-node-layer-2": "nn-2",
                "topology.k8s.aws/network-node-layer-3": domain,
            }
        for name in names:
            self.cp.request("POST", "/api/v1/nodes", node_json(name, instance_type, labels=labels))
            self.units[name] = domain
        return names

    def remove_nodes(self, names: list[str]) -> None:
        for name in names:
            self.cp.request("DELETE", f"/api/v1/nodes/{name}")
            del self.units[name]

    def fresh(self) -> str:
        self.namespace = f"g-{uuid.uuid4().hex[:8]}"
        self.cp.client.ensure_namespace(self.namespace)
        return self.namespace

    def start_scheduler(self, extender: ExtenderProcess) -> Scheduler:
        """my-scheduler calling `extender`, with the Workload API's gates where the cluster
        serves it."""
        config = scheduler_config(
            extender_url=extender.url, node_cache_capable=True, pki=self.stack.pki
        )
        gates = self.workload.scheduler_gates if self.workload is not None else {}
        return self.cp.start_scheduler(config=config, feature_gates=gates)

    def job(
        self,
        job: str,
        members: int,
        size: int | None = None,
        scheduler: str = "my-scheduler",
        first: int = 0,
        priority_class: str = "",
    ) -> list[str]:
        """An MPIJob's worker pods `first`.. (its launcher asks for no device: not created)."""
        names = []
        for i in range(first, first + members):
            labels = {
                "training.kubeflow.org/job-name": job,
                "training.kubeflow.org/job-role": "worker",
            }
            annotations = {"neuron-scheduler.io/gang-size": str(size or members)}
            name = f"{job}-worker-{i}"
            self.pod(name, labels, annotations, scheduler, priority_class)
            names.append(name)
        return names

    def pod(
        self,
        name: str,
        labels: dict[str, str],
        annotations: dict[str, str],
        scheduler: str = "my-scheduler",
        priority_class: str = "",
        node_selector: dict[str, str] | None = None,
        devices: int = 16,
    ) -> None:
        """A pod asking for `devices` Neuron devices (a whole trn2u or trn1 node: 16)."""
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": labels, "annotations": annotations},
            "spec": {
                **({"priorityClassName": priority_class} if priority_class else {}),
                **({"nodeSelector": node_selector} if node_selector else {}),
                "schedulerName": scheduler,
                "containers": [
                    {
                        "name": "worker",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"limits": {"aws.amazon.com/neuron": str(devices)}},
                    }
                ],
            },
        }
        self.cp.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", body)

    def priority_class(self, value: int, preempts: bool = True) -> str:
        """A PriorityClass of this value (cluster-scoped, named for it; made once); `preempts`
        False: its pods never preempt (preemptionPolicy Never)."""
        name = f"gangs-{value}" + ("" if preempts else "-never")
        body = {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": name},
            "value": value,
            **({} if preempts else {"preemptionPolicy": "Never"}),
        }
        with contextlib.suppress(KubeError):  # made by an earlier test
            self.cp.request("POST", "/apis/scheduling.k8s.io/v1/priorityclasses", body)
        return name

    def apply(self, path: Path) -> list[str]:
        """An example manifest's objects in this test's namespace; the pods' names."""
        pods = []
        for doc in yaml.safe_load_all(path.read_text()):
            doc["metadata"]["namespace"] = self.namespace
            if doc["kind"] == "Pod":
                self.cp.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", doc)
                pods.append(doc["metadata"]["name"])
            else:
                # The example is written for the newest version; the one this cluster serves.
                assert self.workload is not None, "a PodGroup on a cluster without PodGroups"
                doc["apiVersion"] = self.workload.group_version
                path_ = f"/apis/{self.workload.group_version}/namespaces/{self.namespace}/podgroups"
                self.cp.request("POST", path_, doc)
        return pods

    def nodes(self, pods: list[str]) -> dict[str, str]:
        """pod -> node, for the bound ones."""
        return {
            p["metadata"]["name"]: p["spec"]["nodeName"]
            for p in self.listed()
            if p["metadata"]["name"] in pods and p["spec"].get("nodeName")
        }

    def placed(self, pods: list[str], seconds: float = 60) -> dict[str, str]:
        def all_bound() -> dict[str, str] | None:
            found = self.nodes(pods)
            return found if len(found) == len(pods) else None

        try:
            return wait_for(all_bound, f"{len(pods)} pods bound", seconds)
        except AssertionError:
            raise AssertionError(f"not all bound ({self.nodes(pods)}): {self.messages()}") from None

    def one_unit_each(self, placed: dict[str, str], units: int = 1) -> set[str]:
        nodes = list(placed.values())
        assert len(set(nodes)) == len(nodes), f"two members on one node: {placed}"
        found = {self.units[n] for n in nodes}
        assert len(found) == units, f"members split over {found}: {placed}"
        return found

    def stays_unplaced(self, pods: list[str]) -> None:
        deadline = time.monotonic() + SETTLE
        while time.monotonic() < deadline:
            assert not self.nodes(pods), f"a member bound: {self.nodes(pods)}"
            time.sleep(0.25)

    def messages(self, contains: str = "") -> list[str]:
        events = self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/events")["items"]
        return [e.get("message", "") for e in events if contains in e.get("message", "")]

    def why(self, pod: str) -> dict[str, Any]:
        """`neuron-scheduler why --json` on one of this test's pods, as an operator runs it."""
        return self._cli("why", pod, "-n", self.namespace)

    def status(self) -> dict[str, Any]:
        """`neuron-scheduler status --json` as an operator runs it (the UltraServers part)."""
        found: dict[str, Any] = self._cli("status")["ultraservers"]
        return found

    def _cli(self, *command: str) -> dict[str, Any]:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "neuron_scheduler",
                *command,
                "--json",
                "--kubeconfig",
                str(self.cp.kubeconfig_path),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        found: dict[str, Any] = json.loads(result.stdout)
        return found

    def claims(self) -> dict[str, str]:
        """node -> the job its claim holds it for (namespace/name)."""
        listed = self.cp.request("GET", CLAIMS)
        return {
            i["metadata"]["name"]: f"{i['spec']['namespace']}/{i['spec']['job']}"
            for i in listed["items"]
        }

    def leaving(self) -> list[str]:
        """The pods of this test's namespace that are terminating (deleted, not gone yet)."""
        return sorted(
            p["metadata"]["name"] for p in self.listed() if p["metadata"].get("deletionTimestamp")
        )

    def delete(self, pods: list[str]) -> None:
        for pod in pods:
            self.cp.request(
                "DELETE",
                f"/api/v1/namespaces/{self.namespace}/pods/{pod}?gracePeriodSeconds=0",
            )

    def clear(self) -> None:
        """This test's pods gone, and with them every claim (the loop ends a gone job's)."""
        if self.namespace:
            self.delete([p["metadata"]["name"] for p in self.listed()])
            wait_for(lambda: not self.listed(), "this test's pods gone", 60)
        wait_for(lambda: not self.claims(), "every claim to end once its job is gone", 60)

    def listed(self) -> list[dict[str, Any]]:
        """This test's pods as the API server lists them."""
        found: list[dict[str, Any]] = self.cp.request(
            "GET", f"/api/v1/namespaces/{self.namespace}/pods"
        )["items"]
        return found

    def job_log(self) -> str:
        """The extender's lines about this test's jobs (claims, shortfalls), for a failure."""
        path = self.stack.extender.process.log_path
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError as error:
            return f"(no extender log: {error})"
        mine = [line for line in lines if self.namespace in line and "Filtered" not in line]
        return "\n".join(line for line in mine if "Failed nodes" not in line)[-6000:]


def election_rbac(cp: ControlPlane) -> None:
    """The chart's leader-election Role (one Lease, by name), bound to the testbed's extender
    account, as the chart binds it to its own."""
    docs = render({"scheduler": {"replicas": 2}, "devicePlugin": {"enabled": False}})
    role = find(docs, "Role", f"{EXTENDER}-leader-election")
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": f"{EXTENDER}-leader-election", "namespace": "kube-system"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        },
        "subjects": [
            {"kind": "ServiceAccount", "name": "neuron-scheduler", "namespace": "kube-system"}
        ],
    }
    apply(cp, [role, binding])


def evicted(world: Gangs, stand_in: KubeletStandIn) -> dict[str, list[str]]:
    """The pods deleted (finished by the stand-in, or still terminating), by job."""
    found: dict[str, list[str]] = {}
    for name in sorted({*stand_in.finished, *world.leaving()}):
        found.setdefault(name.rsplit("-worker-", 1)[0], []).append(name)
    return found


def nobody_evicted(world: Gangs, stand_in: KubeletStandIn, waiting: list[str]) -> None:
    """For SETTLE seconds: no pod evicted, none of `waiting` bound."""
    deadline = time.monotonic() + SETTLE
    while time.monotonic() < deadline:
        assert not evicted(world, stand_in), f"evicted: {evicted(world, stand_in)}"
        assert not world.nodes(waiting), f"bound: {world.nodes(waiting)}"
        time.sleep(0.25)
