"""prioritize-claims: the extender's node scores for pods with our DRA claims, from what the
slices' and claims' watches give its DRA view."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from neuron_scheduler.core.allocation import NodeState, allocate, placement_score
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import Demand
from neuron_scheduler.core.ids import ids_mask
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest, Unit
from neuron_scheduler.dra.claims import ResourceClaim
from neuron_scheduler.dra.pools import PoolSlice, pool_size
from neuron_scheduler.dra.slices import NodeInventory, pool_slices
from neuron_scheduler.extender.command import register
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.dranodes import ClaimClasses, DraNodes
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.verbs.judging import Judge
from neuron_scheduler.extender.verbs.wire import ExtenderArgs
from neuron_scheduler.kube.objects import Pod
from tests.builders import node
from tests.unit.commands import app_with

DRIVER = "neuron.example.com"
CATALOG = Catalog.builtin()


def slices_of(
    name: str,
    instance_type: str,
    core_windows: tuple[int, ...] = (1, 2, 4, 8),
    unhealthy: dict[int, str] | None = None,
) -> list[PoolSlice]:
    topology = CATALOG.resolve(instance_type).topology
    inventory = NodeInventory(name, topology, unhealthy=unhealthy or {}, core_windows=core_windows)
    contents = pool_slices(DRIVER, inventory)
    return [
        msgspec.convert(
            {"metadata": {"name": c.name}, "spec": c.spec(DRIVER, name, 1, len(contents))},
            PoolSlice,
        )
        for c in contents
    ]


def claim(
    name: str,
    device_class: str,
    held: list[tuple[str, str]] = (),
    count: int = 1,
    *,
    admin: bool = False,
) -> ResourceClaim:
    body: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "neurons",
                        "exactly": {"deviceClassName": device_class, "count": count},
                    }
                ]
            }
        },
    }
    if held:
        results = [
            {"request": "neurons", "driver": DRIVER, "pool": pool, "device": device}
            | ({"adminAccess": True} if admin else {})
            for pool, device in held
        ]
        body["status"] = {"allocation": {"devices": {"results": results}}}
    return msgspec.convert(body, ResourceClaim)


def pod_with(claim_name: str, *, template: bool = False) -> Pod:
    entry = (
        {"name": "neurons", "resourceClaimTemplateName": "t"}
        if template
        else {"name": "neurons", "resourceClaimName": claim_name}
    )
    status = (
        {"resourceClaimStatuses": [{"name": "neurons", "resourceClaimName": claim_name}]}
        if template
        else {}
    )
    return msgspec.convert(
        {
            "metadata": {"name": "p", "namespace": "ns", "uid": "pod-uid"},
            "spec": {"resourceClaims": [entry]},
            "status": status,
        },
        Pod,
    )


def world() -> tuple[Judge, DraNodes]:
    dra = DraNodes(CATALOG, ClaimClasses(DRIVER))
    dra.replace_nodes(
        [node("a", "inf2.48xlarge"), node("b", "inf2.48xlarge"), node("cpu", "m5.large")]
    )
    dra.replace_slices([*slices_of("a", "inf2.48xlarge"), *slices_of("b", "inf2.48xlarge")])
    # Core 0 of node a is held: its device 0 has one core free.
    dra.replace_claims([claim("held", "neuroncore-1", [("a", "cores-1-at-0")])])
    ledger = Ledger(CATALOG)
    return Judge(ledger, Metrics(ledger), dra=dra), dra


def scores(judge: Judge, pod: Pod, asked: tuple[tuple[Unit, int], ...] = ()) -> dict[str, int]:
    """Scores with the cluster asking for `asked` shapes equally often lately (the demand the
    test's claims recorded is replaced: none means best fit alone)."""
    assert judge.dra is not None
    judge.dra.demand = Demand()
    for _ in range(10):
        for unit, count in asked:
            judge.dra.demand.record(unit, count)
    answer = judge.prioritize_claims(ExtenderArgs(Pod=pod, NodeNames=["a", "b", "cpu", "nowhere"]))
    return {h.Host: h.Score for h in answer}


SINGLES_AND_CORES = ((Unit.CORE, 1), (Unit.DEVICE, 1))


def test_a_core_claim_prefers_the_node_where_it_fills_a_broken_device() -> None:
    """The cluster asks for single cores and single devices. On a, first fit gives core 1 (the
    rest of device 0): it wastes nothing. On b, core 0: device 0's other core is then lost to
    device claims. Nodes that are not our DRA nodes score 0."""
    judge, dra = world()
    dra.apply_claim(claim("mine", "neuroncore-1"))
    expected = {"a": 10, "b": 9, "cpu": 0, "nowhere": 0}
    assert scores(judge, pod_with("mine"), SINGLES_AND_CORES) == expected
    # By best fit alone, the free core runs decide: 23 cores from core 1 on a, 24 on b.
    assert scores(judge, pod_with("mine"))["a"] == scores(judge, pod_with("mine"))["b"] == 1
    # A claim made from a template is found through the pod's status.
    dra.apply_claim(claim("made", "neuroncore-1"))
    assert scores(judge, pod_with("made", template=True), SINGLES_AND_CORES) == expected


def test_the_packing_entry_scores_how_full_each_node_is_once_placed() -> None:
    """prioritize-claims' tie-break: cores in use after the scheduler's pick, of 24."""
    judge, dra = world()
    dra.apply_claim(claim("big", "neuron-6", [("b", "window-6-at-0")]))
    dra.apply_claim(claim("mine", "neuroncore-2"))
    answer = judge.prioritize_claims_packing(
        ExtenderArgs(Pod=pod_with("mine"), NodeNames=["a", "b", "cpu"])
    )
    # a: 1 core held + 2 = 3 of 24 -> 1; b: 12 + 2 = 14 of 24 -> 6; not ours: 0.
    assert {h.Host: h.Score for h in answer} == {"a": 1, "b": 6, "cpu": 0}
    other = judge.prioritize_claims_packing(ExtenderArgs(Pod=pod_with("none"), NodeNames=["a"]))
    assert other[0].Score == 0


def test_the_score_follows_the_claims_as_they_come_and_go() -> None:
    judge, dra = world()
    dra.apply_claim(claim("mine", "neuron-2"))
    before = scores(judge, pod_with("mine"))
    dra.apply_claim(claim("other", "neuron-10", [("b", "window-10-at-2")]))
    after = scores(judge, pod_with("mine"))
    assert after["b"] == 10 > before["b"]  # b's free run of 2 devices (0, 1) fits exactly
    dra.remove_claim(claim("other", "neuron-10", [("b", "window-10-at-2")]))
    assert scores(judge, pod_with("mine")) == before


def test_pods_that_are_not_scored_get_zeros() -> None:
    judge, dra = world()
    zeros = {"a": 0, "b": 0, "cpu": 0, "nowhere": 0}
    assert scores(judge, pod_with("unknown")) == zeros
    dra.apply_claim(claim("two", "neuroncore-1", count=2))  # not one legal set
    assert scores(judge, pod_with("two")) == zeros
    dra.apply_claim(claim("gpu", "gpu-1"))
    assert scores(judge, pod_with("gpu")) == zeros
    dra.apply_claim(claim("done", "neuroncore-1", [("b", "cores-1-at-5")]))  # allocated already
    assert scores(judge, pod_with("done")) == zeros
    assert judge.prioritize_claims(ExtenderArgs(Pod=None, NodeNames=["a"]))[0].Score == 0
    plain = Judge(Ledger(CATALOG), Metrics(Ledger(CATALOG)))  # no DRA view
    assert plain.prioritize_claims(ExtenderArgs(Pod=pod_with("x"), NodeNames=["a"]))[0].Score == 0


def test_a_pool_is_read_from_its_newest_counter_slice_and_forgotten_with_it() -> None:
    judge, dra = world()
    dra.apply_claim(claim("mine", "neuroncore-1"))
    counter = slices_of("a", "inf2.48xlarge")[0]
    dra.remove_slice(counter)
    assert scores(judge, pod_with("mine"), SINGLES_AND_CORES)["a"] == 0
    dra.apply_slice(counter)
    assert scores(judge, pod_with("mine"), SINGLES_AND_CORES)["a"] == 10
    # Another driver's slices and pools not named after their node are not ours.
    foreign = msgspec.structs.replace(
        counter, spec=msgspec.structs.replace(counter.spec, driver="x")
    )
    dra.remove_slice(counter)
    dra.apply_slice(foreign)
    assert dra.node("a") is None


def test_class_names_and_pool_counters_are_read_strictly() -> None:
    classes = ClaimClasses(DRIVER)
    assert classes.request("neuron-3") == NeuronRequest(NEURON, 3)
    assert classes.request("neuroncore-2") == NeuronRequest(NEURONCORE, 2)
    for name in ("neuron", "neuron-0", "neuron-x", "neuron-99999", "gpu-1", "neuroncores-1"):
        assert classes.request(name) is None, name
    counters = slices_of("n", "trn2.48xlarge")[0].spec.sharedCounters
    assert pool_size(counters) == (16, 4)
    bad = msgspec.structs.replace(
        counters[0], counters={"d0": counters[0].counters["d0"], "d5": counters[0].counters["d0"]}
    )
    assert pool_size([bad]) is None  # ids with a gap


def test_placement_score_is_allocates_score_for_allocates_own_placement() -> None:
    topology = CATALOG.resolve("inf2.48xlarge").topology
    for used in (0, ids_mask([0]), ids_mask(range(2, 9)), ids_mask([1, 2, 5, 6, 7, 20])):
        state = NodeState(used)
        for request in (
            NeuronRequest(NEURONCORE, 1),
            NeuronRequest(NEURONCORE, 3),
            NeuronRequest(NEURON, 2),
        ):
            placed = allocate(topology, state, request)
            assert not isinstance(placed, tuple) or hasattr(placed, "cores")
            score = placement_score(topology, state, request.unit, ids_mask(placed.cores))
            assert score == placed.score, (used, request)


def test_demand_is_recorded_once_per_claim_of_ours() -> None:
    _, dra = world()
    dra.demand = Demand()
    for _ in range(3):
        dra.apply_claim(claim("mine", "neuroncore-2"))  # the same claim, changing
    dra.apply_claim(claim("gpu", "gpu-1"))
    assert dra.demand.weights == ((Unit.CORE, 2, 1024),)


def test_a_claim_with_admin_access_holds_no_cores() -> None:
    """kube-scheduler does not count an admin-access result as allocated (a monitoring claim
    reaches devices other claims use): the score must not either."""
    judge, dra = world()
    dra.apply_claim(claim("mine", "neuron-3"))
    before = scores(judge, pod_with("mine"), SINGLES_AND_CORES)
    packing = judge.prioritize_claims_packing(ExtenderArgs(Pod=pod_with("mine"), NodeNames=["b"]))
    dra.apply_claim(claim("monitor", "neuron-12", [("b", "all")], admin=True))
    assert scores(judge, pod_with("mine"), SINGLES_AND_CORES) == before
    after = judge.prioritize_claims_packing(ExtenderArgs(Pod=pod_with("mine"), NodeNames=["b"]))
    assert after == packing


def test_a_relist_does_not_count_the_claims_it_knows_again() -> None:
    """Demand is what pods asked for lately: a claim counts once when it appears, not again at
    every relist of the claims' watch (the ledger counts its pods the same way)."""
    _, dra = world()
    dra.demand = Demand()
    for i in range(10):  # core claims that came and went
        dra.apply_claim(claim(f"gone-{i}", "neuroncore-2"))
        dra.remove_claim(claim(f"gone-{i}", "neuroncore-2"))
    staying = claim("staying", "neuron-1", [("a", "single-3")])
    dra.apply_claim(staying)
    weights = dra.demand.weights
    for _ in range(20):
        dra.replace_claims([staying])
    assert dra.demand.weights == weights
    dra.replace_claims([staying, claim("new", "neuroncore-4")])  # one new to the list counts
    assert (Unit.CORE, 4) in {(unit, count) for unit, count, _ in dra.demand.weights}


def test_failed_devices_are_never_the_schedulers_pick() -> None:
    """A failed device's sets carry a NoSchedule taint: kube-scheduler's first fit skips them as
    it skips sets in use, so a node with device 5 failed scores as one whose device 5 is held."""
    judge, dra = world()
    dra.replace_slices(
        [
            *slices_of("a", "inf2.48xlarge", unhealthy={5: "gone"}),
            *slices_of("b", "inf2.48xlarge"),
        ]
    )
    dra.replace_claims([claim("held", "neuron-1", [("b", "single-5")])])
    for asked in ("neuron-6", "neuroncore-8", "neuroncore-1"):
        dra.apply_claim(claim(f"mine-{asked}", asked))
        pod = pod_with(f"mine-{asked}")
        by_fit = scores(judge, pod, SINGLES_AND_CORES)
        assert by_fit["a"] == by_fit["b"], asked
        packing = judge.prioritize_claims_packing(ExtenderArgs(Pod=pod, NodeNames=["a", "b"]))
        assert packing[0].Score == packing[1].Score, asked
    # The taint goes with the failure: a is whole again.
    dra.replace_slices([*slices_of("a", "inf2.48xlarge"), *slices_of("b", "inf2.48xlarge")])
    pod = pod_with("mine-neuron-6")
    packing = judge.prioritize_claims_packing(ExtenderArgs(Pod=pod, NodeNames=["a", "b"]))
    assert packing[0].Score < packing[1].Score
    # The driver taints in place, slice by slice (the same generation).
    for piece in slices_of("a", "inf2.48xlarge", unhealthy={5: "gone"})[1:]:
        dra.apply_slice(piece)
    packing = judge.prioritize_claims_packing(ExtenderArgs(Pod=pod, NodeNames=["a", "b"]))
    assert packing[0].Score == packing[1].Score


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dra-driver", "neuron.aws.com"], "--dra-driver: neuron.aws.com is under aws.com"),
        (["--dra-driver", "Neuron"], "--dra-driver: 'Neuron' is not a domain-qualified"),
        (
            ["--dra-driver", "neuron.example.com", "--dra-core-class-prefix", "Bad_Prefix"],
            "--dra-core-class-prefix 'Bad_Prefix' is not a DNS label prefix",
        ),
        (
            ["--dra-driver", "neuron.example.com", "--dra-core-class-prefix", "neuron"],
            "--dra-device-class-prefix and --dra-core-class-prefix differ",
        ),
    ],
)
def test_the_extender_refuses_bad_dra_options_in_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app_with(register), ["extender", "--insecure", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_a_relist_rebuilds_what_each_node_holds_with_its_topology() -> None:
    """A node's held cores are built from its topology: a relist that may change a node's
    instance type forgets both (as a single node's update does), never the topology alone."""
    _, dra = world()
    before = dra.node("a")
    assert before is not None
    dra.replace_nodes([node("a", "inf2.48xlarge"), node("b", "inf2.48xlarge")])
    after = dra.node("a")
    assert after is not None and after[1] is not before[1]
    assert after[1] == before[1]  # the same node, the same holds
