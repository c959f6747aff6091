"""Issue 48: Kueue v0.17.0 in front of neuron-scheduler. Quota comes from Kueue, placement from us.

A control plane of its own (Kueue's webhooks see every pod write of the namespaces they match,
and its finalizers stay on its pods: no other module shares them), with `my-scheduler` and the
extender as the chart wires them, kube-controller-manager's job controller and garbage collector,
and real Kueue with its webhooks (tests/testbed/kueue.py, built by tools/kueue.mk) running
`batch/job`, `pod` and `jobset.x-k8s.io/jobset`, with JobSet's own controller. Each test has its
namespace, its nodes (labelled with its id), a ResourceFlavor with that label as its nodeLabels, a
ClusterQueue with `aws.amazon.com/neuron` quota in that flavor, a LocalQueue, and a kubelet
stand-in that starts bound pods (Ready, as waitForPodsReady wants them) and finishes deleted
ones.

What goes through Kueue here reaches our scheduler as any pod does once Kueue lets it go: a
batch/v1 Job (suspended until admitted), plain pods and a pod group (gated until admitted), a
JobSet. The extender gives each pod contiguous devices, and leaves a gated pod alone: no
UltraServer claim for a gated pod group, so a job outside Kueue takes the free unit at once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from neuron_scheduler.core.resources import NEURON
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import (
    KUEUE_ADMISSION_GATE,
    KUEUE_POD_GROUP_LABEL,
    KUEUE_QUEUE_LABEL,
    KUEUE_TOPOLOGY_GATE,
    KUEUE_WORKLOAD_ANNOTATION,
    kueue_workload,
)
from tests.builders import node_json
from tests.e2e.harness import (
    ROOT,
    Scenario,
    bound,
    command_json,
    dump,
    ids,
    own_stacks,
    wait_for,
)
from tests.testbed import ControlPlane, KubeError, Stack
from tests.testbed.controlplane import ControllerManager
from tests.testbed.kueue import JobSetController, Kueue, find_kueue_bin

pytestmark = pytest.mark.e2e

KUEUE = "/apis/kueue.x-k8s.io/v1beta2"
JOBSET = "/apis/jobset.x-k8s.io/v1alpha2"
CLAIMS = "/apis/neuron-scheduler.io/v1alpha1/ultraserverclaims"
PREFIX = "neuron.amazonaws.com/ultraserver-"
RING = "inf2.48xlarge"  # a ring of 12 devices
HOLES = [0, 2, 4, 6, 8, 10]  # free devices of a fragmented ring: no two in a row
PATIENCE = 120.0  # a bound on waits (the machine is shared), never a speed target
SETTLE = 8.0  # seconds something is watched not to happen (a check, never a speed bound)
TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"


class Module:
    """The module's cluster: control plane, extender, my-scheduler, the job controller, Kueue
    and JobSet's controller."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.stack = Stack(cp)
        self.stack.use_scheduler(node_cache_capable=True)
        self.manager: ControllerManager = cp.start_controller_manager(
            ("job-controller", "garbage-collector-controller")
        )
        bin_dir = find_kueue_bin(ROOT)
        self.jobset = JobSetController(cp, bin_dir)
        self.kueue = Kueue(cp, bin_dir, frameworks=("batch/job", "pod", "jobset.x-k8s.io/jobset"))

    def start(self) -> None:
        self.jobset.start()
        self.kueue.start()
        print(
            f"\nJobSet ready after {self.jobset.started_seconds:.1f}s "
            f"({self.jobset.serving_seconds:.1f}s from its start), Kueue after "
            f"{self.kueue.started_seconds:.1f}s ({self.kueue.serving_seconds:.1f}s from its "
            f"start; webhooks at {self.kueue.host}:{self.kueue.webhook_port})"
        )
        self.stack.extra_logs.update({**self.kueue.logs(), **self.jobset.logs()})

    def stop(self) -> None:
        self.kueue.stop()
        self.jobset.stop()
        self.manager.stop()
        if self.stack.scheduler is not None:
            self.stack.scheduler.stop()
        self.stack.stop()


