"""What any pod or node may write is read as untrusted: quantities in Kubernetes' grammar within
bounds, node capacities checked against the catalog, annotation ids checked against the node."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest

from neuron_scheduler.core import capacity, handoff, planrecord
from neuron_scheduler.core.allocation import NodeState, Placement, Policy, allocate
from neuron_scheduler.core.catalog import CapacityError, Catalog
from neuron_scheduler.core.handoff import (
    ALLOCATED,
    CONTAINER_IDS,
    CORES,
    DEVS,
    IDS,
    NODE,
    RESOURCE_TYPE,
    AnnotationError,
    beyond_request,
    decode,
    encode,
    misfit,
)
from neuron_scheduler.core.quantity import MAX_QUANTITY, QuantityError, whole_quantity
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE, NeuronRequest, Unit
from neuron_scheduler.core.topology import MAX_CORES, MAX_DEVICES
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.jobs.members import MembershipError, member_of
from neuron_scheduler.jobs.placement import Occupancy
from neuron_scheduler.kube.objects import EnvVar, ObjectRef, Pod
from neuron_scheduler.kube.reading import KUEUE_ADMISSION_GATE, KUEUE_WORKLOAD_ANNOTATION, gating
from neuron_scheduler.live import fleet
from tests.builders import node, pod, pod_json

CATALOG = Catalog.builtin()


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4", 4),
        (7, 7),
        ("1k", 1000),
        ("2Ki", 2048),
        ("1000m", 1),
        ("1e3", 1000),
        ("100e-2", 1),
        ("+3", 3),
        ("1.0", 1),
        ("0", 0),
        (str(MAX_QUANTITY), MAX_QUANTITY),
    ],
)
def test_quantities_in_kubernetes_grammar(text: str | int, value: int) -> None:
    assert whole_quantity(text, "x") == value


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("1e100", "out of range"),
        ("1Ei", "out of range"),
        ("1G", "out of range"),
        (10**4000, "out of range"),
        ("9" * 5000, "cannot read"),
        ("-3", "negative"),
        (-3, "out of range"),
        ("0.5", "not a whole number"),
        ("1500m", "not a whole number"),
        ("²k", "cannot read"),  # isdigit() says yes; int() says no
        ("٣", "cannot read"),  # an Arabic-Indic digit: int() would read it
        ("1Ki5", "cannot read"),
        ("0x10", "cannot read"),
        ("", "cannot read"),
        ("1e-99999999999", "out of range"),
        (True, "not a quantity"),
    ],
)
def test_quantities_refused_before_any_arithmetic(text: str | int, why: str) -> None:
    with pytest.raises(QuantityError, match=why) as raised:
        whole_quantity(text, "limits")
    assert len(str(raised.value)) < 120  # a huge value never makes a huge message


def test_capacity_beyond_the_type_or_the_ceilings_is_refused() -> None:
    with pytest.raises(CapacityError, match=r"advertises 3000 Neuron devices, but inf1\.6xlarge"):
        CATALOG.resolve("inf1.6xlarge", 3000, None)
    with pytest.raises(CapacityError, match=r"250000000 NeuronCores per device; .* at most 4"):
        CATALOG.resolve("inf1.6xlarge", 4, 10**9)
    with pytest.raises(CapacityError, match=f"models at most {MAX_DEVICES}"):
        CATALOG.resolve("mystery.metal", 3000, None)
    with pytest.raises(CapacityError, match="not a whole number per device"):
        CATALOG.resolve("trn2.48xlarge", 16, 63)
    with pytest.raises(CapacityError, match="at most 16"):
        CATALOG.resolve("mystery.metal", 1, 10**9)
    # Trn2 at LNC=1 (8 per device) and LNC=2 (4) are both right.
    assert CATALOG.resolve("trn2.48xlarge", 16, 128).topology.cores_per_device == 8
    assert CATALOG.resolve("trn2.48xlarge", 16, 64).topology.cores_per_device == 4


def test_annotation_ids_are_bounded_before_anything_is_built() -> None:
    base = {"AWS_NEURON_IDS": "0", "NEURON_RESOURCE_TYPE": NEURON}
    with pytest.raises(AnnotationError, match=f"outside 0-{MAX_CORES - 1}"):
        decode({**base, "NEURON_CORES": "1000000000"})
    with pytest.raises(AnnotationError, match="more ids than any node has"):
        decode({**base, "NEURON_CORES": ",".join(str(10**7 + i) for i in range(3000))})
    with pytest.raises(AnnotationError, match="repeats"):
        decode({**base, "NEURON_CORES": "1,1"})
    found = decode({**base, "NEURON_CORES": "1000"})
    assert found is not None
    topology = CATALOG.resolve("inf1.6xlarge").topology
    assert misfit(found, topology) == "cores 1000 do not exist on inf1.6xlarge"
    ok = decode({**base, "NEURON_CORES": "0,1,2,3", "NEURON_DEVS": "0"})
    assert ok is not None and misfit(ok, topology) is None
    elsewhere = decode({**base, "NEURON_CORES": "4", "NEURON_DEVS": "0"})
    assert elsewhere is not None and "not on devices 0" in (misfit(elsewhere, topology) or "")


@pytest.mark.parametrize(
    "text",
    ["[" * 60_000, '{"main": ' + "[" * 60_000, '{"main": {"a": "1"}}', '["0"]', "{"],
    ids=["deep-array", "deep-value", "object-value", "array", "not-json"],
)
def test_container_slices_of_any_shape_or_depth_are_an_annotation_error(text: str) -> None:
    """Within its 64 KiB bound, NEURON_CONTAINER_IDS nested deep raised RecursionError from a
    generic decode: every reader of pods' annotations (ledger, device plugin, views) expects an
    AnnotationError, which counts the pod by its size."""
    base = {IDS: "1", RESOURCE_TYPE: NEURONCORE, CORES: "1", DEVS: "0", NODE: "n1"}
    with pytest.raises(AnnotationError, match=CONTAINER_IDS):
        decode({**base, CONTAINER_IDS: text})
    ledger = Ledger(CATALOG)
    ledger.replace_nodes([node("n1", "inf2.48xlarge")])
    annotations = {**base, CONTAINER_IDS: text}
    ledger.apply_pod(pod("h", {NEURONCORE: 1}, node="n1", uid="h", annotations=annotations))
    assert ledger.state("n1") == NodeState(0, 1)  # by its size, somewhere
    assert ledger.rejected_assignments["annotations"] == 1


def test_records_in_annotations_nested_past_any_recursion_limit_are_unreadable() -> None:
    """A plan or budget annotation may be up to 64 KiB / 1 MiB of "[": deeper than any recursion
    limit, so its decode's RecursionError is an unreadable record like any other."""
    for decode_record, error in (
        (planrecord.decode, planrecord.PlanError),
        (planrecord.decode_budget, planrecord.PlanError),
        (capacity.decode, capacity.PlaceholderError),
    ):
        for field in ("v", "unknown"):
            with pytest.raises(error):
                decode_record(f'{{"{field}": ' + "[" * 4_000)
    with pytest.raises(planrecord.PlanError, match="not a plan"):
        planrecord.decode('{"unknown": ' + "[" * 60_000)


