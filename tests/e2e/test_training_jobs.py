"""Issue 47: training jobs all or nothing on nodes without UltraServer labels, close in EKS's
network, on the real kube-scheduler.

A control plane of its own, the extender as the chart runs it (its claim CRD, short claims) and
my-scheduler. Each test adds the trn1.32xlarge nodes it needs (in layer-3 domains X and Y where it
needs the network) and removes them after. Members ask for a whole node (16 devices) unless a
test says otherwise; jobs are made of pods as their frameworks' controllers make them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_scheduler.extender.loops.evicting import REFUSAL_SECONDS
from tests.e2e.harness import wait_for
from tests.e2e.trainingjobs import SETTLE, Gangs, evicted, nobody_evicted
from tests.testbed import ControlPlane, KubeError, Stack
from tests.testbed.standin import KubeletStandIn

pytestmark = pytest.mark.e2e

L3 = "topology.k8s.aws/network-node-layer-3"
LOW, HIGH = 10, 1000


@pytest.fixture(scope="module")
def world(kubebin: Path) -> Iterator[Gangs]:
    with ControlPlane(kubebin) as cp:
        stack = Stack(cp, extender_args=["--job-claim-seconds=60"])
        found = Gangs(cp, stack, units=())
        stack.scheduler = found.start_scheduler(stack.extender)
        yield found
        stack.scheduler.stop()
        stack.stop()


@pytest.fixture
def cluster(world: Gangs) -> Iterator[Gangs]:
    world.fresh()
    if not world.stack.extender.process.alive():
        world.stack.extender.start()
    assert world.stack.scheduler is not None
    if not world.stack.scheduler.alive():
        world.stack.scheduler.start()
    added = len(world.units)
    yield world
    world.clear()
    world.remove_nodes(list(world.units)[added:])


def pytorch(world: Gangs, job: str, index: int, size: int, **kwargs: str) -> str:
    """A PyTorchJob's worker pod, as training-operator makes it (PET_NNODES carries the size
    there; here it is the gang-size annotation, the same to the extender)."""
    name = f"{job}-worker-{index}"
    labels = {
        "training.kubeflow.org/job-name": job,
        "training.kubeflow.org/replica-type": "worker",
        "training.kubeflow.org/replica-index": str(index),
    }
    world.pod(name, labels, {"neuron-scheduler.io/gang-size": str(size), **kwargs})
    return name


def workers(world: Gangs, job: str, size: int, priority_class: str) -> list[str]:
    """A PyTorchJob's `size` workers of this PriorityClass."""
    names = []
    for i in range(size):
        name = f"{job}-worker-{i}"
        labels = {
            "training.kubeflow.org/job-name": job,
            "training.kubeflow.org/replica-type": "worker",
            "training.kubeflow.org/replica-index": str(i),
        }
        gang = {"neuron-scheduler.io/gang-size": str(size)}
        world.pod(name, labels, gang, priority_class=priority_class)
        names.append(name)
    return names


def annotated(world: Gangs, job: str, index: int, size: int) -> str:
    name = f"{job}-{index}"
    world.pod(
        name, {}, {"neuron-scheduler.io/gang": job, "neuron-scheduler.io/gang-size": str(size)}
    )
    return name


def busy(world: Gangs, node: str) -> str:
    """A pod of no job taking the whole node (my-scheduler places it there)."""
    name = f"busy-{node}"
    world.pod(name, {}, {}, node_selector={"kubernetes.io/hostname": node})
    assert world.placed([name]) == {name: node}
    return name


def _exists(world: Gangs, name: str) -> bool:
    listed = world.cp.request("GET", f"/api/v1/namespaces/{world.namespace}/pods")["items"]
    return any(p["metadata"]["name"] == name for p in listed)


def domains_of(world: Gangs, placed: dict[str, str]) -> set[str]:
    return {world.units[node] for node in placed.values()}


