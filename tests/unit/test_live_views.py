"""The live views' pure parts (live/fleet, live/diagnosis, live/devicemap, live/terminal): a
ledger fed as `status` and `why` feed it, and what comes out."""

from __future__ import annotations

from typing import Any

import msgspec
from rich.console import Console

from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.handoff import encode
from neuron_scheduler.core.health import unhealthy_taint_key
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest, Unit
from neuron_scheduler.core.topology import TopologyKind
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.jobs.claims import PENDING, NodeClaim
from neuron_scheduler.jobs.placement import Occupancy
from neuron_scheduler.jobs.units import MODE_LABEL, server_id_label
from neuron_scheduler.kube.kueue import Workload
from neuron_scheduler.kube.objects import Node, Pod
from neuron_scheduler.live.devicemap import FREE, USED, draw, layout, pod_colours
from neuron_scheduler.live.diagnosis import (
    NotPending,
    Verdict,
    block_place,
    diagnose,
    diagnosis_json,
    freeing_text,
    pending_request,
)
from neuron_scheduler.live.dranodes import HealthSlice, dra_nodes, dra_text
from neuron_scheduler.live.fleet import fleet_json, fleet_view
from neuron_scheduler.live.terminal import shown, status_view, why_view
from neuron_scheduler.live.ultraservers import ultraserver_view
from neuron_scheduler.live.workloadstatus import report_json, unread_report, workload_report
from tests.builders import node, node_json, pod, pod_json

TRN1 = Catalog.builtin().resolve("trn1.32xlarge", 16).topology  # 4x4 torus, 2 cores a device


def bound(name: str, node_name: str, devices: list[int], priority: int = 0, **kwargs: Any) -> Pod:
    """A pod the extender placed on `node_name`: these devices (of a trn1), in its annotations."""
    per = TRN1.cores_per_device
    cores = tuple(c for d in devices for c in range(d * per, (d + 1) * per))
    request = NeuronRequest(NEURON, len(devices))
    annotations = encode(node_name, request, Placement(tuple(devices), cores, 0), ["c0"], 1)
    body = pod_json(
        name, {NEURON: len(devices)}, node=node_name, annotations=annotations, phase="Running"
    )
    body["spec"]["priority"] = priority
    return _pod(body, **kwargs)


def _pod(body: dict[str, Any], **kwargs: Any) -> Pod:
    for key, value in kwargs.items():
        body["spec"][key] = value
    return msgspec.convert(body, Pod)


def cluster(*pods: Pod, nodes: list[Node] | None = None) -> Ledger:
    ledger = Ledger(Catalog.builtin())
    ledger.replace_nodes(nodes or [node("trn-a", "trn1.32xlarge")])
    ledger.replace_pods(list(pods))
    return ledger


# --- status ----------------------------------------------------------------------------------


def test_fleet_shows_each_pods_ids_and_what_is_free() -> None:
    placed_elsewhere = pod("other", {NEURONCORE: 3}, node="trn-a", phase="Running")
    ledger = cluster(bound("half", "trn-a", list(range(8))), bound("one", "trn-a", [12]))
    ledger.apply_pod(placed_elsewhere)  # ids unknown: 3 cores held somewhere
    fleet = fleet_view(ledger, other_nodes=2)
    (view,) = fleet.nodes
    assert [(p.pod, p.devices, p.unit) for p in view.pods] == [
        ("default/half", tuple(range(8)), Unit.DEVICE),
        ("default/one", (12,), Unit.DEVICE),
    ]
    assert view.pods[1].cores == (24, 25)
    assert [(u.pod, u.count, u.unit) for u in view.unknown] == [("default/other", 3, Unit.CORE)]
    # 7 devices idle, but the 3 cores of unknown ids must take 2 of them (none is partly used).
    assert view.free_devices == 16 - 9 - 2
    assert view.free_cores == 32 - 18 - 3
    assert view.largest_free_block == 4  # rows 2 (devices 8-11); row 3 is broken by device 12
    # Free devices outside their node's largest block: 1 of the 5 free.
    assert fleet.fragmentation == 1 / 5
    document = fleet_json(fleet)
    summary = document["summary"]
    assert (summary["nodes"], summary["nodes_without_neuron"], summary["free_devices"]) == (1, 2, 5)
    by_size = {(c["resource"], c["count"]): c for c in summary["could_take_one_now"]}
    assert by_size[(NEURON, 4)] == {
        "resource": NEURON,
        "count": 4,
        "nodes_now": 1,
        "nodes_allowing": 1,
    }
    assert by_size[(NEURON, 8)]["nodes_now"] == 0 and by_size[(NEURON, 8)]["nodes_allowing"] == 1
    _, pod_json_one = document["nodes"][0]["pods"]
    assert pod_json_one == {
        "pod": "default/one",
        "unit": "device",
        "ids": [12],
        "devices": [12],
        "cores": [24, 25],
        "priority": 0,
        "terminating": False,
        "on_unhealthy_devices": [],
    }


