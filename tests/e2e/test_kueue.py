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
from neuron_scheduler.kube.client import KUEUE
from neuron_scheduler.kube.kueue import CONTROLLER_NAME, WORKLOAD_UID_ANNOTATION
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
from tests.testbed.kueuequeues import cluster_queue, local_queue, resource_flavor

pytestmark = pytest.mark.e2e

JOBSET = "/apis/jobset.x-k8s.io/v1alpha2"
CLAIMS = "/apis/neuron-scheduler.io/v1alpha1/ultraserverclaims"
PREFIX = "neuron.amazonaws.com/ultraserver-"
RING = "inf2.48xlarge"  # a ring of 12 devices
HOLES = [0, 2, 4, 6, 8, 10]  # free devices of a fragmented ring: no two in a row
PATIENCE = 120.0  # a bound on waits (the machine is shared), never a speed target
SETTLE = 8.0  # seconds something is watched not to happen (a check, never a speed bound)
TOTAL_COUNT = "kueue.x-k8s.io/pod-group-total-count"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
CHECK = "neuron-placement"  # the module's AdmissionCheck, of our controllerName
HOLD_SECONDS = 60  # the extender's --kueue-hold-seconds here
HOSTNAME = "kubernetes.io/hostname"


class Module:
    """The module's cluster: control plane, the job controller, Kueue and JobSet's controller,
    then the extender (with the placement admission check on, its AdmissionCheck CHECK made) and
    my-scheduler: Kueue's CRDs are there when the extender starts."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.manager: ControllerManager = cp.start_controller_manager(
            ("job-controller", "garbage-collector-controller")
        )
        bin_dir = find_kueue_bin(ROOT)
        self.jobset = JobSetController(cp, bin_dir)
        self.kueue = Kueue(cp, bin_dir, frameworks=("batch/job", "pod", "jobset.x-k8s.io/jobset"))
        self.stack: Stack | None = None

    def start(self) -> Stack:
        self.jobset.start()
        self.kueue.start()
        print(
            f"\nJobSet ready after {self.jobset.started_seconds:.1f}s "
            f"({self.jobset.serving_seconds:.1f}s from its start), Kueue after "
            f"{self.kueue.started_seconds:.1f}s ({self.kueue.serving_seconds:.1f}s from its "
            f"start; webhooks at {self.kueue.host}:{self.kueue.webhook_port})"
        )
        self.stack = Stack(
            self.cp,
            extender_args=("--kueue-admission-check", f"--kueue-hold-seconds={HOLD_SECONDS}"),
        )
        self.stack.use_scheduler(node_cache_capable=True)
        self.stack.extra_logs.update({**self.kueue.logs(), **self.jobset.logs()})
        self.cp.request(
            "POST",
            f"{KUEUE}/admissionchecks",
            {
                "apiVersion": "kueue.x-k8s.io/v1beta2",
                "kind": "AdmissionCheck",
                "metadata": {"name": CHECK},
                "spec": {"controllerName": CONTROLLER_NAME},
            },
        )
        return self.stack

    def stop(self) -> None:
        self.kueue.stop()
        self.jobset.stop()
        self.manager.stop()
        if self.stack is not None:
            if self.stack.scheduler is not None:
                self.stack.scheduler.stop()
            self.stack.stop()


class World:
    """One test's namespace, nodes, ResourceFlavor, ClusterQueue and LocalQueue."""

    def __init__(
        self, module: Module, quota: int, checked: bool = False, tas: bool = False
    ) -> None:
        """`checked`: the ClusterQueue lists the placement admission check; `tas`: its flavor
        has a Topology of one level, `kubernetes.io/hostname` (Kueue's TAS picks the node)."""
        assert module.stack is not None
        self.module = module
        self.cp = module.cp
        self.scenario = Scenario(module.stack)
        self.checked = checked
        self.id = self.scenario.id
        self.namespace = self.scenario.namespace
        self.flavor = f"neuron-{self.id}"
        self.cluster_queue = f"cq-{self.id}"
        self.queue = "team"
        self.stand_in = self.scenario.kubelet_stand_in()
        self.topology = f"hosts-{self.id}" if tas else ""
        if tas:
            self.cp.request(
                "POST",
                f"{KUEUE}/topologies",
                {
                    "apiVersion": "kueue.x-k8s.io/v1beta2",
                    "kind": "Topology",
                    "metadata": {"name": self.topology},
                    "spec": {"levels": [{"nodeLabel": HOSTNAME}]},
                },
            )
        labels = {"neuron-test": self.id}
        self.cp.request(
            "POST", f"{KUEUE}/resourceflavors", resource_flavor(self.flavor, labels, self.topology)
        )
        # Kueue's own preemption, within the queue by WorkloadPriorityClass.
        queue = cluster_queue(
            self.cluster_queue,
            {self.flavor: quota},
            check=CHECK if checked else "",
            preemption={"withinClusterQueue": "LowerPriority"},
        )
        self.cp.request("POST", f"{KUEUE}/clusterqueues", queue)
        self.cp.request(
            "POST",
            f"{KUEUE}/namespaces/{self.namespace}/localqueues",
            local_queue(self.queue, self.cluster_queue),
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

    def job(
        self,
        name: str,
        pods: int,
        devices: int,
        annotations: dict[str, str] | None = None,
        priority: str = "",
    ) -> None:
        """A batch/v1 Job in this test's LocalQueue: `pods` pods of `devices` devices at once,
        their template annotated so (a training job: our gang annotations); `priority`: its
        WorkloadPriorityClass."""
        template = self.scenario.pod_body("x", {NEURON: devices})
        spec = template["spec"]
        labels = {**self.queued(), **({PRIORITY_LABEL: priority} if priority else {})}
        self.cp.request(
            "POST",
            f"/apis/batch/v1/namespaces/{self.namespace}/jobs",
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": name, "labels": labels},
                "spec": {
                    "parallelism": pods,
                    "completions": pods,
                    "template": {
                        "metadata": {"annotations": dict(annotations or {})},
                        "spec": {**spec, "restartPolicy": "Never"},
                    },
                },
            },
        )

    def workload(self, prefix: str) -> dict[str, Any] | None:
        found = [w for w in self.workloads() if w["metadata"]["name"].startswith(prefix)]
        return found[0] if found else None

    def check(self, prefix: str) -> dict[str, Any]:
        """The placement check's state on the workload named so ({} while there is none)."""
        workload = self.workload(prefix) or {}
        for state in workload.get("status", {}).get("admissionChecks", []):
            if state["name"] == CHECK:
                return dict(state)
        return {}

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
        """node -> the job its claim holds it for (namespace/name), on this test's nodes and for
        its namespace: another test's leftovers (a JobSet's Job recreating pods while it is
        deleted) are not this test's to see."""
        return {
            n: f"{s['namespace']}/{s['job']}"
            for n, s in claims_of(self).items()
            if s["namespace"] == self.namespace
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
            *([f"{KUEUE}/topologies/{self.topology}"] if self.topology else []),
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
        try:
            own_stacks.append(running.start())
            yield running
        finally:
            if running.stack in own_stacks:
                own_stacks.remove(running.stack)
            running.stop()


@pytest.fixture
def world(module: Module, request: pytest.FixtureRequest) -> Iterator[World]:
    """`request.param`: the quota, or (quota, checked), or (quota, checked, tas)."""
    param = getattr(request, "param", 64)
    quota, checked, tas = (*param, False)[:3] if isinstance(param, tuple) else (param, False, False)
    made = World(module, quota, checked, tas)
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


@pytest.mark.parametrize("world", [64, (64, True)], ids=["quota", "checked"], indirect=True)
def test_a_jobset_through_kueue_gets_contiguous_devices(world: World) -> None:
    """JobSet v0.11.1's controller (its webhooks served here too): a JobSet in the LocalQueue is
    suspended until Kueue admits it, then its Job's pods are placed like any others. With the
    placement check, its pods (a training job by the JobSet's label, which its Workload's
    templates do not carry yet) are placed by the check first, on the ring with room."""
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
    if world.checked:
        ready = world.check("jobset-js-")
        assert ready["state"] == "Ready", ready
        assert f"job {world.namespace}/js: 2 members on " in ready["message"], ready
        assert clean in ready["message"], ready


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
    # What Kueue says of it, as `status` reads its Workload: no quota yet.
    (said,) = [g["kueue_workload_status"] for g in status["gated"]["groups"]]
    assert said["workload"] == f"{world.namespace}/queued" and said["unread"] is None, said
    assert (said["quota_reserved"], said["admitted"]) == (False, False), said
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


# --- the placement admission check (part 3) and one priority story (part 4) ----------------------


def gang_annotations(job: str, members: int) -> dict[str, str]:
    return {"neuron-scheduler.io/gang": job, "neuron-scheduler.io/gang-size": str(members)}


def claims_of(world: World) -> dict[str, dict[str, Any]]:
    """node -> its claim's spec, on this test's nodes (another test's may still be ending)."""
    listed = world.cp.request("GET", CLAIMS)
    nodes = set(world.scenario.nodes)
    return {
        i["metadata"]["name"]: i["spec"] for i in listed["items"] if i["metadata"]["name"] in nodes
    }


def priority_class(world: World, name: str, value: int) -> str:
    """A WorkloadPriorityClass for this test (cluster-scoped: named with the test's id)."""
    full = f"{world.id}-{name}"
    world.cp.request(
        "POST",
        f"{KUEUE}/workloadpriorityclasses",
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2",
            "kind": "WorkloadPriorityClass",
            "metadata": {"name": full},
            "value": value,
        },
    )
    return full