def never_partial(world: Gangs, first: list[str], second: list[str]) -> None:
    """For SETTLE seconds: never both jobs with some but not all members bound."""
    deadline = time.monotonic() + SETTLE
    while time.monotonic() < deadline:
        bound = [len(world.nodes(job)) for job in (first, second)]
        assert bound.count(0) + bound.count(4) == 2 and 0 in bound, f"bound: {bound}"
        time.sleep(0.25)


@pytest.mark.parametrize("framework", ["pytorchjob", "annotation"])
def test_two_jobs_on_six_whole_nodes_never_both_run_partially(
    cluster: Gangs, framework: str
) -> None:
    cluster.add_nodes([f"n{i}" for i in range(6)])
    make = pytorch if framework == "pytorchjob" else annotated
    alpha: list[str] = []
    beta: list[str] = []
    for i in range(4):  # created alternately, as the two controllers did
        alpha.append(make(cluster, "alpha", i, 4))
        beta.append(make(cluster, "beta", i, 4))
    placed = wait_for(
        lambda: next(
            (found for found in (cluster.nodes(alpha), cluster.nodes(beta)) if len(found) == 4),
            None,
        ),
        "one of the two jobs bound whole",
        60,
    )
    assert len(set(placed.values())) == 4
    loser = beta if set(placed) == set(alpha) else alpha
    never_partial(cluster, alpha, beta)
    job = loser[0].rsplit("-", 1)[0].removesuffix("-worker")
    reason = f"job {cluster.namespace}/{job} needs 4 free nodes for its 4 members"
    # kube-scheduler's event carries what its last attempt heard: its count of free nodes may
    # lag the cluster (a previous test's pods still leaving), and the attempt that hears the
    # reason may come a little after the winner is bound. `why` reads the cluster as it is now.
    try:
        wait_for(lambda: cluster.messages(reason), f"an event saying {reason!r}", 30)
    except AssertionError as error:
        raise AssertionError(f"{error}: {cluster.messages()}; {cluster.job_log()}") from None
    assert not cluster.messages("UltraServer"), cluster.messages("UltraServer")
    wanted = f"{reason}, 2 free"
    wait_for(lambda: wanted in (cluster.why(loser[0])["job"] or ""), f"why: {wanted!r}", 30)


def test_a_job_lands_in_the_one_layer_3_domain_that_can_hold_it(cluster: Gangs) -> None:
    cluster.add_nodes([f"x{i}" for i in range(4)], "X")
    cluster.add_nodes([f"y{i}" for i in range(4)], "Y")
    busy(cluster, "x1")
    for attempt in range(2):  # the issue saw it span both domains in 5 of 6 tries
        job = [pytorch(cluster, f"j{attempt}", i, 4) for i in range(4)]
        placed = cluster.placed(job)
        assert domains_of(cluster, placed) == {"Y"}, placed
        cluster.delete(job)
        wait_for(lambda j=job: not any(_exists(cluster, p) for p in j), "the job gone", 30)
    busy(cluster, "y2")  # one node busy in each domain: a 3-member job takes one of them
    job = [pytorch(cluster, "three", i, 3) for i in range(3)]
    assert len(domains_of(cluster, cluster.placed(job))) == 1


def test_a_required_job_waits_with_its_reason_and_starts_when_a_domain_frees(
    cluster: Gangs,
) -> None:
    cluster.add_nodes([f"x{i}" for i in range(4)], "X")
    cluster.add_nodes([f"y{i}" for i in range(4)], "Y")
    busy(cluster, "x0")
    blocker = busy(cluster, "y3")
    required = {"kueue.x-k8s.io/podset-required-topology": L3}
    job = [pytorch(cluster, "needy", i, 4, **required) for i in range(4)]
    cluster.stays_unplaced(job)
    reason = f"requires its 4 members in one {L3} domain"
    assert cluster.messages(reason), cluster.messages()
    assert reason in (cluster.why(job[0])["job"] or "")
    cluster.delete([blocker])
    assert domains_of(cluster, cluster.placed(job)) == {"Y"}