def test_the_cores_a_pod_holds_are_the_ids_its_containers_are_handed() -> None:
    """Counted as holding its cores, handed its ids (each container its slice): ids that say
    otherwise, which anyone may write, would let a device go to two pods. Ours, upstream's
    (cores and devices derived from the ids) and the device plugin's corrections agree."""
    inf2 = CATALOG.resolve("inf2.48xlarge").topology  # 2 cores a device

    def problem(annotations: dict[str, str]) -> str | None:
        found = decode(annotations, inf2.cores_per_device)
        assert found is not None
        return misfit(found, inf2)

    device = {"AWS_NEURON_IDS": "0", "NEURON_RESOURCE_TYPE": NEURON}
    assert problem(device) is None  # upstream's: derived
    assert problem(device | {"NEURON_CORES": "0,1", "NEURON_DEVS": "0"}) is None
    assert problem(device | {"NEURON_CORES": "0", "NEURON_DEVS": "0"}) == (
        "AWS_NEURON_IDS 0, NEURON_CORES 0 and NEURON_DEVS 0 do not name the same devices"
    )
    assert problem(device | {"NEURON_CORES": "2,3", "NEURON_DEVS": "1"}) == (
        "AWS_NEURON_IDS 0, NEURON_CORES 2,3 and NEURON_DEVS 1 do not name the same devices"
    )
    core = {"AWS_NEURON_IDS": "1", "NEURON_RESOURCE_TYPE": NEURONCORE}
    assert problem(core) is None
    assert problem(core | {"NEURON_CORES": "1", "NEURON_DEVS": "0,1"}) == (
        "AWS_NEURON_IDS 1, NEURON_CORES 1 and NEURON_DEVS 0,1 do not name the same cores"
    )
    assert problem(core | {"NEURON_CORES": "0", "NEURON_DEVS": "0"}) == (
        "AWS_NEURON_IDS 1, NEURON_CORES 0 and NEURON_DEVS 0 do not name the same cores"
    )
    sliced = core | {"NEURON_CORES": "1", "NEURON_DEVS": "0"}
    assert problem(sliced | {"NEURON_CONTAINER_IDS": '{"main":"1"}'}) is None
    assert problem(sliced | {"NEURON_CONTAINER_IDS": '{"main":"5"}'}) == (
        "containers are given ids 5 that are not the pod's"
    )