class World:
    """One test's namespace, nodes, ResourceFlavor, ClusterQueue and LocalQueue."""

    def __init__(self, module: Module, quota: int) -> None:
        self.module = module
        self.cp = module.cp
        self.scenario = Scenario(module.stack)
        self.id = self.scenario.id
        self.namespace = self.scenario.namespace
        self.flavor = f"neuron-{self.id}"
        self.cluster_queue = f"cq-{self.id}"
        self.queue = "team"
        self.scenario.kubelet_stand_in()
        self.cp.request(
            "POST",
            f"{KUEUE}/resourceflavors",
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "ResourceFlavor",
                "metadata": {"name": self.flavor},
                "spec": {"nodeLabels": {"neuron-test": self.id}},
            },
        )
        self.cp.request(
            "POST",
            f"{KUEUE}/clusterqueues",
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "ClusterQueue",
                "metadata": {"name": self.cluster_queue},
                "spec": {
                    "namespaceSelector": {},
                    "resourceGroups": [
                        {
                            "coveredResources": [NEURON],
                            "flavors": [
                                {
                                    "name": self.flavor,
                                    "resources": [{"name": NEURON, "nominalQuota": str(quota)}],
                                }
                            ],
                        }
                    ],
                },
            },
        )
        self.cp.request(
            "POST",
            f"{KUEUE}/namespaces/{self.namespace}/localqueues",
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "LocalQueue",
                "metadata": {"name": self.queue},
                "spec": {"clusterQueue": self.cluster_queue},
            },
        )
        wait_for(self._queue_active, "the LocalQueue active", PATIENCE)

    def _queue_active(self) -> bool:
        found = self.cp.request(
            "GET", f"{KUEUE}/namespaces/{self.namespace}/localqueues/{self.queue}"
        )
        conditions = found.get("status", {}).get("conditions", [])
        return any(c["type"] == "Active" and c["status"] == "True" for c in conditions)

    def set_quota(self, quota: int) -> None:
        path = f"{KUEUE}/clusterqueues/{self.cluster_queue}"
        found = self.cp.request("GET", path)
        flavor = found["spec"]["resourceGroups"][0]["flavors"][0]
        flavor["resources"][0]["nominalQuota"] = str(quota)
        self.cp.request("PUT", path, found)

    # --- nodes and pods ----------------------------------------------------------------------

    def add_node(self, instance_type: str, labels: dict[str, str] | None = None) -> str:
        name = f"{instance_type.replace('.', '-')}-{self.id}-{len(self.scenario.nodes)}"
        body = node_json(name, instance_type, labels={"neuron-test": self.id, **(labels or {})})
        self.cp.request("POST", "/api/v1/nodes", body)
        self.scenario.nodes.append(name)
        return name

    def fragmented_ring(self) -> str:
        """An inf2.48xlarge whose devices hold bare pods (outside Kueue) but HOLES."""
        node = self.add_node(RING)
        for i in range(12):
            self.scenario.create_pod(f"fill-{i}", {NEURON: 1})
        placed = wait_for(
            lambda: b if len(b := bound(self.scenario, "fill-")) == 12 else None,
            "the fill pods bound",
            PATIENCE,
        )
        for device in HOLES:
            self.scenario.delete_pod(placed[device])
        wait_for(
            lambda: sorted(set(range(12)) - set(bound(self.scenario, "fill-"))) == HOLES,
            "the holes free",
        )
        return node

    def unit(self, server: str) -> list[str]:
        """Four trn2u nodes of one UltraServer (server id `server` x 16)."""
        return [
            self.add_node(
                "trn2u.48xlarge",
                {
                    PREFIX + "mode": "1_2_4",
                    PREFIX + "server-id-4": server * 16,
                    PREFIX + "node-id-4": str(i),
                },
            )
            for i in range(4)
        ]

    def pod(
        self,
        name: str,
        devices: int,
        labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        body = self.scenario.pod_body(name, {NEURON: devices}, annotations=annotations)
        body["metadata"]["labels"] = dict(labels or {})
        created: dict[str, Any] = self.cp.request(
            "POST", f"/api/v1/namespaces/{self.namespace}/pods", body
        )
        return created

    def queued(self) -> dict[str, str]:
        return {KUEUE_QUEUE_LABEL: self.queue}

    def gang(self, job: str, members: int, queue: bool = True) -> list[str]:
        """A training job of whole trn2u nodes (16 devices a member) by our gang annotations;
        through Kueue (a pod group of `members`, in this test's LocalQueue) when `queue`."""
        names = []
        for i in range(members):
            labels = {**self.queued(), KUEUE_POD_GROUP_LABEL: job} if queue else {}
            annotations = {
                "neuron-scheduler.io/gang": job,
                "neuron-scheduler.io/gang-size": str(members),
                **({TOTAL_COUNT: str(members)} if queue else {}),
            }
            self.pod(f"{job}-{i}", 16, labels, annotations)
            names.append(f"{job}-{i}")
        return names

    def job(self, name: str, pods: int, devices: int) -> None:
        """A batch/v1 Job in this test's LocalQueue: `pods` pods of `devices` devices at once."""
        template = self.scenario.pod_body("x", {NEURON: devices})
        spec = template["spec"]
        self.cp.request(
            "POST",
            f"/apis/batch/v1/namespaces/{self.namespace}/jobs",
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": name, "labels": self.queued()},
                "spec": {
                    "parallelism": pods,
                    "completions": pods,
                    "template": {"spec": {**spec, "restartPolicy": "Never"}},
                },
            },
        )

    def pods_of(self, prefix: str) -> list[dict[str, Any]]:
        return [p for p in self.scenario.pods() if p["metadata"]["name"].startswith(prefix)]

    def all_bound(self, prefix: str, count: int) -> list[dict[str, Any]]:
        def found() -> list[dict[str, Any]] | None:
            pods = [p for p in self.pods_of(prefix) if p["spec"].get("nodeName")]
            return pods if len(pods) == count else None

        try:
            return wait_for(found, f"{count} pods {prefix}* bound", PATIENCE)
        except AssertionError:
            pending = [p["metadata"]["name"] for p in self.pods_of(prefix)]
            raise AssertionError(f"not all bound; {pending}: {dump(self.workloads())}") from None

    def workloads(self) -> list[dict[str, Any]]:
        listed = self.cp.request("GET", f"{KUEUE}/namespaces/{self.namespace}/workloads")
        return list(listed["items"])

    def claims(self) -> dict[str, str]:
        """node -> the job its claim holds it for (namespace/name), for this test's namespace:
        another test's leftovers (a JobSet's Job recreating pods while it is deleted) are not
        this test's to see."""
        listed = self.cp.request("GET", CLAIMS)
        return {
            i["metadata"]["name"]: f"{i['spec']['namespace']}/{i['spec']['job']}"
            for i in listed["items"]
            if i["spec"]["namespace"] == self.namespace
        }

    def why(self, pod: str) -> dict[str, Any]:
        """`neuron-scheduler why POD --json`, as a person would run it."""
        return command_json(self.cp, "why", pod, "-n", self.namespace)

    def status(self) -> dict[str, Any]:
        return command_json(self.cp, "status")

    def stop(self) -> None:
        # JobSets first: a JobSet whose Job is deleted makes the Job again.
        for owners in (
            f"{JOBSET}/namespaces/{self.namespace}/jobsets",
            f"/apis/batch/v1/namespaces/{self.namespace}/jobs",
        ):
            with contextlib.suppress(KubeError):
                self.cp.request("DELETE", f"{owners}?propagationPolicy=Background")
        self.scenario.cleanup()
        for path in (
            f"{KUEUE}/namespaces/{self.namespace}/localqueues/{self.queue}",
            f"{KUEUE}/clusterqueues/{self.cluster_queue}",
            f"{KUEUE}/resourceflavors/{self.flavor}",
        ):
            with contextlib.suppress(KubeError):
                self.cp.request("DELETE", path)