@pytest.mark.parametrize("world", [(64, True)], indirect=True)
def test_with_the_check_a_workload_waits_for_a_block_then_is_admitted_and_placed_on_it(
    world: World,
) -> None:
    """The ClusterQueue lists the placement check. The only node's 6 free devices are every
    other one: Kueue's quota is there, but no 3 devices in a row. The check sends a 3-device
    Job's workload back (Retry) with the allocator's words, so it stays suspended, no pod made.
    Once a fill pod leaves and devices 0-2 are free, Kueue tries again, the check holds the
    block for the workload and makes it Ready; its pod, carrying the workload's uid, binds on
    that block."""
    ring = world.fragmented_ring()
    filled = bound(world.scenario, "fill-")
    world.job("three", 1, 3)
    retried = wait_for(
        lambda: (c := world.check("job-three-")).get("state") == "Retry" and c,
        "the check to send the workload back",
        PATIENCE,
    )
    assert (
        f"3 devices fit by count on 1 node of flavor {world.flavor}, but no node has 3 "
        "contiguous devices free" in retried["message"]
    ), retried
    assert "largest free contiguous run is 1 device" in retried["message"], retried
    workload = world.workload("job-three-")
    assert workload is not None
    admitted = [c for c in workload["status"].get("conditions", []) if c["type"] == "Admitted"]
    assert all(c["status"] == "False" for c in admitted), admitted
    job = world.cp.request("GET", f"/apis/batch/v1/namespaces/{world.namespace}/jobs/three")
    assert job["spec"]["suspend"] is True and world.pods_of("three-") == []
    world.scenario.delete_pod(filled[1])
    freed = time.monotonic()
    (placed,) = world.all_bound("three-", 1)
    print(f"\nthe held block's workload bound {time.monotonic() - freed:.1f}s after it freed")
    assert placed["spec"]["nodeName"] == ring and sorted(ids(placed)) == [0, 1, 2], ids(placed)
    ready = world.check("job-three-")
    assert ready["state"] == "Ready", ready
    assert f"pod set main: 1 pod on {ring} devices 0-2" in ready["message"], ready
    workload = world.workload("job-three-")
    assert workload is not None
    uid = workload["metadata"]["uid"]
    assert placed["metadata"]["annotations"][WORKLOAD_UID_ANNOTATION] == uid