def test_what_our_bind_writes_always_passes_the_checks_on_any_pods_ids() -> None:
    """The checks on a pod's ids (`misfit`, `beyond_request`) never refuse ours: every catalog
    type (trn2 at 4 and at 8 cores a device), every count a node allows in both units, on an
    empty node and on one with cores taken, by plain best-fit and by demand, for one and for
    two containers."""
    weights = ((Unit.CORE, 1, 500), (Unit.CORE, 2, 300), (Unit.DEVICE, 1, 200))
    checked = 0
    for instance_type in CATALOG.instance_types:
        resolutions = [CATALOG.resolve(instance_type)]
        if instance_type.startswith("trn2"):
            devices = CATALOG.device_count(instance_type) or 1
            resolutions.append(CATALOG.resolve(instance_type, devices, 8 * devices))  # LNC=1
        for resolved in resolutions:
            topology = resolved.topology
            requests = [NeuronRequest(NEURONCORE, n) for n in range(1, topology.total_cores + 1)]
            requests += [NeuronRequest(NEURON, n) for n in range(1, topology.devices + 1)]
            for request in requests:
                for used in (0, 0b1, (1 << topology.cores_per_device) - 1):
                    for demand in ((), weights):
                        decision = allocate(
                            topology, NodeState(used), request, Policy.BEST_FIT, demand
                        )
                        if not isinstance(decision, Placement):
                            continue
                        for containers in (["main"], ["a", "b"]):
                            written = encode("n1", request, decision, containers, 1)
                            found = decode(written, topology.cores_per_device)
                            assert found is not None
                            assert misfit(found, topology) is None, (instance_type, request)
                            assert beyond_request(found, request) is None, (instance_type, request)
                            checked += 1
    assert checked > 1000


def test_our_annotations_decoded_once_are_read_again_from_the_memo() -> None:
    """The watch shows a pod's annotations at each change: a set as bind writes it gives the same
    Assignment each time. Other keys do not matter; a change of any key decode reads does."""
    ours = encode("n1", NeuronRequest(NEURONCORE, 2), Placement((1,), (2, 3), 0), ["main"], 5)
    handoff._MEMO.clear()  # as written by another process (a restart): decoded, then remembered
    first = decode({**ours, "unrelated": "a"}, 2)
    assert first is not None and first.cores == (2, 3) and first.devices == (1,)
    assert decode({**ours, "unrelated": "b"}, 2) is first
    changed = {
        IDS: "2",
        RESOURCE_TYPE: NEURON,
        CORES: "2",
        DEVS: "0,1",
        CONTAINER_IDS: '{"main":"2"}',
        NODE: "n2",
        ALLOCATED: "true",
    }
    for key, value in changed.items():
        assert decode({**ours, key: value}, 2) != first, key
    # Their cores and devices are named: the cores per device are never read, nor in the key.
    assert decode(ours, 4) is first


