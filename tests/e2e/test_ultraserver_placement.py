"""UltraServer placement of MPI job workers under the real kube-scheduler.

Two UltraServers of four trn2u nodes each (a and b; pairs a0/a1, b0/b1). A 2-node job goes to
one pair, a 4-node job must then take the other UltraServer whole, and a second 2-node job the
free pair next to the first. Once with the `ultraserver-affinity` output on plain kube-scheduler
(no extender), once with the extender's unit rule alone (no affinity in the pods).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.builders import node_json
from tests.e2e.harness import Scenario, dump, remove_pods_and_nodes, wait_for
from tests.testbed import ControlPlane, Scheduler

pytestmark = pytest.mark.e2e
PREFIX = "neuron.amazonaws.com/ultraserver-"
S2, S4 = PREFIX + "server-id-2", PREFIX + "server-id-4"
JOBS = [("j1", 2, 2), ("j4", 4, 4), ("j2", 2, 2)]  # (job, workers, node config), in this order


class Fleet:
    """Eight labelled trn2u nodes and the job pods of one test, in its own namespace."""

    def __init__(self, cp: ControlPlane, tag: str, namespace: str, scheduler: str) -> None:
        self.cp, self.tag, self.namespace, self.scheduler = cp, tag, namespace, scheduler
        self.nodes: dict[str, dict[str, str]] = {}
        for unit in ("a", "b"):
            for i in range(4):
                name = f"trn2u-{tag}-{unit}{i}"
                labels = {
                    "neuron-test": tag,
                    PREFIX + "mode": "1_2_4",
                    S4: f"{unit}4{tag}".ljust(16, "x"),
                    PREFIX + "node-id-4": str(i),
                    S2: f"{unit}{i // 2}{tag}".ljust(16, "x"),
                    PREFIX + "node-id-2": str(i % 2),
                }
                body = node_json(name, "trn2u.48xlarge", labels=labels)
                cp.request("POST", "/api/v1/nodes", body)
                self.nodes[name] = labels

    def create_job(self, job: str, workers: int, config: int, spec: dict[str, Any]) -> None:
        for i in range(workers):
            pod_spec = {
                **spec,
                "schedulerName": self.scheduler,
                "nodeSelector": {**spec.get("nodeSelector", {}), "neuron-test": self.tag},
                "containers": [
                    {
                        "name": "worker",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"limits": {"aws.amazon.com/neuron": "16"}},
                    }
                ],
            }
            body = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{job}-worker-{i}",
                    "labels": {
                        "training.kubeflow.org/job-name": job,
                        "training.kubeflow.org/job-role": "worker",
                    },
                    "annotations": {PREFIX + "node-config": str(config)},
                },
                "spec": pod_spec,
            }
            self.cp.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", body)

    def placed(self, job: str, workers: int) -> list[str]:
        """The job's nodes once every worker is bound; on time-out, why they are not."""

        def nodes() -> list[str] | None:
            found = [
                self.cp.request(
                    "GET", f"/api/v1/namespaces/{self.namespace}/pods/{job}-worker-{i}"
                )["spec"].get("nodeName")
                for i in range(workers)
            ]
            return found if all(found) else None

        try:
            return wait_for(nodes, f"job {job} bound", 60)
        except AssertionError:
            events = self.cp.request("GET", f"/api/v1/namespaces/{self.namespace}/events")
            messages = [e.get("message", "") for e in events["items"]][-6:]
            raise AssertionError(f"job {job} not placed: {dump(messages)}") from None

    def run_jobs(self, spec_for: Any) -> None:
        units: dict[str, tuple[set[str], set[str]]] = {}
        for job, workers, config in JOBS:
            self.create_job(job, workers, config, spec_for(job, workers, config))
            nodes = self.placed(job, workers)
            assert len(set(nodes)) == workers, f"{job}: two workers on one node: {nodes}"
            pairs = {self.nodes[n][S2] for n in nodes}
            servers = {self.nodes[n][S4] for n in nodes}
            key = pairs if config == 2 else servers
            assert len(key) == 1, f"{job} (config {config}) is split: {sorted(nodes)}"
            units[job] = (pairs, servers)
        # The 4-node job kept off the UltraServer the first 2-node job was on ...
        assert units["j4"][1].isdisjoint(units["j1"][1])
        # ... and the second 2-node job took the other pair of that UltraServer.
        assert units["j2"][1] == units["j1"][1]
        assert units["j2"][0].isdisjoint(units["j1"][0])

    def cleanup(self) -> None:
        remove_pods_and_nodes(self.cp, self.namespace, self.nodes)


def affinity_cli(job: str, workers: int, config: int) -> dict[str, Any]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_scheduler",
            "ultraserver-affinity",
            "--job-name",
            job,
            "--workers",
            str(workers),
            "--node-config",
            str(config),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    parsed: dict[str, Any] = yaml.safe_load(result.stdout)
    assert set(parsed) == {"nodeSelector", "affinity"}
    return parsed


@pytest.fixture(scope="module")
def plain_scheduler(control_plane: ControlPlane) -> Iterator[Scheduler]:
    """kube-scheduler without our extender: only the affinity decides."""
    scheduler = control_plane.start_scheduler(None, scheduler_name="plain-scheduler")
    yield scheduler
    scheduler.stop()


def test_affinity_output_places_jobs_on_plain_kube_scheduler(
    control_plane: ControlPlane, plain_scheduler: Scheduler
) -> None:
    tag = uuid.uuid4().hex[:6]
    namespace = f"usa-{tag}"
    control_plane.client.ensure_namespace(namespace)
    fleet = Fleet(control_plane, tag, namespace, "plain-scheduler")
    try:
        fleet.run_jobs(affinity_cli)
    finally:
        fleet.cleanup()


def test_extender_rule_places_jobs_without_affinity(scenario: Scenario) -> None:
    fleet = Fleet(scenario.cp, scenario.id, scenario.namespace, "my-scheduler")
    try:
        fleet.run_jobs(lambda job, workers, config: {})
    finally:
        fleet.cleanup()