def contiguous(pod: dict[str, Any], count: int, ring: int = 12) -> bool:
    """The pod's ids are `count` devices in a row on a ring of `ring` devices (11,0,1 too)."""
    found = sorted(ids(pod))
    return len(found) == count and any(
        sorted((start + i) % ring for i in range(count)) == found for start in found
    )


@pytest.fixture(scope="module")
def module(kubebin: Path) -> Iterator[Module]:
    with ControlPlane(kubebin) as cp:
        running = Module(cp)
        own_stacks.append(running.stack)
        try:
            running.start()
            yield running
        finally:
            own_stacks.remove(running.stack)
            running.stop()


@pytest.fixture
def world(module: Module, request: pytest.FixtureRequest) -> Iterator[World]:
    quota = getattr(request, "param", 64)
    made = World(module, quota)
    try:
        yield made
    finally:
        made.stop()


# --- what goes through Kueue reaches our scheduler --------------------------------------------


@pytest.mark.parametrize("world", [6], indirect=True)
def test_a_job_is_suspended_over_quota_and_its_pods_get_contiguous_devices(world: World) -> None:
    """A quota of 6 devices. A Job of two 3-device pods is admitted: its pods get 3 devices in a
    row each, on the ring that has them (the other ring's 6 free devices are every other one,
    which Kueue's count takes for room). A second Job stays suspended, with no pod, until the
    first is gone; then it is admitted and placed the same way."""
    fragmented = world.fragmented_ring()
    clean = world.add_node(RING)
    world.job("first", 2, 3)
    placed = world.all_bound("first-", 2)
    assert {p["spec"]["nodeName"] for p in placed} == {clean}, dump(placed)
    assert all(contiguous(p, 3) for p in placed), [ids(p) for p in placed]
    # Kueue put the flavor's node labels into the pod template.
    assert placed[0]["spec"]["nodeSelector"]["neuron-test"] == world.id
    world.job("second", 1, 3)
    wait_for(
        lambda: any(
            "insufficient unused quota" in c.get("message", "")
            for w in world.workloads()
            if w["metadata"]["name"].startswith("job-second-")
            for c in w.get("status", {}).get("conditions", [])
        ),
        "the second Job's workload to wait for quota",
        PATIENCE,
    )
    second = world.cp.request("GET", f"/apis/batch/v1/namespaces/{world.namespace}/jobs/second")
    assert second["spec"]["suspend"] is True
    assert world.pods_of("second-") == []
    world.cp.request(
        "DELETE",
        f"/apis/batch/v1/namespaces/{world.namespace}/jobs/first?propagationPolicy=Background",
    )
    (placed,) = world.all_bound("second-", 1)
    assert placed["spec"]["nodeName"] != fragmented and contiguous(placed, 3), ids(placed)


