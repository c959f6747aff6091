"""Issues 32 and 40: training jobs on UltraServers all or nothing, with claims that survive an
extender restart and a leader change, and priorities that move whole jobs or nothing, on the real
kube-scheduler.

A control plane of its own with the Workload API on where the version has one with PodGroups
(tests/testbed/kubeversion.py: 1.36's v1alpha2 with GenericWorkload and GangScheduling, 1.37's
v1beta1 with GenericWorkload; older versions run every test but the PodGroup one), two
UltraServers of four trn2u nodes (a, b), the extender as the chart runs it (with the chart's
UltraServerClaim CRD) with short claims. Every member asks for a whole node (16 devices). The
preemption tests add a third UltraServer (c) for their own time, and a kubelet stand-in that
starts bound pods and finishes terminating ones (victims are deleted gracefully).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.chart import EXTENDER
from tests.e2e.harness import ROOT, dump, wait_for
from tests.e2e.trainingjobs import Gangs, election_rbac, evicted, nobody_evicted
from tests.testbed import (
    ControlPlane,
    ExtenderProcess,
    Stack,
)
from tests.testbed.kubeversion import binary_version, workload_api
from tests.testbed.standin import KubeletStandIn

pytestmark = pytest.mark.e2e

EXAMPLES = ROOT / "docs" / "examples" / "ultraserver"
LOW, HIGH = 10, 1000  # PriorityClass values of the preemption tests
ELECTION = ["--lease-duration=3", "--renew-deadline=2", "--retry-period=0.25"]


@pytest.fixture(scope="module")
def gangs(kubebin: Path) -> Iterator[Gangs]:
    workload = workload_api(binary_version(kubebin))
    with ControlPlane(
        kubebin,
        extra_apiserver_args=[workload.runtime_config] if workload is not None else [],
        feature_gates=workload.apiserver_gates if workload is not None else None,
    ) as cp:
        stack = Stack(cp, extender_args=["--ultraserver-claim-seconds=60"])
        world = Gangs(cp, stack, workload=workload)
        stack.scheduler = world.start_scheduler(stack.extender)
        yield world
        stack.scheduler.stop()
        stack.stop()


@pytest.fixture
def cluster(gangs: Gangs) -> Iterator[Gangs]:
    gangs.fresh()
    if not gangs.stack.extender.process.alive():
        gangs.stack.extender.start()
    assert gangs.stack.scheduler is not None
    if not gangs.stack.scheduler.alive():
        gangs.stack.scheduler.start()
    yield gangs
    gangs.clear()


def busy_unit_a(world: Gangs) -> list[str]:
    """A 4-member job bound to UltraServer a (the first by server id)."""
    busy = world.job("busy", 4)
    assert world.one_unit_each(world.placed(busy)) == {"a"}
    return busy


@pytest.mark.compat
def test_two_jobs_racing_for_one_free_unit_one_gets_it_all_the_other_none(
    cluster: Gangs,
) -> None:
    busy_unit_a(cluster)
    first: list[str] = []
    second: list[str] = []
    for i in range(4):  # created interleaved, as two controllers would
        first += cluster.job("x", 1, size=4, first=i)
        second += cluster.job("y", 1, size=4, first=i)
    placed = wait_for(
        lambda: next(
            (found for found in (cluster.nodes(first), cluster.nodes(second)) if len(found) == 4),
            None,
        ),
        "one of the two jobs bound",
        60,
    )
    loser = second if set(placed) == set(first) else first
    assert cluster.one_unit_each(placed) == {"b"}
    cluster.stays_unplaced(loser)
    # Every node is full by count now, so kube-scheduler refuses the loser itself; status says
    # what the extender would need for it.
    job = f"{cluster.namespace}/{loser[0].rsplit('-worker-', 1)[0]}"
    waits = {w["job"]: w["reason"] for w in cluster.status()["waiting"]}
    assert "needs 1 free UltraServer of 4 nodes for its 4 members, 0 free" in waits[job], waits


def test_an_eight_member_job_waits_for_two_free_units_then_binds_whole(cluster: Gangs) -> None:
    busy = busy_unit_a(cluster)
    big = cluster.job("big", 8)
    cluster.stays_unplaced(big)
    assert cluster.messages("needs 2 free UltraServers of 4 nodes for its 8 members, 1 free")
    status = cluster.status()
    waits = {w["job"]: w["reason"] for w in status["waiting"]}
    assert "needs 2 free UltraServers of 4 nodes" in waits[f"{cluster.namespace}/big"]
    # Nothing reserved for it while it cannot all fit.
    assert f"{cluster.namespace}/big" not in cluster.claims().values()
    cluster.delete(busy)
    cluster.one_unit_each(cluster.placed(big), units=2)
    claims = wait_for(
        lambda: [c for c in cluster.status()["claims"] if c["phase"] == "Bound"],
        "big's claim to be Bound",
        30,
    )
    assert [(c["job"], c["bound"], c["size"], len(c["nodes"])) for c in claims] == [
        (f"{cluster.namespace}/big", 8, 8, 8)
    ]


def test_a_claim_whose_job_is_deleted_before_any_bind_is_released(cluster: Gangs) -> None:
    busy_unit_a(cluster)
    # No kube-scheduler serves "nobody": the extender reserves b for this job, which never binds.
    ghost = cluster.job("ghost", 4, scheduler="nobody")
    wait_for(
        lambda: list(cluster.claims().values()).count(f"{cluster.namespace}/ghost") == 4,
        "the ghost job's claim",
        30,
    )
    nxt = cluster.job("next", 4)
    cluster.stays_unplaced(nxt)
    cluster.delete(ghost)
    assert cluster.one_unit_each(cluster.placed(nxt)) == {"b"}


def test_a_claim_survives_an_extender_restart_and_the_job_completes(cluster: Gangs) -> None:
    busy_unit_a(cluster)
    scheduler = cluster.stack.scheduler
    assert scheduler is not None
    scheduler.stop()  # nothing binds while the claim is made and the extender is killed
    first = cluster.job("first", 4)
    wait_for(lambda: len(cluster.claims()) == 8, "first's claim on b (and busy's on a)", 30)
    cluster.stack.extender.kill()
    # Higher priority than first: only first's persisted claim keeps it off b (it never
    # preempts: that is the preemption tests' part; no pod may be evicted unnoticed here).
    second = cluster.job("second", 4, priority_class=cluster.priority_class(1000, preempts=False))
    cluster.stack.extender.start()
    scheduler.start()
    assert cluster.one_unit_each(cluster.placed(first)) == {"b"}
    cluster.stays_unplaced(second)
    assert not cluster.leaving()


def test_a_claim_survives_a_leader_change_and_the_job_completes(cluster: Gangs) -> None:
    busy_unit_a(cluster)
    stack = cluster.stack
    assert stack.scheduler is not None
    stack.scheduler.stop()
    stack.extender.process.stop()
    election_rbac(cluster.cp)
    replicas = {
        name: ExtenderProcess(
            cluster.cp,
            stack.extender_kubeconfig,
            name=f"extender-gangs-{name}",
            pki=stack.pki,
            extra_args=[
                "--leader-elect",
                f"--lease-name={EXTENDER}",
                "--lease-namespace=kube-system",
                f"--lease-identity={name}",
                "--ultraserver-claim-seconds=60",
                *ELECTION,
            ],
        )
        for name in ("one", "two")
    }
    scheduler = None
    try:
        replicas["one"].start()  # ready once it leads
        replicas["two"].process.start()  # a standby: never ready while one leads
        first = cluster.job("first", 4)
        wait_for(lambda: len(cluster.claims()) == 8, "first's claim on b, by the leader", 30)
        replicas["one"].kill()
        wait_for(lambda: replicas["two"]._ready(), "the standby to lead", 60)
        # Higher priority than first: only first's persisted claim keeps it off b.
        never = cluster.priority_class(1000, preempts=False)
        second = cluster.job("second", 4, priority_class=never)
        scheduler = cluster.start_scheduler(replicas["two"])
        assert cluster.one_unit_each(cluster.placed(first)) == {"b"}
        cluster.stays_unplaced(second)
        assert not cluster.leaving()
    finally:
        if scheduler is not None:
            scheduler.stop()
        for replica in replicas.values():
            replica.process.stop()
        stack.extender.start()
        stack.scheduler.start()


@pytest.mark.parametrize(
    "example",
    [
        "mpijob",
        "pytorchjob",
        "jobset",
        "trainjob",
        "leaderworkerset",
        pytest.param("podgroup", marks=pytest.mark.needs("workload-api")),
        "annotation",
    ],
)
@pytest.mark.compat
def test_a_job_of_any_framework_is_placed_the_same_way(cluster: Gangs, example: str) -> None:
    pods = cluster.apply(EXAMPLES / f"{example}.yaml")
    assert len(pods) == 4, pods
    placed = cluster.placed(pods)
    assert cluster.one_unit_each(placed) == {"a"}, dump(placed)
    holders = set(cluster.claims().values())
    assert holders == {
        f"{cluster.namespace}/{'demo-0' if example == 'leaderworkerset' else 'demo'}"
    }


# --- issue 40: priorities move whole jobs, or nothing -----------------------------------------


@pytest.fixture
def three(cluster: Gangs) -> Iterator[tuple[Gangs, KubeletStandIn]]:
    """A third UltraServer (c) for this test, and a kubelet stand-in for its namespace (bound pods
    start, so their start times say how much work each would lose; preemption's victims are
    deleted gracefully, and the stand-in finishes them)."""
    added = cluster.add_unit("c")
    stand_in = KubeletStandIn(cluster.cp.client, cluster.namespace)
    stand_in.__enter__()
    try:
        yield cluster, stand_in
    finally:
        stand_in.stop()
        cluster.clear()
        cluster.remove_nodes(added)


def low_jobs(world: Gangs, stand_in: KubeletStandIn) -> list[list[str]]:
    """Three 4-member jobs of low priority, one per UltraServer (a, b, c), each started a
    second after the one before (start times have second resolution): the later, the less
    work it would lose."""
    low = world.priority_class(LOW)
    jobs = []
    for i in range(3):
        names = world.job(f"low{i}", 4, priority_class=low)
        world.one_unit_each(world.placed(names))
        wait_for(lambda n=names: set(n) <= set(stand_in.started), f"low{i} running", 30)
        time.sleep(1.1)
        jobs.append(names)
    return jobs


def test_a_higher_priority_job_larger_than_the_fleet_evicts_nobody(
    three: tuple[Gangs, KubeletStandIn],
) -> None:
    world, stand_in = three
    low_jobs(world, stand_in)
    big = world.job("big", 16, priority_class=world.priority_class(HIGH))
    nobody_evicted(world, stand_in, big)
    # It can never run here (4 UltraServers, 3 exist), which its members' events and status say
    # although every node is full (kube-scheduler refuses them itself and never asks the
    # extender's filter).
    never = "can never run here"
    assert world.messages(never), world.messages()
    waits = {w["job"]: w["reason"] for w in world.status()["waiting"]}
    assert never in waits[f"{world.namespace}/big"], waits


@pytest.mark.compat
def test_a_higher_priority_job_evicts_the_fewest_whole_jobs_and_binds_whole(
    three: tuple[Gangs, KubeletStandIn],
) -> None:
    world, stand_in = three
    oldest, *youngest = low_jobs(world, stand_in)
    units = {world.units[n] for n in world.nodes([p for job in youngest for p in job]).values()}
    big = world.job("big", 8, priority_class=world.priority_class(HIGH))
    placed = world.placed(big, 120)
    assert world.one_unit_each(placed, units=2) == units
    # Exactly the two youngest jobs (least work lost), every member of each; none of the oldest.
    gone = evicted(world, stand_in)
    assert gone == {"low1": youngest[0], "low2": youngest[1]}, f"evicted: {gone}"
    assert len(world.nodes(oldest)) == 4
    reasons = world.messages("evicted whole")
    assert reasons, world.messages()


def test_a_pod_of_no_job_never_evicts_a_member_alone(
    three: tuple[Gangs, KubeletStandIn],
) -> None:
    world, stand_in = three
    low_jobs(world, stand_in)
    world.pod("solo", {}, {}, priority_class=world.priority_class(HIGH))
    nobody_evicted(world, stand_in, ["solo"])
