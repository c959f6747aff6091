"""Kueue's quota against a fragmented fleet, with and without the placement admission check
(issue 48 part 5, docs/kueue.md).

Real Kueue v0.17.0 (tools/kueue.mk) in front of the real kube-scheduler v1.36.3 and our extender
(the check on, `--kueue-hold-seconds`), on the testbed. For each configuration a fleet of its
own: `--inf2` inf2.48xlarge rings and `--trn1` trn1.32xlarge nodes, each filled with 1-device
pods outside Kueue and then fragmented: one free run (RUNS: 3 to 5 devices on inf2, 4 or 8 on
trn1) and single free devices after it, every other one. A ResourceFlavor per instance type, one
ClusterQueue whose quota in each flavor is exactly the devices free there by count (what
Kueue's own view of the fleet says fits), its LocalQueue, and `--workloads` batch/v1 Jobs of one
pod each (seeded, the same in both configurations): an instance type (its nodeSelector), a size
that type hands out (SIZES: 1 to 4 devices on inf2, 1 to 8 on trn1), and a run of `--run-seconds`
once its pod is Running (this script is their kubelet: it starts bound pods, finishes them after
their time, removes terminating ones). Each workload fits on some node once the run there is
free: with the check, every one can finish. Kueue runs waitForPodsReady (timeout
`--pods-ready-seconds`, backoff 5 s doubling to 30 s, 2 requeues, then the workload is
deactivated) as SageMaker HyperPod's task governance does.

- without: the ClusterQueue lists no admission check (Kueue admits by quota alone);
- with: it lists the placement check (AdmissionCheck of controllerName
  neuron-scheduler.io/placement).

Reported, per configuration:
- admitted, could not run: workloads admitted at least once whose pods did not all run before
  that admission ended (evicted, or still waiting at the end), and how many such admissions;
- quota-seconds held by them: their devices times the seconds those admissions lasted;
- evictions by the pods-ready timeout (Evicted, reason PodsReadyTimeout), and workloads
  deactivated (Kueue gave up on them);
- time until all finished (from the first Job's creation; "never" when some were deactivated or
  `--cap` passed: then how many finished, and when the last did).

Run: uv run python bench/kueue_admission.py [--workloads 36] [--inf2 4] [--trn1 3] [--seed 1]
     [--run-seconds 30 90] [--pods-ready-seconds 20]
     [--hold-seconds 15] [--cap 900] [--configs without,with]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fleet import NEURON, ROOT
from neuron_scheduler.kube.client import KUEUE
from neuron_scheduler.kube.kueue import CONTROLLER_NAME
from tests.builders import neuron_capacity, node_json
from tests.e2e.harness import Scenario, ids, wait_for
from tests.testbed import ControlPlane, KubeError, Stack, find_kubebin
from tests.testbed.controlplane import ControllerManager
from tests.testbed.kueue import Kueue, find_kueue_bin
from tests.testbed.kueuequeues import cluster_queue, local_queue, resource_flavor

CHECK = "neuron-placement"
TYPES = ("inf2.48xlarge", "trn1.32xlarge")
# Devices of a workload's pod, by the instance type its nodeSelector names (a seeded draw): the
# counts each type's devices are handed out in (trn1.32xlarge takes 1, 4, 8 or 16).
SIZES = {"inf2.48xlarge": (1, 2, 2, 3, 4), "trn1.32xlarge": (1, 4, 4, 8)}
# The free run left on the i-th node of a type (every size fits on some node once it is free).
RUNS = {"inf2.48xlarge": (4, 5, 3), "trn1.32xlarge": (8, 4)}
POLL = 0.5
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}


def true(obj: dict[str, Any], kind: str) -> bool:
    return conditions(obj).get(kind, {}).get("status") == "True"


@dataclass
class Tracked:
    """One workload as the polls saw it."""

    devices: int
    admitted_at: float | None = None  # the admission in course, since when
    ran: bool = False  # its pod ran during the admission in course
    failed_admissions: int = 0  # admissions that ended (or the run ended) before its pod ran
    quota_seconds: float = 0.0  # held by those admissions
    evictions: set[str] = field(default_factory=set)  # PodsReadyTimeout, by transition time
    finished_at: float | None = None
    deactivated: bool = False


@dataclass
class Result:
    name: str
    workloads: int
    could_not_run: int
    failed_admissions: int
    quota_seconds: float
    evictions: int
    deactivated: int
    finished: int
    last_finished: float
    all_finished: float | None


class Fleet:
    """One configuration's namespace, fragmented nodes, flavors, ClusterQueue and Jobs."""

    def __init__(self, stack: Stack, checked: bool, inf2: int, trn1: int) -> None:
        self.stack = stack
        self.cp = stack.cp
        self.scenario = Scenario(stack)
        self.id = self.scenario.id
        self.namespace = self.scenario.namespace
        self.checked = checked
        self.free: dict[str, int] = dict.fromkeys(TYPES, 0)  # devices free by count, per type
        self.cluster_queue = f"cq-{self.id}"
        self.flavors = {kind: f"{kind.split('.')[0]}-{self.id}" for kind in TYPES}
        self.run_for: dict[str, float] = {}  # job name -> seconds its pod runs
        self.running_since: dict[str, float] = {}  # pod uid -> when this script started it
        for kind, count in (("inf2.48xlarge", inf2), ("trn1.32xlarge", trn1)):
            for i in range(count):
                self.fragment(self.node(kind), kind, RUNS[kind][i % len(RUNS[kind])])

    def node(self, kind: str) -> str:
        name = f"{kind.replace('.', '-')}-{self.id}-{len(self.scenario.nodes)}"
        self.cp.request(
            "POST", "/api/v1/nodes", node_json(name, kind, labels={"neuron-test": self.id})
        )
        self.scenario.nodes.append(name)
        return name

    def fragment(self, node: str, kind: str, run: int) -> None:
        """Fills the node with 1-device pods outside Kueue (bound by the extender's bind), then
        frees devices 0 to `run` - 1 and every other device after them."""
        devices = neuron_capacity(kind)[0]
        by_device: dict[int, str] = {}
        for i in range(devices):
            name = f"fill-{node}-{i}"[:63]
            created = self.scenario.create_pod(name, {NEURON: 1}, scheduler="nobody")
            error = self.stack.extender.bind(created, node)
            assert not error, error
            by_device[ids(self.scenario.pod(name))[0]] = name
        free = [*range(run), *range(run + 1, devices - 1, 2)]
        for device in free:
            self.scenario.delete_pod(by_device[device])
        self.free[kind] += len(free)

    def queues(self) -> None:
        for kind, flavor in self.flavors.items():
            labels = {"neuron-test": self.id, "node.kubernetes.io/instance-type": kind}
            self.cp.request("POST", f"{KUEUE}/resourceflavors", resource_flavor(flavor, labels))
        quotas = {flavor: self.free[kind] for kind, flavor in self.flavors.items()}
        queue = cluster_queue(self.cluster_queue, quotas, check=CHECK if self.checked else "")
        self.cp.request("POST", f"{KUEUE}/clusterqueues", queue)
        self.cp.request(
            "POST",
            f"{KUEUE}/namespaces/{self.namespace}/localqueues",
            local_queue("team", self.cluster_queue),
        )
        path = f"{KUEUE}/namespaces/{self.namespace}/localqueues/team"
        wait_for(lambda: true(self.cp.request("GET", path), "Active"), "the LocalQueue", 120)

    def job(self, name: str, kind: str, devices: int, seconds: float) -> None:
        """A Job of one pod of `devices` on `kind` (its nodeSelector: Kueue assigns the flavor
        whose node labels match it)."""
        spec = self.scenario.pod_body("x", {NEURON: devices})["spec"]
        spec["nodeSelector"]["node.kubernetes.io/instance-type"] = kind
        self.run_for[name] = seconds
        self.cp.request(
            "POST",
            f"/apis/batch/v1/namespaces/{self.namespace}/jobs",
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": name, "labels": {QUEUE_LABEL: "team"}},
                "spec": {
                    "parallelism": 1,
                    "completions": 1,
                    "backoffLimit": 0,
                    "template": {"spec": {**spec, "restartPolicy": "Never"}},
                },
            },
        )

    # --- this script as the nodes' kubelet ----------------------------------------------------

    def kubelet(self, pods: list[dict[str, Any]], now: float) -> None:
        path = f"/api/v1/namespaces/{self.namespace}/pods"
        for pod in pods:
            meta, status = pod["metadata"], pod.get("status", {})
            name, uid = meta["name"], meta["uid"]
            with contextlib.suppress(KubeError):  # changed or gone meanwhile
                if meta.get("deletionTimestamp"):
                    options = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
                    self.cp.request("DELETE", f"{path}/{name}", options)
                elif not pod["spec"].get("nodeName") or status.get("phase") in (
                    "Succeeded",
                    "Failed",
                ):
                    continue
                elif status.get("phase") != "Running":
                    self.running_since[uid] = now
                    self._status(path, name, "Running", "True")
                elif uid in self.running_since:
                    job = meta.get("labels", {}).get("job-name", "")
                    if job and now - self.running_since[uid] >= self.run_for.get(job, 0):
                        self._status(path, name, "Succeeded", "False")

    def _status(self, path: str, name: str, phase: str, ready: str) -> None:
        body = {
            "status": {
                "phase": phase,
                **({"startTime": stamp()} if phase == "Running" else {}),
                "conditions": [
                    {"type": "Ready", "status": ready, "lastTransitionTime": stamp()},
                ],
            }
        }
        self.cp.request(
            "PATCH", f"{path}/{name}/status", body, "application/strategic-merge-patch+json"
        )

    def stop(self) -> None:
        with contextlib.suppress(KubeError):
            self.cp.request(
                "DELETE",
                f"/apis/batch/v1/namespaces/{self.namespace}/jobs?propagationPolicy=Background",
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (pods := self.scenario.pods()):
            self.kubelet(pods, time.monotonic())
            for pod in pods:
                if not pod["metadata"].get("deletionTimestamp"):
                    self.scenario.delete_pod(pod["metadata"]["name"])
            time.sleep(POLL)
        self.scenario.cleanup()
        for path in (
            f"{KUEUE}/namespaces/{self.namespace}/localqueues/team",
            f"{KUEUE}/clusterqueues/{self.cluster_queue}",
            *(f"{KUEUE}/resourceflavors/{flavor}" for flavor in self.flavors.values()),
        ):
            with contextlib.suppress(KubeError):
                self.cp.request("DELETE", path)


def run(fleet: Fleet, workloads: list[tuple[str, int, float]], cap: float, name: str) -> Result:
    fleet.queues()
    began = time.monotonic()
    for index, (kind, devices, seconds) in enumerate(workloads):
        fleet.job(f"w{index}", kind, devices, seconds)
    tracked: dict[str, Tracked] = {}
    sizes = {f"w{i}": devices for i, (_, devices, _) in enumerate(workloads)}
    while time.monotonic() - began < cap:
        now = time.monotonic()
        pods = fleet.scenario.pods()
        fleet.kubelet(pods, now)
        listed = fleet.cp.request("GET", f"{KUEUE}/namespaces/{fleet.namespace}/workloads")
        for workload in listed["items"]:
            owner = next(iter(workload["metadata"].get("ownerReferences", [])), {})
            job = owner.get("name", "")
            if job not in sizes:
                continue
            seen = tracked.setdefault(workload["metadata"]["uid"], Tracked(sizes[job]))
            observe(seen, workload, now)
        done = [t for t in tracked.values() if t.finished_at is not None or t.deactivated]
        if len(tracked) == len(workloads) and len(done) == len(workloads):
            break
        time.sleep(POLL)
    end = time.monotonic()
    for seen in tracked.values():  # an admission still waiting at the end counts too
        if seen.admitted_at is not None and not seen.ran:
            seen.failed_admissions += 1
            seen.quota_seconds += seen.devices * (end - seen.admitted_at)
    finished = [t.finished_at - began for t in tracked.values() if t.finished_at is not None]
    every = len(finished) == len(workloads)
    return Result(
        name,
        len(workloads),
        sum(1 for t in tracked.values() if t.failed_admissions),
        sum(t.failed_admissions for t in tracked.values()),
        sum(t.quota_seconds for t in tracked.values()),
        sum(len(t.evictions) for t in tracked.values()),
        sum(1 for t in tracked.values() if t.deactivated),
        len(finished),
        max(finished, default=0.0),
        max(finished) if every else None,
    )


def observe(seen: Tracked, workload: dict[str, Any], now: float) -> None:
    found = conditions(workload)
    evicted = found.get("Evicted", {})
    if evicted.get("status") == "True" and evicted.get("reason") == "PodsReadyTimeout":
        seen.evictions.add(evicted.get("lastTransitionTime", ""))
    if workload["spec"].get("active") is False:
        seen.deactivated = True
    admitted = found.get("Admitted", {}).get("status") == "True"
    if found.get("Finished", {}).get("status") == "True":
        if seen.finished_at is None:
            seen.finished_at = now
        admitted = False
    if admitted and seen.admitted_at is None:
        seen.admitted_at, seen.ran = now, False
    if admitted and found.get("PodsReady", {}).get("status") == "True":
        seen.ran = True
    if not admitted and seen.admitted_at is not None:
        if not seen.ran and seen.finished_at is None:
            seen.failed_admissions += 1
            seen.quota_seconds += seen.devices * (now - seen.admitted_at)
        seen.admitted_at = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", type=int, default=36)
    parser.add_argument("--inf2", type=int, default=4, help="inf2.48xlarge nodes")
    parser.add_argument("--trn1", type=int, default=3, help="trn1.32xlarge nodes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--run-seconds", type=float, nargs=2, default=(30.0, 90.0))
    parser.add_argument("--pods-ready-seconds", type=int, default=20)
    parser.add_argument("--hold-seconds", type=int, default=15)
    parser.add_argument("--cap", type=float, default=900.0, help="seconds a configuration runs")
    parser.add_argument("--configs", default="without,with")
    args = parser.parse_args()
    configs = args.configs.split(",")
    if set(configs) - {"without", "with"} or not configs:
        parser.error("--configs: without, with")
    if min(args.workloads, args.inf2 + args.trn1, args.cap) < 1 or args.hold_seconds < 5:
        parser.error("--workloads, --cap and nodes must be positive, --hold-seconds at least 5")
    draw = random.Random(args.seed)
    low, high = args.run_seconds
    kinds = [k for k, n in (("inf2.48xlarge", args.inf2), ("trn1.32xlarge", args.trn1)) if n]
    workloads = []
    for _ in range(args.workloads):
        kind = draw.choice(kinds)
        workloads.append((kind, draw.choice(SIZES[kind]), round(draw.uniform(low, high), 1)))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs; Kubernetes v1.36.3, Kueue "
        f"v0.17.0 (waitForPodsReady {args.pods_ready_seconds}s, 2 requeues); extender "
        f"--kueue-hold-seconds={args.hold_seconds}; {args.inf2} inf2.48xlarge + {args.trn1} "
        f"trn1.32xlarge, seed {args.seed}; {args.workloads} workloads of "
        f"{sum(d for _, d, _ in workloads)} devices in all"
    )
    results: list[Result] = []
    with ControlPlane(find_kubebin(ROOT)) as cp:
        manager: ControllerManager = cp.start_controller_manager(
            ("job-controller", "garbage-collector-controller")
        )
        kueue = Kueue(
            cp,
            find_kueue_bin(ROOT),
            frameworks=("batch/job",),
            pods_ready_seconds=args.pods_ready_seconds,
        )
        kueue.start()
        stack = Stack(
            cp,
            extender_args=("--kueue-admission-check", f"--kueue-hold-seconds={args.hold_seconds}"),
        )
        try:
            stack.use_scheduler(node_cache_capable=True)
            cp.request(
                "POST",
                f"{KUEUE}/admissionchecks",
                {
                    "apiVersion": "kueue.x-k8s.io/v1beta2",
                    "kind": "AdmissionCheck",
                    "metadata": {"name": CHECK},
                    "spec": {"controllerName": CONTROLLER_NAME},
                },
            )
            for name in configs:
                fleet = Fleet(stack, name == "with", args.inf2, args.trn1)
                try:
                    results.append(run(fleet, workloads, args.cap, name))
                finally:
                    fleet.stop()
        finally:
            kueue.stop()
            manager.stop()
            if stack.scheduler is not None:
                stack.scheduler.stop()
            stack.stop()
    print(
        "| check | workloads | admitted, could not run (admissions) | their quota-seconds | "
        "pods-ready evictions | deactivated | finished | time until all finished |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        until = (
            f"{r.all_finished:.0f} s"
            if r.all_finished is not None
            else f"never ({r.finished} finished, the last at {r.last_finished:.0f} s)"
        )
        print(
            f"| {r.name} | {r.workloads} | {r.could_not_run} ({r.failed_admissions}) | "
            f"{r.quota_seconds:.0f} | {r.evictions} | {r.deactivated} | {r.finished} | {until} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