def test_plain_pods_are_gated_until_admitted_then_get_contiguous_devices(world: World) -> None:
    """Pod integration: Kueue's webhook gates each pod (admission, and topology: the feature is
    on by default), makes it a Workload, and lifts the gates at admission; then my-scheduler and
    the extender place it. `why` names the Workload as Kueue named it."""
    world.fragmented_ring()
    clean = world.add_node(RING)
    created = world.pod("solo", 4, world.queued())
    gates = [g["name"] for g in created["spec"].get("schedulingGates", [])]
    assert gates == [KUEUE_ADMISSION_GATE, KUEUE_TOPOLOGY_GATE], gates
    (placed,) = world.all_bound("solo", 1)
    assert placed["spec"]["nodeName"] == clean and contiguous(placed, 4), ids(placed)
    assert not placed["spec"].get("schedulingGates")
    (workload,) = world.workloads()
    # What `why` derives for a gated single pod is the name Kueue gave its Workload, which Kueue
    # writes on the pod at admission.
    name = workload["metadata"]["name"]
    assert kueue_workload(msgspec.convert(created, Pod)) == name
    assert placed["metadata"]["annotations"][KUEUE_WORKLOAD_ANNOTATION] == name


def test_a_jobset_through_kueue_gets_contiguous_devices(world: World) -> None:
    """JobSet v0.11.1's controller (its webhooks served here too): a JobSet in the LocalQueue is
    suspended until Kueue admits it, then its Job's pods are placed like any others."""
    world.fragmented_ring()
    clean = world.add_node(RING)
    template = world.scenario.pod_body("x", {NEURON: 3})
    world.cp.request(
        "POST",
        f"{JOBSET}/namespaces/{world.namespace}/jobsets",
        {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": "js", "labels": world.queued()},
            "spec": {
                "replicatedJobs": [
                    {
                        "name": "workers",
                        "replicas": 1,
                        "template": {
                            "spec": {
                                "parallelism": 2,
                                "completions": 2,
                                "template": {
                                    "spec": {**template["spec"], "restartPolicy": "Never"}
                                },
                            }
                        },
                    }
                ]
            },
        },
    )
    placed = world.all_bound("js-", 2)
    assert {p["spec"]["nodeName"] for p in placed} == {clean}, dump(placed)
    assert all(contiguous(p, 3) for p in placed), [ids(p) for p in placed]
    (workload,) = world.workloads()
    assert workload["metadata"]["name"].startswith("jobset-js-")