def test_a_bind_s_annotations_are_remembered_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """encode remembers what it wrote: the watch showing them on the pod decodes nothing, and
    gets what decoding them gives."""
    ours = encode("n-written", NeuronRequest(NEURONCORE, 1), Placement((0,), (1,), 0), ["c"], 6)
    fresh = handoff._decode(ours, 2)

    def no_decoding(*_: object) -> None:
        raise AssertionError("decoded again")

    monkeypatch.setattr(handoff, "_decode", no_decoding)
    assert decode({**ours, "unrelated": "a"}, 2) == fresh


def test_sets_that_could_decode_to_much_more_than_their_text_are_not_kept() -> None:
    """Any pod may carry these keys: a set without its cores or devices (derived: many times the
    text, for device ids) or a long one is decoded each time, to the same result, never kept."""
    derived = {IDS: "2,3", RESOURCE_TYPE: NEURONCORE, NODE: "n1"}
    once, again = decode(derived, 2), decode(derived, 2)
    assert once is not None and once == again and once is not again
    assert once.devices == (1,)
    ours = encode("n1", NeuronRequest(NEURONCORE, 2), Placement((1,), (2, 3), 0), ["main"], 5)
    long = {**ours, CONTAINER_IDS: '{"' + "c" * 3000 + '":"2,3"}'}
    once, again = decode(long, 2), decode(long, 2)
    assert once is not None and once == again and once is not again
    assert once.containers == {"c" * 3000: (2, 3)}


def hostile_ids(node_name: str, cores: str) -> dict[str, str]:
    return {
        "AWS_NEURON_IDS": "0",
        "NEURON_RESOURCE_TYPE": NEURON,
        "NEURON_CORES": cores,
        "NEURON_NODE": node_name,
    }


def test_ledger_rejects_ids_the_node_cannot_have_and_counts_the_pod_by_size() -> None:
    reports: list[tuple[ObjectRef, str, str, bool]] = []
    ledger = Ledger(CATALOG, report=lambda *args: reports.append(args))
    ledger.replace_nodes([node("n1", "inf1.6xlarge")])
    for i, cores in enumerate(["1000000000", "99", "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16"]):
        annotations = hostile_ids("n1", cores)
        ledger.apply_pod(pod(f"h{i}", {NEURON: 1}, node="n1", uid=f"h{i}", annotations=annotations))
    state = ledger.state("n1")
    assert state.used_cores == 0  # no mask from any of them
    assert state.unattributed_cores == 3 * 4  # each holds its one device, somewhere
    assert [(ref.name, reason) for ref, reason, _, _ in reports] == [
        ("h0", "NeuronAnnotationsRejected"),
        ("h1", "NeuronAnnotationsRejected"),
        ("h2", "NeuronAnnotationsRejected"),
    ]
    assert ledger.rejected_assignments["annotations"] == 3
    # Seen again (any update of the pod): not reported twice.
    ledger.apply_pod(
        pod("h0", {NEURON: 1}, node="n1", uid="h0", annotations=hostile_ids("n1", "99"))
    )
    assert len(reports) == 3


def test_a_node_listed_after_its_pods_still_checks_their_ids() -> None:
    reports: list[tuple[ObjectRef, str, str, bool]] = []
    ledger = Ledger(CATALOG, report=lambda *args: reports.append(args))
    ledger.apply_pod(
        pod("late", {NEURON: 1}, node="n1", uid="late", annotations=hostile_ids("n1", "40"))
    )
    ledger.apply_node(node("n1", "inf1.6xlarge"))
    assert ledger.state("n1").used_cores == 0
    assert ledger.state("n1").unattributed_cores == 4
    assert [ref.name for ref, _, _, _ in reports] == ["late"]


