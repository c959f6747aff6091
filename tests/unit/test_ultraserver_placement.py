"""UltraServer placement, all or nothing: which job a pod belongs to (each framework), claims as
objects of their own, the plan that reserves whole units for all members at once, and what filter
admits."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import msgspec
import pytest
import yaml
from rich.console import Console

from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.verbs.wire import ExtenderArgs, ExtenderBindingArgs
from neuron_scheduler.extender.wiring import wire
from neuron_scheduler.jobs.claims import (
    BOUND,
    PENDING,
    ClaimError,
    NodeClaim,
    from_object,
    to_object,
)
from neuron_scheduler.jobs.members import MembershipError, member_of
from neuron_scheduler.jobs.placement import (
    Fit,
    Occupancy,
    Planned,
    Shortfall,
    UnitPlacement,
    decide,
    plan,
)
from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.objects import (
    ClaimSpec,
    JobClaim,
    Node,
    ObjectMeta,
    Pod,
    PodGroup,
)
from neuron_scheduler.live.terminal import ultraserver_tables
from neuron_scheduler.live.ultraservers import ultraserver_json, ultraserver_view
from tests.builders import node as node_object
from tests.builders import node_json, pod_json

PREFIX = "neuron.amazonaws.com/ultraserver-"
KUBEFLOW = {"training.kubeflow.org/job-name": "j", "training.kubeflow.org/job-role": "worker"}


def fleet() -> tuple[Occupancy, list[str]]:
    """Two UltraServers (a, b) of 4 nodes, each two pairs, plus one plain trn2 node."""
    occupancy = Occupancy()
    names = []
    for unit in ("a", "b"):
        for i in range(4):
            name = f"{unit}{i}"
            names.append(name)
            labels = {
                PREFIX + "mode": "1_2_4",
                PREFIX + "server-id-4": f"{unit}000000000000000",
                PREFIX + "node-id-4": str(i),
                PREFIX + "server-id-2": f"{unit}{i // 2}00000000000000",
                PREFIX + "node-id-2": str(i % 2),
            }
            occupancy.apply_node(Node(metadata=ObjectMeta(name=name, labels=labels)))
    names.append("plain")
    occupancy.apply_node(Node(metadata=ObjectMeta(name="plain", labels={})))
    return occupancy, names


def member(
    job: str, index: int, node: str = "", config: int | None = None, size: int | None = None
) -> Pod:
    annotations = {} if config is None else {PREFIX + "node-config": str(config)}
    if size is not None:
        annotations["neuron-scheduler.io/gang-size"] = str(size)
    body = pod_json(
        f"{job}-worker-{index}",
        {NEURON: 16},
        namespace="ns",
        node=node,
        uid=f"{job}-{index}",
        labels={"training.kubeflow.org/job-name": job, "training.kubeflow.org/job-role": "worker"},
        annotations=annotations,
    )
    return msgspec.convert(body, Pod)


def claim(occupancy: Occupancy, job: str, nodes: list[str], config: int = 4, size: int = 4) -> None:
    for name in nodes:
        occupancy.hold(NodeClaim(name, ("ns", job), config, size, PENDING, time.time(), 120))


everyone_fits = Fit(lambda _: None)


def nodes(planned: Planned | Shortfall) -> list[str] | Shortfall:
    """The nodes a plan claims, in network order (a Shortfall as it is)."""
    return planned.nodes if isinstance(planned, Planned) else planned


# --- which job a pod belongs to ------------------------------------------------------------------


def labelled(
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    pod_group: str = "",
) -> Pod:
    body = pod_json("p", {NEURON: 16}, namespace="ns", labels=labels, annotations=annotations)
    if env:
        body["spec"]["containers"][0]["env"] = [{"name": k, "value": v} for k, v in env.items()]
    if pod_group:
        body["spec"]["schedulingGroup"] = {"podGroupName": pod_group}
    return msgspec.convert(body, Pod)


def test_every_framework_names_the_job_and_what_it_says_of_its_size() -> None:
    mpi = member_of(labelled(KUBEFLOW, {"neuron-scheduler.io/gang-size": "8"}))
    assert mpi is not None and (mpi.job, mpi.framework, mpi.size) == (("ns", "j"), "mpijob", 8)
    launcher = {**KUBEFLOW, "training.kubeflow.org/job-role": "launcher"}
    assert member_of(labelled(launcher)) is None
    pytorch = {
        "training.kubeflow.org/job-name": "t",
        "training.kubeflow.org/replica-type": "master",
    }
    found = member_of(labelled(pytorch, env={"PET_NNODES": "4"}))
    assert found is not None and (found.job, found.framework, found.size) == (
        ("ns", "t"),
        "pytorchjob",
        4,
    )
    jobset = member_of(labelled({"jobset.sigs.k8s.io/jobset-name": "js"}))
    assert jobset is not None and (jobset.job, jobset.framework, jobset.size) == (
        ("ns", "js"),
        "jobset",
        None,
    )
    group_labels = {
        "leaderworkerset.sigs.k8s.io/name": "vllm",
        "leaderworkerset.sigs.k8s.io/group-index": "2",
    }
    lws = member_of(labelled(group_labels, {"leaderworkerset.sigs.k8s.io/size": "4"}))
    assert lws is not None
    assert (lws.job, lws.framework, lws.size) == (("ns", "vllm-2"), "leaderworkerset", 4)
    group = member_of(labelled({}, pod_group="g1"))
    assert group is not None and (group.job, group.pod_group) == (("ns", "g1"), "g1")
    gang = {"neuron-scheduler.io/gang": "mine", "neuron-scheduler.io/gang-size": "2"}
    ours = member_of(labelled({}, gang))
    assert ours is not None and (ours.job, ours.size) == (("ns", "mine"), 2)
    assert member_of(labelled({"app": "web"})) is None


def test_a_size_that_is_no_size_is_an_error_naming_where_it_was_read() -> None:
    for bad in ("0", "-1", "many", "100000"):
        with pytest.raises(MembershipError, match=r"neuron-scheduler\.io/gang-size"):
            member_of(labelled(KUBEFLOW, {"neuron-scheduler.io/gang-size": bad}))
    for name in ("x" * 300, "Upper", "a/b", "-a", "bad\nline"):
        with pytest.raises(MembershipError, match=r"neuron-scheduler\.io/gang="):
            member_of(labelled({}, {"neuron-scheduler.io/gang": name}))


def test_a_pod_groups_min_count_is_the_jobs_size() -> None:
    occupancy, _ = fleet()
    found = member_of(labelled({}, pod_group="g"))
    assert found is not None
    assert occupancy.size(found, found.job) == 0  # nothing seen yet: no size known
    group = {
        "metadata": {"name": "g", "namespace": "ns"},
        "spec": {"schedulingPolicy": {"gang": {"minCount": 8}}},
    }
    occupancy.apply_pod_group(msgspec.convert(group, PodGroup))
    assert occupancy.size(found, found.job) == 8


# --- claims as UltraServerClaim objects -----------------------------------------------------------


def test_a_claim_goes_to_its_object_and_back() -> None:
    written = NodeClaim("a0", ("ns", "j"), 4, 8, PENDING, 1_700_000_000.25, 120, "my-scheduler")
    found = to_object(written)
    assert (found.apiVersion, found.kind) == ("neuron-scheduler.io/v1alpha1", "UltraServerClaim")
    assert found.metadata.name == "a0"
    assert (found.spec.namespace, found.spec.job, found.spec.phase) == ("ns", "j", "Pending")
    found.metadata.resourceVersion, found.metadata.uid = "7", "u1"
    read = from_object(msgspec.json.decode(msgspec.json.encode(found), type=JobClaim))
    assert read == NodeClaim(
        "a0", ("ns", "j"), 4, 8, PENDING, 1_700_000_000.25, 120, "my-scheduler", "7", "u1"
    )
    preempting = dataclasses.replace(
        written, victims=("p1", "p2"), victim_jobs=(("ns", "low"), ("other", "x.y"))
    )
    found = to_object(preempting)
    assert found.spec.victimJobs == ["ns/low", "other/x.y"]
    read = from_object(msgspec.json.decode(msgspec.json.encode(found), type=JobClaim))
    assert read == preempting


CLAIM_CRD = (
    Path(__file__).resolve().parents[2] / "charts/neuron-scheduler/files/ultraserverclaims-crd.yaml"
)


def test_the_crd_keeps_every_field_a_claim_is_written_with() -> None:
    """The API server drops fields its schema does not name (pruning): a field the extender
    writes and the CRD lacks is lost without an error (victimJobs would be, and a new leader
    could not work out a preemption's victims)."""
    crd = yaml.safe_load(CLAIM_CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(ClaimSpec.__struct_fields__) <= set(schema["properties"])


def test_claims_we_could_not_have_written_are_refused() -> None:
    good = to_object(NodeClaim("a0", ("ns", "j"), 4, 8, BOUND, 1.0, 120))

    def changed(**spec: object) -> JobClaim:
        return msgspec.structs.replace(good, spec=msgspec.structs.replace(good.spec, **spec))

    for bad in (
        changed(node="b0"),  # another node's claim under this name
        changed(config=3),
        changed(size=0),
        changed(size=5000),
        changed(phase="Maybe"),
        changed(seconds=0),
        changed(renewTime="yesterday"),
        changed(renewTime="2026-01-01T00:00:00"),  # no zone
        changed(job=""),
        changed(scheduler="s" * 300),
        changed(victimJobs=["no-namespace"]),
        changed(victimJobs=["ns/a/b"]),
        changed(victimJobs=["/x"]),
        changed(victimJobs=["ns/" + "x" * 400]),
        changed(victimJobs=["ns/x"] * 1025),
    ):
        with pytest.raises(ClaimError):
            from_object(bad)
    occupancy, _ = fleet()
    occupancy.apply_claim(changed(phase="Maybe"))
    assert not occupancy.claims and "a0" in occupancy.rejected


# --- the plan: whole units, for all members at once ----------------------------------------------


def test_a_job_gets_whole_units_for_all_its_members_or_nothing() -> None:
    occupancy, _ = fleet()
    assert nodes(plan(occupancy, ("ns", "one"), 4, 4, everyone_fits)) == ["a0", "a1", "a2", "a3"]
    assert nodes(plan(occupancy, ("ns", "two"), 4, 8, everyone_fits)) == [
        "a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3",
    ]  # fmt: skip
    occupancy.apply_pod(member("other", 0, node="b1"))
    short = plan(occupancy, ("ns", "two"), 4, 8, everyone_fits)
    assert isinstance(short, Shortfall)
    assert "needs 2 free UltraServers of 4 nodes for its 8 members, 1 free" in short.reason
    assert "nothing is reserved until all of them fit" in short.reason
    busy = plan(occupancy, ("ns", "one"), 4, 4, Fit(lambda n: "full" if n == "a2" else None))
    assert isinstance(busy, Shortfall) and "0 free" in busy.reason


def test_configs_share_no_unit_and_pairs_fit_beside_pairs() -> None:
    occupancy, _ = fleet()
    occupancy.apply_pod(member("pair", 0, node="a0", config=2))
    # A 4-node job may not take unit a: a 2-node job holds half of it.
    assert nodes(plan(occupancy, ("ns", "big"), 4, 4, everyone_fits)) == ["b0", "b1", "b2", "b3"]
    # Another 2-node job may take a's other pair, first by server id.
    assert nodes(plan(occupancy, ("ns", "pair2"), 2, 2, everyone_fits)) == ["a2", "a3"]
    claim(occupancy, "big", ["b0", "b1", "b2", "b3"])
    assert nodes(plan(occupancy, ("ns", "pair3"), 2, 4, everyone_fits)) == Shortfall(
        "job ns/pair3 needs 2 free UltraServer pairs (2 nodes) for its 4 members, 1 free; "
        "nothing is reserved until all of them fit"
    )


def test_a_job_adds_to_what_it_holds_and_prefers_units_with_its_own_members() -> None:
    occupancy, _ = fleet()
    occupancy.apply_pod(member("j", 0, node="b2"))  # bound before it had a claim
    assert nodes(plan(occupancy, ("ns", "j"), 4, 4, everyone_fits)) == ["b0", "b1", "b2", "b3"]
    claim(occupancy, "j", ["b0", "b1", "b2", "b3"], size=8)
    assert nodes(plan(occupancy, ("ns", "j"), 4, 8, everyone_fits)) == ["a0", "a1", "a2", "a3"]
    claim(occupancy, "j", ["a0", "a1", "a2", "a3"], size=8)
    assert nodes(plan(occupancy, ("ns", "j"), 4, 8, everyone_fits)) == []


# --- what filter admits ---------------------------------------------------------------------------


def test_members_go_only_to_the_nodes_of_their_jobs_complete_claim() -> None:
    occupancy, names = fleet()
    first = member("j", 0, size=4)
    found = member_of(first)
    assert found is not None
    refused = decide(occupancy, found, 4, names)
    assert refused.passed == ["plain"]  # plain: not an UltraServer node, not ours to judge
    assert "has no nodes reserved yet" in refused.failed["a0"]
    occupancy.shortfalls[("ns", "j")] = "job ns/j needs 1 free UltraServer of 4 nodes, 0 free"
    assert decide(occupancy, found, 4, names).failed["b3"].endswith("0 free")
    claim(occupancy, "j", ["a0", "a1"])  # half written: nobody goes yet
    assert decide(occupancy, found, 4, names).passed == ["plain"]
    claim(occupancy, "j", ["a2", "a3"])
    assert decide(occupancy, found, 4, names).passed == ["a0", "a1", "a2", "a3", "plain"]
    occupancy.apply_pod(member("j", 1, node="a2"))
    choice = decide(occupancy, found, 4, names)
    assert choice.failed["a2"] == "already runs a member of job ns/j"
    assert "go to the nodes reserved for it (a0, a1, a2, a3)" in choice.failed["b0"]
    other = member_of(member("k", 0))
    assert other is not None
    assert (
        "job ns/k has no nodes reserved yet" in (decide(occupancy, other, 4, names).failed["a1"])
    )  # one reason for a job without a claim, on every node: what kube-scheduler's event says
    claim(occupancy, "k", ["b0", "b1", "b2", "b3"])
    assert decide(occupancy, other, 4, names).failed["a1"] == (
        "UltraServer node reserved for job ns/j"
    )
    occupancy.release("a1")  # a claim ended: the job holds three nodes, admits nobody
    assert decide(occupancy, found, 4, names).passed == ["plain"]


def test_the_filter_leaves_other_pods_alone_and_refuses_bad_configs() -> None:
    occupancy, names = fleet()
    rule = UnitPlacement(occupancy)
    plain = msgspec.convert(pod_json("x", {NEURON: 1}, namespace="ns"), Pod)
    assert rule.filter(plain, names, now=0.0) == (names, {})
    claim(occupancy, "j", ["b0", "b1", "b2", "b3"])  # a pod of no job keeps off claimed nodes
    passed, failed = rule.filter(plain, names, now=0.0)
    assert passed == ["a0", "a1", "a2", "a3", "plain"]
    assert failed["b2"] == "UltraServer node reserved for job ns/j"
    assert not rule.admits(plain, "b2", 0.0) and rule.admits(plain, "a2", 0.0)
    for node_name in ["b0", "b1", "b2", "b3"]:
        occupancy.release(node_name)
    passed, failed = rule.filter(member("j", 0, config=3), names, now=0.0)
    assert passed == ["plain"]
    assert "valid values are 4, 2 and 1" in failed["a0"]
    bad_size = labelled(KUBEFLOW, {"neuron-scheduler.io/gang-size": "x"})
    passed, failed = rule.filter(bad_size, names, now=0.0)
    assert passed == ["plain"] and "not a job size" in failed["b0"]
    assert not rule.asked
    rule.filter(member("j", 1), names, now=5.0)
    assert rule.asked == {("ns", "j"): 5.0}  # the loop renews the claims of jobs being placed


def test_members_are_tracked_bound_and_pending() -> None:
    occupancy, _ = fleet()
    occupancy.apply_pod(member("j", 0))
    assert set(occupancy.pending) == {"j-0"}
    occupancy.apply_pod(member("j", 0, node="a0"))
    assert set(occupancy.workers) == {"j-0"} and not occupancy.pending
    occupancy.replace_pods([])
    assert not occupancy.workers and not occupancy.on_node and not occupancy.pending
    no_devices = msgspec.convert(pod_json("l", {"cpu": 1}, labels=KUBEFLOW), Pod)
    occupancy.apply_pod(no_devices)  # a member needs Neuron devices (a launcher does not)
    assert not occupancy.pending


def test_a_reserved_member_stays_until_the_watch_or_its_bind_says_otherwise() -> None:
    occupancy, _ = fleet()
    pending = member("j", 0)
    occupancy.reserve(pending, "a0", Placement((0,), (0, 1), 10))
    occupancy.apply_pod(pending)  # the watch shows bind's annotation patch: still unbound
    assert occupancy.workers[pending.metadata.uid].node == "a0"
    occupancy.unreserve(pending, "a1")  # another node's hold: not this one
    assert pending.metadata.uid in occupancy.workers
    occupancy.unreserve(pending, "a0")
    assert not occupancy.workers and pending.metadata.uid in occupancy.pending
    occupancy.reserve(pending, "a0", Placement((0,), (0, 1), 10))
    occupancy.apply_pod(member("j", 0, node="a0"))  # bound: the watch speaks for it now
    occupancy.unreserve(pending, "a0")  # a failed attempt's late let-go changes nothing
    assert occupancy.workers[pending.metadata.uid].node == "a0"


class SlowBindAPI:
    """What bind calls on the API; the binding itself waits until the test lets it go."""

    def __init__(self) -> None:
        self.pods: dict[str, Pod] = {}
        self.binding = asyncio.Event()  # set while a binding is in flight
        self.proceed = asyncio.Event()
        self.fail = False

    async def get_pod(self, namespace: str, name: str) -> Pod:
        return self.pods[name]

    async def patch_annotations(self, *_: object, **__: object) -> str:
        return "2"

    async def bind(self, namespace: str, name: str, uid: str, node: str, **_: object) -> None:
        self.binding.set()
        await self.proceed.wait()
        if self.fail:
            raise api_error("POST", f"/api/v1/namespaces/{namespace}/pods/{name}/binding", 500, b"")

    async def create_event(self, *_: object, **__: object) -> None:
        return None


def one_device_member(job: str, index: int) -> Pod:
    """A member that asks for one device, so several would fit on one node by devices alone."""
    bare = member(job, index, config=4, size=4)
    with_request = msgspec.convert(pod_json(bare.metadata.name, {NEURON: 1}), Pod)
    return msgspec.structs.replace(with_request, metadata=bare.metadata)


async def test_a_member_being_bound_already_counts_on_its_node() -> None:
    api = SlowBindAPI()
    extender = wire(api, Catalog.builtin())  # type: ignore[arg-type]
    extender.synced.set()
    for i in range(4):
        ultra = node_json(f"a{i}", "trn2.48xlarge")
        ultra["metadata"]["labels"].update(
            {PREFIX + "mode": "1_2_4", PREFIX + "server-id-4": "a000000000000000"}
        )
        for view in extender.views:
            view.apply_node(msgspec.convert(ultra, Node))
    nodes = ["a0", "a1", "a2", "a3"]
    claim(extender.occupancy, "j", nodes)
    first, second = one_device_member("j", 0), one_device_member("j", 1)
    api.pods = {first.metadata.name: first, second.metadata.name: second}
    target = extender.judge.filter(ExtenderArgs(Pod=first, NodeNames=nodes)).passed[0]
    args = ExtenderBindingArgs(first.metadata.name, "ns", first.metadata.uid, target)
    binding = asyncio.create_task(extender.binder.bind(args))
    await api.binding.wait()
    # The first member's binding is in flight, invisible to the watch: its node is taken.
    result = extender.judge.filter(ExtenderArgs(Pod=second, NodeNames=nodes))
    assert target not in result.passed
    assert result.failed[target] == "already runs a member of job ns/j"
    # The binding fails and is rolled back: the node is open to the job again.
    api.fail = True
    api.proceed.set()
    assert "failed" in await binding
    assert target in extender.judge.filter(ExtenderArgs(Pod=second, NodeNames=nodes)).passed


def test_status_shows_units_claims_and_why_a_job_waits() -> None:
    occupancy, _ = fleet()
    ledger = Ledger(Catalog.builtin())
    labelled_nodes = [
        node_object(
            n,
            "trn2u.48xlarge",
            labels={PREFIX + "mode": "1_2_4", PREFIX + "server-id-4": f"{n[0]}000000000000000"},
        )
        for n in occupancy.servers
        if n != "plain"
    ]
    ledger.replace_nodes(labelled_nodes)
    for i in range(4):
        occupancy.hold(NodeClaim(f"a{i}", ("ns", "j"), 4, 4, PENDING, 1000.0, 120))
    occupancy.apply_pod(member("j", 0, node="a0"))
    for pod in (member("big", i, size=8) for i in range(8)):
        occupancy.apply_pod(pod)
        ledger.apply_pod(pod)
    view = ultraserver_view(occupancy, ledger, now=1100.0)
    document = ultraserver_json(view)
    assert document["claims"] == [
        {
            "job": "ns/j",
            "phase": "Pending",
            "config": 4,
            "size": 4,
            "nodes": ["a0", "a1", "a2", "a3"],
            "bound": 1,
            "ends_in_seconds": 20.0,
            # (the claim's creation time is the API server's: not known here)
            "progress": f"job ns/j has 1 of its 4 members, holding UltraServer a{'0' * 15}",
            "victims_leaving": 0,
        }
    ]
    a0 = document["units"][0]["nodes"][0]
    assert a0 == {"node": "a0", "claimed_by": "ns/j", "members": ["ns/j"]}
    assert document["waiting"] == [
        {
            "job": "ns/big",
            "reason": "job ns/big needs 2 free UltraServers of 4 nodes for its 8 members, 1 "
            "free; nothing is reserved until all of them fit",
        }
    ]
    console = Console(width=200, record=True)
    for part in ultraserver_tables(view):
        console.print(part)
    text = console.export_text()
    assert "1 of 4" in text and "20s" in text and "job ns/big waits" in text


def test_the_first_refusal_of_a_job_without_a_claim_already_says_what_it_needs() -> None:
    """kube-scheduler retries a refused pod only on an event: its first refusal must carry the
    reason, not a placeholder the reservation loop replaces later."""
    occupancy, names = fleet()
    occupancy.apply_pod(member("busy", 0, node="a1"))
    rule = UnitPlacement(occupancy, lambda pod: Fit(lambda n: None))
    _, failed = rule.filter(member("big", 0, size=8), names, now=0.0)
    assert (
        "job ns/big needs 2 free UltraServers of 4 nodes for its 8 members, 1 free"
        in (failed["b2"])
    )
    _, failed = rule.filter(member("small", 0, size=4), names, now=0.0)
    assert "job ns/small fits now (on 4 nodes)" in failed["b0"]