def test_a_node_whose_capacity_cannot_be_right_is_listed_unusable_not_modelled() -> None:
    bad = node_json("bad", "trn1.32xlarge")
    bad["status"]["capacity"]["aws.amazon.com/neurondevice"] = "3"  # disagrees with neuron: 16

    ledger = cluster(nodes=[node("trn-a", "trn1.32xlarge"), msgspec.convert(bad, Node)])
    fleet = fleet_view(ledger)
    assert [n.name for n in fleet.nodes] == ["trn-a"]
    ((name, problem),) = fleet.unusable
    assert name == "bad" and problem.code == "inconsistent"
    assert fleet_json(fleet)["unusable_nodes"][0]["name"] == "bad"


def test_ids_that_cannot_be_the_nodes_are_not_shown_as_ids_but_held_by_count() -> None:
    hostile = bound("liar", "trn-a", [0])
    hostile.metadata.annotations["AWS_NEURON_IDS"] = "99"
    hostile.metadata.annotations["NEURON_DEVS"] = "99"
    hostile.metadata.annotations["NEURON_CORES"] = "198,199"
    (view,) = fleet_view(cluster(hostile)).nodes
    assert view.pods == ()
    assert [(u.pod, u.count) for u in view.unknown] == [("default/liar", 1)]
    assert view.free_devices == 15 and view.free_cores == 30


def test_status_text_draws_each_node_and_the_summary() -> None:
    ledger = cluster(bound("half", "trn-a", list(range(8))))
    console = Console(width=140, record=True, color_system=None)
    for part in status_view(fleet_view(ledger)):
        console.print(part)
    text = console.export_text()
    assert "trn-a  trn1.32xlarge  torus, 16 devices x 2 cores" in text
    assert "default/half  devices 0-7  cores 0-15" in text
    assert "8 of 16 devices free" in text
    assert text.count(USED) == 16 + 1  # 8 devices x 2 cores on the map, one in the legend
    assert text.count(FREE) == 16


# --- device maps -----------------------------------------------------------------------------


def test_layouts_place_every_device_once_and_link_as_the_topology_does() -> None:
    catalog = Catalog.builtin()
    ring = catalog.resolve("inf2.48xlarge", 12).topology
    assert ring.kind is TopologyKind.RING
    shape = layout(ring)
    assert sorted(shape.cells) == list(range(12)) and len(set(shape.cells.values())) == 12
    assert len(shape.links) == 12 and (11, 0) in shape.links
    torus = layout(TRN1)
    assert torus.wraps and (torus.rows, torus.columns) == (4, 4)
    assert len(torus.links) == 2 * 4 * 3  # the wrap-around links are drawn as stubs
    lines = draw(TRN1, {0: "a", 1: "a"}, {"a": "red"})
    drawn = "\n".join(line.plain for line in lines)
    assert drawn.count(USED) == 2 and drawn.count(FREE) == 30
    assert all(f"{d}" in drawn for d in range(16))


def test_colours_follow_the_simulators_order_by_first_core() -> None:
    colours = pod_colours({"late": 10, "early": 0, "held": 4})
    assert list(colours) == ["early", "held", "late"]


def test_text_from_the_cluster_cannot_reach_the_terminal_raw() -> None:
    assert shown("a\x1b[31mb\nc\u202ed") == "a?[31mb?c?d"
    assert len(shown("x" * 10_000)) == 120