@pytest.mark.parametrize("world", [(64, True)], indirect=True)
def test_with_the_check_an_ultraserver_job_is_admitted_when_a_unit_frees_holds_it_and_binds(
    world: World,
) -> None:
    """One UltraServer, taken by a job outside Kueue. A pod group of 4 whole-node members in the
    checked queue has its quota but no unit: the check says so (Retry), its pods stay gated and
    nothing is claimed for it. Once the outside job is gone, the check claims the unit for the
    workload (claims that name it, lasting without members until they come) and makes it
    Ready; Kueue lifts the gates and the members bind on the unit, all 16 devices each."""
    unit = world.unit("c")
    outside = world.gang("outside", 4, queue=False)
    world.all_bound("outside-", 4)
    world.gang("queued", 4)
    retried = wait_for(
        lambda: (c := world.check("queued")).get("state") == "Retry" and c,
        "the check to send the pod group back",
        PATIENCE,
    )
    assert (
        f"job {world.namespace}/queued needs 1 free UltraServer of 4 nodes for its 4 members, "
        "0 free" in retried["message"]
    ), retried
    assert all(p["spec"].get("schedulingGates") for p in world.pods_of("queued-"))
    assert f"{world.namespace}/queued" not in world.claims().values()
    # `why` on a member reads its Workload: quota reserved, and the check's own words.
    story = world.why("queued-0")["kueue_workload_status"]
    assert story["unread"] is None and story["admitted"] is False, story
    assert story["quota_reserved"] and story["cluster_queue"] == world.cluster_queue, story
    (check,) = [c for c in story["admission_checks"] if c["name"] == CHECK]
    assert check["state"] == "Retry", story
    assert "needs 1 free UltraServer of 4 nodes for its 4 members" in check["message"], story
    # `status` says the same of the gated group, reading its Workload.
    (group,) = world.status()["gated"]["groups"]
    listed = group["kueue_workload_status"]
    (check,) = [c for c in listed["admission_checks"] if c["name"] == CHECK]
    assert check["state"] == "Retry" and listed["quota_reserved"], listed
    for name in outside:
        world.scenario.delete_pod(name)
    ready = wait_for(
        lambda: (c := world.check("queued")).get("state") == "Ready" and c,
        "the check to admit the pod group",
        PATIENCE,
    )
    workload = world.workload("queued")
    assert workload is not None
    uid = workload["metadata"]["uid"]
    held = claims_of(world)
    assert sorted(held) == sorted(unit), held
    for spec in held.values():
        assert (spec["namespace"], spec["job"]) == (world.namespace, "queued"), spec
        # Until its members are bound the claim names the workload; then it is Bound.
        assert spec.get("workload") == uid or spec["phase"] == "Bound", spec
    assert f"job {world.namespace}/queued: 4 members on UltraServer" in ready["message"], ready
    placed = world.all_bound("queued-", 4)
    assert sorted(p["spec"]["nodeName"] for p in placed) == sorted(unit)
    assert all(ids(p) == list(range(16)) for p in placed), [ids(p) for p in placed]
    assert all(p["metadata"]["annotations"][WORKLOAD_UID_ANNOTATION] == uid for p in placed)