def test_ranks_follow_the_network_order(cluster: Gangs) -> None:
    # Names that sort otherwise than the network does: X holds r1 and r3, Y holds r0 and r2.
    cluster.add_nodes(["r1", "r3"], "X")
    cluster.add_nodes(["r0", "r2"], "Y")
    names = {}
    for index in (3, 1, 0, 2):  # created out of order
        names[index] = pytorch(cluster, "ranked", index, 4)
    placed = cluster.placed(list(names.values()))
    assert [placed[names[i]] for i in range(4)] == ["r1", "r3", "r0", "r2"], placed


def test_a_job_of_unknown_size_whose_members_arrive_apart_shares_its_node(cluster: Gangs) -> None:
    """No gang-size: the job is as large as the members seen. Its first member gets a claim on
    one inf2 node for one; the later ones go next to it while the ring has contiguous room (the
    claim grows), not wait for a second node that is not there."""
    cluster.add_nodes(["ring"], instance_type="inf2.48xlarge")  # 12 devices
    names = []
    for index in range(3):
        name = f"apart-{index}"
        cluster.pod(name, {}, {"neuron-scheduler.io/gang": "apart"}, devices=3)
        names.append(name)
        assert cluster.placed(names) == dict.fromkeys(names, "ring")
    assert not cluster.messages("free node"), cluster.messages()


def test_a_claim_survives_an_extender_restart_and_the_job_completes(cluster: Gangs) -> None:
    cluster.add_nodes([f"n{i}" for i in range(6)])
    scheduler = cluster.stack.scheduler
    assert scheduler is not None
    scheduler.stop()  # nothing binds while the claim is made and the extender is killed
    first = [pytorch(cluster, "first", i, 4) for i in range(4)]
    wait_for(lambda: len(cluster.claims()) == 4, "first's claim on four nodes", 30)
    claimed = set(cluster.claims())
    cluster.stack.extender.kill()
    # Higher priority: only first's persisted claim keeps it off first's nodes (it never
    # preempts: no pod may be evicted here).
    never = cluster.priority_class(1000, preempts=False)
    second = []
    for i in range(4):
        name = f"second-{i}"
        cluster.pod(
            name,
            {},
            {"neuron-scheduler.io/gang": "second", "neuron-scheduler.io/gang-size": "4"},
            priority_class=never,
        )
        second.append(name)
    cluster.stack.extender.start()
    scheduler.start()
    assert set(cluster.placed(first).values()) == claimed
    cluster.stays_unplaced(second)
    assert not cluster.leaving()


@pytest.fixture
def stand_in(cluster: Gangs) -> Iterator[KubeletStandIn]:
    """Bound pods start (so start times say how much work each would lose); victims are deleted
    gracefully and finished."""
    found = KubeletStandIn(cluster.cp.client, cluster.namespace)
    found.__enter__()
    try:
        yield found
    finally:
        found.stop()


def two_running_jobs(cluster: Gangs, stand_in: KubeletStandIn) -> list[list[str]]:
    """low0 and low1, 4 members each on 8 nodes, running; low1 the younger."""
    cluster.add_nodes([f"n{i}" for i in range(8)])
    low = cluster.priority_class(LOW)
    jobs = []
    for j in range(2):
        names = workers(cluster, f"low{j}", 4, low)
        cluster.placed(names)
        wait_for(lambda n=names: set(n) <= set(stand_in.started), f"low{j} running", 30)
        time.sleep(1.1)  # start times have second resolution: the second is younger
        jobs.append(names)
    return jobs


def test_a_higher_priority_job_evicts_the_fewest_whole_jobs_on_nodes(
    cluster: Gangs, stand_in: KubeletStandIn
) -> None:
    jobs = two_running_jobs(cluster, stand_in)
    youngest = set(cluster.nodes(jobs[1]).values())  # (before big exists: it evicts them)
    big = workers(cluster, "big", 4, cluster.priority_class(HIGH))
    placed = cluster.placed(big, 120)
    gone = evicted(cluster, stand_in)
    assert gone == {"low1": jobs[1]}, f"evicted: {gone}"  # the youngest, whole
    assert set(placed.values()) == youngest
    assert len(cluster.nodes(jobs[0])) == 4