# --- gated pods are Kueue's, not ours ------------------------------------------------------------


@pytest.mark.parametrize("world", [0], indirect=True)
def test_a_gated_pod_group_gets_no_claim_and_a_job_outside_kueue_takes_the_free_unit(
    world: World,
) -> None:
    """One free UltraServer (4 trn2u nodes). A pod group of 4 whole-node members goes to Kueue,
    which has no quota for it: its pods stay gated. The extender claimed a whole unit for such a
    group within seconds, and a job outside Kueue then waited until the unused claim expired
    (111.8 s, issue 48). Now the gated group holds nothing, and the job outside Kueue takes the
    unit at once. `why` on a gated member names the gates, the Workload and its queue. Given
    quota, Kueue admits the group (quota is not capacity); it binds whole once the unit frees."""
    unit = world.unit("a")
    queued = world.gang("queued", 4)
    wait_for(
        lambda: [w["metadata"]["name"] for w in world.workloads()] == ["queued"],
        "Kueue's Workload for the pod group",
        PATIENCE,
    )
    deadline = time.monotonic() + SETTLE
    while time.monotonic() < deadline:
        assert f"{world.namespace}/queued" not in world.claims().values(), world.claims()
        time.sleep(0.25)
    assert all(p["spec"].get("schedulingGates") for p in world.pods_of("queued-"))
    created = time.monotonic()
    outside = world.gang("outside", 4, queue=False)
    placed = world.all_bound("outside-", 4)
    print(f"\nthe job outside Kueue bound whole {time.monotonic() - created:.1f}s after creation")
    assert sorted(p["spec"]["nodeName"] for p in placed) == sorted(unit)
    assert set(world.claims().values()) == {f"{world.namespace}/outside"}
    status = world.status()
    assert [w["job"] for w in status["ultraservers"]["waiting"]] == []
    assert [
        (g["kueue_workload"], g["kueue_queue"], g["pods"], g["requests"])
        for g in status["gated"]["groups"]
    ] == [("queued", world.queue, 4, [{"resource": NEURON, "count": 64}])]
    answer = world.why("queued-0")
    assert answer["scheduling_gates"] == {
        "gates": [KUEUE_ADMISSION_GATE, KUEUE_TOPOLOGY_GATE],
        "more_gates": 0,
        "kueue_workload": "queued",
        "kueue_queue": world.queue,
    }, answer
    assert "nothing is reserved for it while its members are gated" in answer["job"]
    world.set_quota(64)
    wait_for(
        lambda: not any(p["spec"].get("schedulingGates") for p in world.pods_of("queued-")),
        "Kueue to admit the pod group (its gates lifted)",
        PATIENCE,
    )
    for name in outside:
        world.scenario.delete_pod(name)
    freed = time.monotonic()
    placed = world.all_bound("queued-", 4)
    print(f"the admitted pod group bound {time.monotonic() - freed:.1f}s after the unit freed")
    assert sorted(p["spec"]["nodeName"] for p in placed) == sorted(unit)
    assert all(ids(p) == list(range(16)) for p in placed), [ids(p) for p in placed]
    assert set(world.claims().values()) == {f"{world.namespace}/queued"}
    assert queued == sorted(p["metadata"]["name"] for p in placed)