# --- why -------------------------------------------------------------------------------------


def test_why_names_the_pods_holding_the_cheapest_block_and_what_preemption_would_evict() -> None:
    ledger = cluster(
        bound("big-high", "trn-a", list(range(8)), priority=1000),
        bound("row", "trn-a", [8, 9, 10, 11]),
        bound("two", "trn-a", [13]),
        bound("one", "trn-a", [12]),
    )
    waiting = pod("waiting", {NEURON: 8})
    waiting.spec.priority = 0
    ledger.apply_pod(waiting)
    diagnosis = diagnose(ledger, waiting)
    (here,) = diagnosis.nodes
    assert here.verdict is Verdict.BLOCKED
    assert here.reason == "needs 8 devices; only 2 devices free"
    assert here.blocking is not None and here.preemption is None
    assert here.blocking.pods == ("default/row", "default/one", "default/two")  # by first id
    assert here.blocking.devices == tuple(range(8, 16)) and here.blocking.where == "rows 2-3"
    assert freeing_text(here.blocking) == (
        "rows 2-3 (devices 8-15) are held by pods default/row, default/one, default/two"
    )
    # At priority 100 the preempt verb could evict those three: the same pods.
    waiting.spec.priority = 100
    (here,) = diagnose(ledger, waiting).nodes
    assert here.preemption is not None and here.preemption.pods == here.blocking.pods
    document = diagnosis_json(diagnose(ledger, waiting))
    assert document["summary"]["blocked"] == 1
    assert document["nodes"][0]["blocking"]["where"] == "rows 2-3"


def test_why_gives_every_nodes_answer_in_the_order_closest_to_fitting() -> None:
    tainted = node_json("tainted", "trn1.32xlarge")
    tainted["spec"]["taints"] = [{"key": "gpu", "effect": "NoSchedule"}]
    nodes = [node(n, "trn1.32xlarge") for n in ("free", "full", "far")]
    nodes.append(msgspec.convert(tainted, Node))
    ledger = cluster(
        bound("all", "full", list(range(16))),
        bound("x", "far", [0]),
        nodes=nodes,
    )
    four = pod("four", {NEURON: 4})
    three = pod("three", {NEURON: 3})
    for p in (four, three):
        ledger.apply_pod(p)
    answers = {n.node: n for n in diagnose(ledger, four).nodes}
    assert [n.node for n in diagnose(ledger, four).nodes] == ["far", "free", "full", "tainted"]
    assert answers["free"].verdict is Verdict.FITS
    assert answers["free"].placement is not None
    assert answers["full"].verdict is Verdict.BLOCKED
    assert answers["full"].blocking is not None
    assert answers["full"].blocking.pods == ("default/all",)
    assert (
        answers["tainted"].verdict is Verdict.EXCLUDED and "taint gpu" in answers["tainted"].reason
    )
    # Three devices: a size a 4x4 torus never gives, whatever is freed.
    assert {n.verdict for n in diagnose(ledger, three).nodes} == {Verdict.NEVER, Verdict.EXCLUDED}


def test_why_applies_the_extenders_ultraserver_rule_where_devices_fit() -> None:
    def ultraserver(name: str, unit: str) -> Node:
        n = node(name, "trn1.32xlarge")
        n.metadata.labels |= {MODE_LABEL: "1_2_4", server_id_label(4): unit}
        return n

    nodes = [ultraserver("u1", "aaa"), ultraserver("u2", "bbb")]
    labels = {"training.kubeflow.org/job-name": "other", "training.kubeflow.org/job-role": "worker"}
    busy = bound("other-worker", "u1", [0])
    busy.metadata.labels.update(labels)
    ledger = cluster(busy, nodes=nodes)
    occupancy = Occupancy()
    occupancy.replace_nodes(nodes)
    occupancy.replace_pods([busy])
    worker = pod(
        "mine",
        {NEURON: 1},
        labels={**labels, "training.kubeflow.org/job-name": "mine"},
        annotations={"neuron.amazonaws.com/ultraserver-node-config": "1"},
    )
    answers = {n.node: n for n in diagnose(ledger, worker, occupancy=occupancy).nodes}
    # No claim yet: the extender reserves whole units for the job first; why says whether it can.
    assert answers["u2"].verdict is Verdict.UNIT_RULE
    assert "job default/mine fits now (on 1 node)" in answers["u2"].reason
    assert answers["u1"].verdict is Verdict.UNIT_RULE
    assert answers["u1"].reason == answers["u2"].reason  # one reason for the job
    assert answers["u1"].placement is None
    occupancy.hold(NodeClaim("u2", ("default", "mine"), 1, 1, PENDING, 0.0, 120))
    answers = {n.node: n for n in diagnose(ledger, worker, occupancy=occupancy).nodes}
    assert answers["u2"].verdict is Verdict.FITS
    assert answers["u1"].reason == "runs a member of job default/other"