def test_ids_read_while_the_node_is_not_listed_still_hold_them() -> None:
    """A kubelet restarting takes its node's Neuron capacity away until the device plugin
    registers again, and updates its pods meanwhile: their ids still hold when the node is back
    (counted by request instead, the next pod could be given a running pod's device)."""
    ledger = Ledger(CATALOG)
    n1 = node("n1", "inf1.6xlarge")
    ledger.apply_node(n1)
    written = hostile_ids("n1", "0,1,2,3") | {"AWS_NEURON_IDS": "0", "NEURON_DEVS": "0"}
    running = pod("p", {NEURON: 1}, node="n1", uid="p", annotations=written)
    ledger.apply_pod(running)
    ledger.remove_node("n1")  # (what a node without Neuron capacity does to the ledger)
    ledger.apply_pod(running)
    ledger.apply_node(n1)
    assert ledger.state("n1") == NodeState(0b1111, 0)


def created_pod(name: str, limits: dict[str, int], created: str, **kwargs: Any) -> Pod:
    body = pod_json(name, limits, uid=name, node="n1", **kwargs)
    body["metadata"]["creationTimestamp"] = created
    return msgspec.convert(body, Pod)


def test_ids_another_pod_names_too_count_the_pod_by_its_size() -> None:
    """A pod set on a node by its creator with the ids of a pod running there (anyone who may
    create pods can write them) is not counted as the same device, in the node's state, as
    eviction weighs the node, or in the views: the older pod keeps its ids, the other counts by
    its request, whichever of the two the ledger read first."""
    written = hostile_ids("n1", "0,1,2,3") | {"AWS_NEURON_IDS": "0", "NEURON_DEVS": "0"}
    running = created_pod("a", {NEURON: 1}, "2027-01-15T08:00:00Z", annotations=written)
    twin = created_pod("b", {NEURON: 1}, "2027-01-15T08:05:00Z", annotations=written)
    for order in ([running, twin], [twin, running]):
        ledger = Ledger(CATALOG)
        ledger.apply_node(node("n1", "inf1.6xlarge"))
        for each in order:
            ledger.apply_pod(each)
        assert ledger.state("n1") == NodeState(0b1111, 4)
        assert ledger.set_aside("n1") == {"b"}
        _, occupants = ledger.eviction_view(Claimant.of(twin, NeuronRequest(NEURON, 1)), "n1")
        assert (occupants["a"].cores, occupants["a"].unknown_cores) == (0b1111, 0)
        assert (occupants["b"].cores, occupants["b"].unknown_cores) == (0, 4)
        view = fleet.node_view(ledger, "n1")
        assert [p.pod for p in view.pods] == ["default/a"]
        assert [p.pod for p in view.unknown] == ["default/b"]
        # The twin leaving frees its size, never the running pod's device.
        leaving = msgspec.structs.replace(
            twin,
            metadata=msgspec.structs.replace(
                twin.metadata, deletionTimestamp="2027-01-15T08:06:00Z"
            ),
        )
        ledger.apply_pod(leaving)
        state, _ = ledger.eviction_view(Claimant.of(twin, NeuronRequest(NEURON, 1)), "n1")
        assert state == NodeState(0b1111, 0)
        ledger.remove_pod("a")  # the twin's ids hold them alone now
        assert ledger.state("n1") == NodeState(0b1111, 0)
        assert ledger.set_aside("n1") == frozenset()


def test_partly_overlapping_ids_are_set_aside_the_same_in_any_order() -> None:
    """Cores {0,1}, {1,2} and {2,3} of three one-core-pair pods, oldest first: the oldest and
    the youngest keep their ids, the middle one counts by its request, read in any order."""
    cores = ["0,1", "1,2", "2,3"]
    pods = [
        created_pod(
            name,
            {NEURONCORE: 2},
            f"2027-01-15T08:0{i}:00Z",
            annotations={
                "AWS_NEURON_IDS": text,
                "NEURON_RESOURCE_TYPE": NEURONCORE,
                "NEURON_CORES": text,
                "NEURON_DEVS": "0",
                "NEURON_NODE": "n1",
            },
        )
        for i, (name, text) in enumerate(zip("abc", cores, strict=True))
    ]
    for order in itertools.permutations(pods):
        ledger = Ledger(CATALOG)
        ledger.apply_node(node("n1", "inf1.6xlarge"))
        for each in order:
            ledger.apply_pod(each)
        assert ledger.set_aside("n1") == {"b"}
        assert ledger.state("n1") == NodeState(0b1111, 2)