@pytest.mark.parametrize("world", [(64, True)], indirect=True)
def test_kueues_preemption_of_a_claimed_job_frees_its_units_to_the_preemptor(world: World) -> None:
    """One UltraServer and quota for one job of 4 whole-node members. A low-priority batch/v1
    Job (our gang annotations in its template) is admitted by the check and runs there. A
    high-priority Job comes: Kueue preempts the low one (its pods are deleted and, the kubelet
    stand-in holding them, stay Terminating as in a real grace period). The low job's claim ends
    at once, and the check holds the unit for the high job (its pods terminating are as good
    as gone); once they are, the high job binds there. The extender evicted nobody itself."""
    unit = world.unit("d")
    low = priority_class(world, "low", 10)
    high = priority_class(world, "high", 1000)
    world.job("low", 4, 16, gang_annotations("low", 4), priority=low)
    placed = world.all_bound("low-", 4)
    assert sorted(p["spec"]["nodeName"] for p in placed) == sorted(unit)
    wait_for(
        lambda: (
            all(s["phase"] == "Bound" for s in claims_of(world).values())
            and set(world.claims().values()) == {f"{world.namespace}/low"}
        ),
        "the low job's claim Bound",
        PATIENCE,
    )
    world.stand_in.finishing.clear()
    created = time.monotonic()
    world.job("high", 4, 16, gang_annotations("high", 4), priority=high)
    wait_for(
        lambda: (
            world.check("job-high-").get("state") == "Ready"
            and set(world.claims().values()) == {f"{world.namespace}/high"}
        ),
        "the check to hold the unit for the high job",
        PATIENCE,
    )
    held = time.monotonic()
    leaving = world.pods_of("low-")
    assert len(leaving) == 4 and all(p["metadata"].get("deletionTimestamp") for p in leaving)
    for pod in leaving:  # Kueue's eviction, never the extender's preemption
        for condition in pod.get("status", {}).get("conditions", []):
            assert condition.get("reason") != "PreemptionByScheduler", condition
    assert sorted(claims_of(world)) == sorted(unit)
    world.stand_in.finishing.set()
    freed = time.monotonic()
    placed = world.all_bound("high-", 4)
    print(
        f"\nthe unit held for the preemptor {held - created:.1f}s after its creation, its "
        f"victims still terminating; bound {time.monotonic() - freed:.1f}s after they were let go"
    )
    assert sorted(p["spec"]["nodeName"] for p in placed) == sorted(unit)