POLICY = "e2e-no-deleting-protected-pods"
ADMISSION = "/apis/admissionregistration.k8s.io/v1"


def test_a_victim_the_api_server_will_not_delete_means_no_preemption_until_it_will(
    cluster: Gangs, stand_in: KubeletStandIn
) -> None:
    """An admission policy refuses deleting one member of low1, the job preemption would
    evict: evicting the others first, then failing on it until the claim ended, would leave
    low1 partly evicted. The extender asks a dry run of each deletion first: nobody is evicted,
    and its log says which pod and why. Once the policy goes, big preempts as usual."""
    jobs = two_running_jobs(cluster, stand_in)
    protected = jobs[1][2]
    cluster.cp.request(
        "PATCH",
        f"/api/v1/namespaces/{cluster.namespace}/pods/{protected}",
        {"metadata": {"labels": {"e2e-protected": "true"}}},
        "application/merge-patch+json",
    )
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["DELETE"],
                        "resources": ["pods"],
                    }
                ]
            },
            "validations": [
                {
                    "expression": "!has(oldObject.metadata.labels) || "
                    "!('e2e-protected' in oldObject.metadata.labels)",
                    "message": "protected pods are not deleted",
                }
            ],
        },
    }
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": POLICY},
        "spec": {"policyName": POLICY, "validationActions": ["Deny"]},
    }
    pod_path = f"/api/v1/namespaces/{cluster.namespace}/pods/{protected}"
    dry_run = {"apiVersion": "v1", "kind": "DeleteOptions", "dryRun": ["All"]}

    def refused() -> bool:
        try:
            cluster.cp.request("DELETE", pod_path, dry_run)
        except KubeError as error:
            return error.status in (400, 403, 422)
        return False

    cluster.cp.request("POST", f"{ADMISSION}/validatingadmissionpolicies", policy)
    cluster.cp.request("POST", f"{ADMISSION}/validatingadmissionpolicybindings", binding)
    try:
        wait_for(refused, "the policy in force", 30)
        big = workers(cluster, "big", 4, cluster.priority_class(HIGH))
        log = cluster.stack.extender.process.log_tail
        wait_for(
            lambda: f"refuses to delete {cluster.namespace}/{protected}" in log(400),
            "the extender saying which victim the API server will not delete",
            60,
        )
        nobody_evicted(cluster, stand_in, big)
    finally:
        cluster.cp.request("DELETE", f"{ADMISSION}/validatingadmissionpolicybindings/{POLICY}")
        cluster.cp.request("DELETE", f"{ADMISSION}/validatingadmissionpolicies/{POLICY}")
        wait_for(lambda: not refused(), "the policy gone", 30)  # (the next test deletes pods)
    # kube-scheduler tries big's members again on a cluster event (or within 5 minutes): a node
    # joins, which alone is not enough for big. (Past the time a refusal is believed.)
    time.sleep(REFUSAL_SECONDS)
    cluster.add_nodes(["n8"])
    cluster.placed(big, 120)
    gone = evicted(cluster, stand_in)
    assert gone == {"low1": jobs[1]}, f"evicted: {gone}"


def test_a_higher_priority_job_larger_than_the_fleet_evicts_nobody_on_nodes(
    cluster: Gangs, stand_in: KubeletStandIn
) -> None:
    cluster.add_nodes([f"n{i}" for i in range(4)])
    low = cluster.priority_class(LOW)
    names = []
    for i in range(4):
        name = f"low-{i}"
        gang = {"neuron-scheduler.io/gang": "low", "neuron-scheduler.io/gang-size": "4"}
        cluster.pod(name, {}, gang, priority_class=low)
        names.append(name)
    cluster.placed(names)
    huge = []
    for i in range(6):
        name = f"huge-{i}"
        gang = {"neuron-scheduler.io/gang": "huge", "neuron-scheduler.io/gang-size": "6"}
        cluster.pod(name, {}, gang, priority_class=cluster.priority_class(HIGH))
        huge.append(name)
    nobody_evicted(cluster, stand_in, huge)
    assert cluster.messages("can never run here"), cluster.messages()