def test_why_and_status_give_a_jobs_line_even_when_every_node_is_full() -> None:
    """A member of a job that can never run here (3 units, it needs 4): why says so though no
    node fits its devices; a job with 1 of its 2 members bound: status and why say how far."""

    def trn2u(name: str, unit: str) -> Node:
        n = node(name, "trn2u.48xlarge")
        n.metadata.labels |= {MODE_LABEL: "1_2_4", server_id_label(4): unit}
        return n

    nodes = [trn2u(f"{u}{i}", u * 16) for u in "abc" for i in range(4)]
    job = {"training.kubeflow.org/job-role": "worker"}
    full = []
    for n in nodes:  # a pod of no job on every node, all its devices
        body = pod_json(f"full-{n.metadata.name}", {NEURON: 16}, node=n.metadata.name)
        full.append(msgspec.convert(body, Pod))
    ledger = cluster(*full, nodes=nodes)
    occupancy = Occupancy()
    occupancy.replace_nodes(nodes)
    occupancy.replace_pods(full)
    huge = pod(
        "huge-0",
        {NEURON: 16},
        labels={**job, "training.kubeflow.org/job-name": "huge"},
        annotations={"neuron-scheduler.io/gang-size": "16"},
    )
    found = diagnose(ledger, huge, occupancy=occupancy)
    assert not found.count(Verdict.FITS) and not found.count(Verdict.UNIT_RULE)
    assert found.job.startswith("job default/huge can never run here: it needs 4 UltraServers")
    assert diagnosis_json(found)["job"] == found.job
    # Half a job: its claim holds unit a, one member bound on a0 (as the watch shows it).
    mine = {**job, "training.kubeflow.org/job-name": "two"}
    sized = {"neuron-scheduler.io/gang-size": "2"}
    occupancy.replace_pods([])
    ledger.replace_pods([])
    for i in range(4):
        occupancy.hold(NodeClaim(f"a{i}", ("default", "two"), 4, 2, PENDING, 0.0, 120, created=50))
    first = msgspec.convert(
        pod_json("two-0", {NEURON: 16}, node="a0", labels=mine, annotations=sized), Pod
    )
    occupancy.apply_pod(first)
    ledger.apply_pod(first)
    second = pod("two-1", {NEURON: 16}, labels=mine, annotations=sized)
    line = f"job default/two has 1 of its 2 members, holding UltraServer {'a' * 16} since "
    assert diagnose(ledger, second, occupancy=occupancy, now=100).job.startswith(line)
    assert diagnose(ledger, second, occupancy=occupancy, now=100).job.endswith("(50s ago)")
    view = ultraserver_view(occupancy, ledger, 100.0)
    assert [c.progress for c in view.claims] == [f"{line}1970-01-01T00:00:50Z (50s ago)"]


def test_why_has_nothing_to_say_about_bound_finished_or_non_neuron_pods() -> None:
    for subject, message in [
        (pod("b", {NEURON: 1}, node="n"), "is not pending: it is bound to node n"),
        (pod("f", {NEURON: 1}, phase="Failed"), "is not pending: it has failed"),
        (pod("c", {"cpu": 1}), "requests no Neuron resources"),
    ]:
        try:
            pending_request(subject)
        except NotPending as error:
            assert message in str(error)
        else:
            raise AssertionError(f"{subject.key} was taken as pending")