@pytest.mark.parametrize("world", [64], indirect=True)
def test_the_extender_never_preempts_for_a_pod_of_a_kueue_workload(world: World) -> None:
    """Without the check Kueue admits by quota alone: a gang Job whose pods have a higher pod
    priority than a job outside Kueue holding the only UltraServer is admitted, and its members
    find no unit. kube-scheduler asks the extender to preempt for them; under Kueue only Kueue's
    preemption acts, so the extender evicts nothing (before issue 48 it evicted the whole job
    outside Kueue): the job outside Kueue keeps running."""
    world.unit("e")
    world.gang("outside", 4, queue=False)
    world.all_bound("outside-", 4)
    urgent = world.scenario.priority_class("urgent", 100000)
    template = world.scenario.pod_body("x", {NEURON: 16}, priority_class=urgent)
    world.cp.request(
        "POST",
        f"/apis/batch/v1/namespaces/{world.namespace}/jobs",
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "urgent", "labels": world.queued()},
            "spec": {
                "parallelism": 4,
                "completions": 4,
                "template": {
                    "metadata": {"annotations": gang_annotations("urgent", 4)},
                    "spec": {**template["spec"], "restartPolicy": "Never"},
                },
            },
        },
    )
    wait_for(lambda: len(world.pods_of("urgent-")) == 4, "the Kueue job's pods", PATIENCE)
    stack = world.module.stack
    assert stack is not None
    wait_for(
        lambda: stack.extender.metric("neuron_scheduler_preemptions_total") > 0,
        "kube-scheduler to ask the extender to preempt",
        PATIENCE,
    )
    deadline = time.monotonic() + SETTLE
    while time.monotonic() < deadline:
        running = [
            p for p in world.pods_of("outside-") if not p["metadata"].get("deletionTimestamp")
        ]
        assert len(running) == 4, dump(world.pods_of("outside-"))
        assert not any(p["spec"].get("nodeName") for p in world.pods_of("urgent-"))
        time.sleep(0.25)
    assert stack.extender.metric('neuron_scheduler_job_preemptions_total{outcome="asked"}') == 0


@pytest.mark.parametrize("world", [(64, True, True)], indirect=True)
def test_with_the_check_a_tas_pin_to_a_node_without_a_block_is_not_admitted(world: World) -> None:
    """Kueue's Topology-Aware Scheduling at the hostname level counts devices: two rings with 6
    free each, the first (by name) with no two in a row, the second with 6 in a row. Kueue's
    assignment pins a 3-device pod to the first (the counts tie). The check is not Ready and
    says so, naming the domain: the Job stays suspended and nothing waits for the pods-ready
    timeout on that node. Once device 1 of the first ring frees, a retry finds a block and the
    pod binds on 3 contiguous devices."""
    holed = world.fragmented_ring()
    filled = bound(world.scenario, "fill-")
    whole = world.add_node(RING)
    stack = world.module.stack
    assert stack is not None
    for i in range(6):  # the second ring's devices 0-5 held outside Kueue: 6-11 free in a row
        created = world.scenario.create_pod(f"half-{i}", {NEURON: 1}, scheduler="nobody")
        assert not stack.extender.bind(created, whole)
    assert holed < whole
    world.job("pinned", 1, 3, {"kueue.x-k8s.io/podset-required-topology": HOSTNAME})
    retried = wait_for(
        lambda: (c := world.check("job-pinned-")).get("state") == "Retry" and c,
        "the check to send the pinned workload back",
        PATIENCE,
    )
    assert (
        f"the domain Kueue's topology assignment pins 1 to ({HOSTNAME}={holed})"
        in retried["message"]
    ), retried
    assert "no node has 3 contiguous devices free" in retried["message"], retried
    workload = world.workload("job-pinned-")
    assert workload is not None
    conditions = {c["type"]: c for c in workload["status"].get("conditions", [])}
    assert conditions.get("Admitted", {}).get("status") != "True", conditions
    assert conditions.get("Evicted", {}).get("reason") != "PodsReadyTimeout", conditions
    job = world.cp.request("GET", f"/apis/batch/v1/namespaces/{world.namespace}/jobs/pinned")
    assert job["spec"]["suspend"] is True and world.pods_of("pinned-") == []
    world.scenario.delete_pod(filled[1])
    (placed,) = world.all_bound("pinned-", 1)
    assert contiguous(placed, 3), (placed["spec"]["nodeName"], ids(placed))
    assert world.check("job-pinned-")["state"] == "Ready"