@pytest.mark.parametrize(
    ("capacity", "code", "reason"),
    [
        ({NEURON: "3000"}, "beyond_type", "advertises 3000 Neuron devices"),
        ({NEURON: "4", NEURONCORE: "1e9"}, "unreadable", "out of range"),
        ({NEURON: "4", NEURONCORE: "1000"}, "beyond_type", "250 NeuronCores per device"),
        ({NEURON: "4", NEURONDEVICE: "3"}, "inconsistent", "neurondevice: 3"),
        ({NEURON: "lots"}, "unreadable", "cannot read quantity"),
    ],
)
def test_unusable_nodes_keep_their_reason(capacity: dict[str, str], code: str, reason: str) -> None:
    reports: list[tuple[ObjectRef, str, str, bool]] = []
    ledger = Ledger(CATALOG, report=lambda *args: reports.append(args))
    bad = node("bad", "inf1.6xlarge")
    bad.status.capacity = dict(capacity)
    ledger.replace_nodes([bad, node("good", "inf1.6xlarge")])
    assert set(ledger.nodes) == {"good"}
    assert ledger.unusable["bad"].code == code
    assert reason in ledger.unusable["bad"].reason
    assert [(ref.kind, ref.name, why) for ref, why, _, _ in reports] == [
        ("Node", "bad", "NeuronCapacityUnusable")
    ]
    # Fixed: usable again; gone from the list: forgotten.
    ledger.apply_node(node("bad", "inf1.6xlarge"))
    assert "bad" in ledger.nodes and "bad" not in ledger.unusable
    ledger.replace_nodes([])
    assert not ledger.nodes and not ledger.unusable


@pytest.mark.parametrize("text", ["²", "9" * 5000, "٣"])
def test_a_job_size_in_digits_int_refuses_or_misreads_is_no_size(text: str) -> None:
    """isdigit() says yes to '²' (int() raises ValueError) and to 5000 nines (int() refuses more
    than 4300 digits): the pod watch feeds every pod to the training-job view, and an exception
    there would end the watch."""
    sized = pod(
        "m",
        {NEURON: 1},
        annotations={"neuron-scheduler.io/gang": "g", "neuron-scheduler.io/gang-size": text},
    )
    with pytest.raises(MembershipError):
        member_of(sized)
    torch = pod(
        "t",
        {NEURON: 1},
        labels={
            "training.kubeflow.org/job-name": "t",
            "training.kubeflow.org/replica-type": "worker",
        },
    )
    torch.spec.containers[0].env += (EnvVar(name="PET_NNODES", value=text),)
    found = member_of(torch)
    assert found is not None and found.size is None  # no size: as many as seen
    occupancy = Occupancy()
    for each in (sized, torch):
        occupancy.apply_pod(each)  # no exception
    assert [p.member.job for p in occupancy.pending.values()] == [("default", "t")]


def test_what_a_gated_pod_says_of_its_gates_and_workload_is_bounded() -> None:
    """Anyone who may create a pod writes its gates and annotations: `why` shows a bounded part."""
    many = [f"example.com/gate-{i}" for i in range(40)]
    huge = "w" * 100_000
    gated = pod(
        "p",
        {NEURON: 1},
        gates=[KUEUE_ADMISSION_GATE, *many],
        annotations={KUEUE_WORKLOAD_ANNOTATION: huge},
    )
    found = gating(gated)
    assert found is not None
    assert len(found.gates) == 8 and found.more == 33
    assert found.workload == "w" * 253
    assert "and 33 more" in found.text
    assert gating(pod("free", {NEURON: 1})) is None