def test_a_request_no_node_can_serve_is_said_once_not_per_node() -> None:
    both = pod("both", [{NEURON: 1}, {NEURONCORE: 2}])
    ledger = cluster(both)
    diagnosis = diagnose(ledger, both)
    assert diagnosis.request is None and diagnosis.nodes == ()
    assert diagnosis.request_error
    console = Console(width=140, record=True, color_system=None)
    for part in why_view(diagnosis):
        console.print(part)
    assert "no node can take it" in console.export_text()


def test_block_place_names_whole_rows_of_a_torus_only() -> None:
    assert block_place(TRN1, [8, 9, 10, 11]) == "row 2"
    assert block_place(TRN1, list(range(8))) == "rows 0-1"
    assert block_place(TRN1, [0, 1, 2, 3, 12, 13, 14, 15]) == "rows 0,3"
    assert block_place(TRN1, [0, 4, 8, 12]) == ""
    ring = Catalog.builtin().resolve("inf2.48xlarge", 12).topology
    assert block_place(ring, [0, 1, 2, 3]) == ""


# --- nodes our DRA driver serves -------------------------------------------------------------


def test_dra_nodes_name_the_failed_devices_their_taints_name_and_nothing_else() -> None:
    driver = "neuron.neuron-scheduler.io"
    key = unhealthy_taint_key(driver)

    def piece(node: str, devices: list[tuple[str, list[dict[str, str]]]], by: str = driver) -> Any:
        return msgspec.convert(
            {
                "spec": {
                    "driver": by,
                    "nodeName": node,
                    "devices": [{"name": n, "taints": t} for n, t in devices],
                }
            },
            HealthSlice,
        )

    sick = [{"key": key, "value": "neuron13", "effect": "NoSchedule"}]
    slices = [
        piece("trn1-b", [("single-13", sick), ("row-3", sick), ("single-0", [])]),
        piece("trn1-b", [("all", [{"key": key, "value": "neuron12"}])]),
        piece("inf2-a", [("single-0", []), ("single-1", [])]),
        piece("inf2-a", [("single-2", [{"key": "someone/else", "value": "neuron2"}])]),
        piece("inf2-a", [("single-3", [{"key": key, "value": "neuron999"}])]),  # not a device
        piece("other", [("x", sick)], by="gpu.example.com"),  # another driver's
    ]
    nodes = dra_nodes(slices, driver)
    assert [(n.name, n.devices, n.unhealthy) for n in nodes] == [
        ("inf2-a", 4, ()),
        ("trn1-b", 4, (12, 13)),
    ]
    assert dra_text(nodes) == (
        "2 nodes served by DRA; failed devices, never allocated (their sets are tainted): "
        "trn1-b (devices 12,13)"
    )


# --- what Kueue says of a gated pod's Workload -----------------------------------------------


def test_a_workload_without_quota_says_kueues_reason_and_checks_beyond_eight_are_counted() -> None:
    workload = msgspec.convert(
        {
            "metadata": {"name": "train", "namespace": "ml"},
            "status": {
                "conditions": [
                    {
                        "type": "QuotaReserved",
                        "status": "False",
                        "reason": "Pending",
                        "message": "couldn't assign flavors to pod set main: insufficient\n"
                        "quota for aws.amazon.com/neuron",
                    }
                ],
                "admissionChecks": [
                    {"name": f"check-{i}", "state": "Pending", "message": ""} for i in range(10)
                ],
            },
        },
        Workload,
    )
    report = workload_report(workload)
    assert not report.quota_reserved and report.cluster_queue == ""
    assert report.quota_message == (
        "couldn't assign flavors to pod set main: insufficient quota for aws.amazon.com/neuron"
    )
    assert [c.name for c in report.checks] == [f"check-{i}" for i in range(8)]
    assert report.lines[0] == (
        f"Kueue's Workload ml/train: not admitted; no quota reserved: {report.quota_message}"
    )
    assert report.lines[-1] == "... and 2 more admission checks"
    gone = unread_report("ml/train", 'workloads.kueue.x-k8s.io "train" is forbidden')
    assert gone.lines == [
        'Kueue\'s Workload ml/train: not read (workloads.kueue.x-k8s.io "train" is forbidden)'
    ]
    assert report_json(gone)["unread"] and report_json(gone)["admission_checks"] == []
