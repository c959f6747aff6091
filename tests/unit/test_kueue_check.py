"""The placement admission check for Kueue (issue 48, docs/kueue.md), below the real-Kueue tests
of tests/e2e/test_kueue.py: reading Kueue's Workloads (bounded, untrusted), deciding where a
workload's pods go (state/admission), holding blocks for it (state/admitted), and the loop's
answers and the end of its holds (loops/admitting) against a fake API."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON
from neuron_scheduler.extender.loops.admitting import (
    RETRY_BASE,
    RETRY_MAX,
    Admissions,
    requeue_seconds,
)
from neuron_scheduler.extender.loops.reserving import Reservations
from neuron_scheduler.extender.state.admission import NotPlaced, Placed, place
from neuron_scheduler.extender.state.admitted import AdmittedHolds, HeldBlock
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.extender.state.workloads import KueueObjects
from neuron_scheduler.jobs.placement import Occupancy, UnitPlacement
from neuron_scheduler.kube.kueue import (
    CONTROLLER_NAME,
    WORKLOAD_UID_ANNOTATION,
    AdmissionCheck,
    KueueError,
    ResourceFlavor,
    TopologyAssignment,
    Workload,
    domains,
    readable,
)
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import neuron_request
from tests.builders import node, pod, pod_json

RING = "inf2.48xlarge"
INSTANCE = "node.kubernetes.io/instance-type"
FLAVORS = {"inf2": ({INSTANCE: RING}, [])}
CHECK = "neuron-placement"
HOST = "kubernetes.io/hostname"


def workload(
    devices: int,
    *,
    count: int = 1,
    state: str = "Pending",
    uid: str = "w1",
    topology: dict[str, Any] | None = None,
    conditions: tuple[tuple[str, str, str], ...] = (("QuotaReserved", "True", ""),),
    transition: str = "",
) -> Workload:
    """A Workload of a batch/v1 Job's pod set, as Kueue writes one once it reserved quota in
    flavor inf2."""
    template = pod_json("x", {NEURON: devices})
    assignment: dict[str, Any] = {"name": "main", "flavors": {NEURON: "inf2"}, "count": count}
    if topology is not None:
        assignment["topologyAssignment"] = topology
    body = {
        "metadata": {
            "name": "job-three-1a2b3",
            "namespace": "ml",
            "uid": uid,
            "resourceVersion": "7",
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": "three",
                    "uid": "j1",
                    "controller": True,
                }
            ],
        },
        "spec": {
            "queueName": "team",
            "podSets": [{"name": "main", "count": count, "template": {"spec": template["spec"]}}],
        },
        "status": {
            "conditions": [
                {"type": t, "status": s, "reason": r, "lastTransitionTime": transition}
                for t, s, r in conditions
            ],
            "admission": {"clusterQueue": "cq", "podSetAssignments": [assignment]},
            "admissionChecks": [
                {"name": CHECK, "state": state, "message": "", "lastTransitionTime": transition}
            ],
        },
    }
    return msgspec.convert(body, Workload)


def pinned(*hosts: str) -> dict[str, Any]:
    """Kueue's topology assignment of one pod to each host, at the hostname level (compact form:
    prefix and roots)."""
    return {
        "levels": [HOST],
        "slices": [
            {
                "domainCount": len(hosts),
                "valuesPerLevel": [{"individual": {"prefix": "inf2-", "roots": list(hosts)}}],
                "podCounts": {"universal": 1},
            }
        ],
    }


def fleet(used: dict[str, list[int]]) -> tuple[Ledger, Occupancy]:
    """inf2.48xlarge rings named inf2-<x>, each with 1-device pods bound on `used` devices."""
    ledger, occupancy = Ledger(Catalog.builtin()), Occupancy()
    nodes = [node(name, RING) for name in used]
    pods = [
        pod(f"fill-{name}-{d}", {NEURON: 1}, node=name, annotations={"AWS_NEURON_IDS": str(d)})
        for name, devices in used.items()
        for d in devices
    ]
    for view in (ledger, occupancy):
        view.replace_nodes(nodes)
        view.replace_pods(pods)
    return ledger, occupancy


HOLED = [1, 3, 5, 7, 9, 11]  # free: 0,2,4,6,8,10 (6 by count, no two in a row)


def decide(found: Workload, ledger: Ledger, occupancy: Occupancy) -> Placed | NotPlaced:
    return place(found, FLAVORS, ledger, occupancy, Policy.BEST_FIT, {"my-scheduler"})


# --- reading Kueue's objects -----------------------------------------------------------------


def test_a_topology_assignment_unfolds_prefixes_roots_and_counts() -> None:
    assignment = msgspec.convert(
        {
            "levels": ["rack", HOST],
            "slices": [
                {
                    "domainCount": 2,
                    "valuesPerLevel": [
                        {"universal": "r1"},
                        {"individual": {"prefix": "inf2-", "suffix": "-x", "roots": ["a", "b"]}},
                    ],
                    "podCounts": {"individual": [2, 1]},
                }
            ],
        },
        TopologyAssignment,
    )
    found = domains(assignment)
    assert [(d.selector, d.count) for d in found] == [
        ((("rack", "r1"), (HOST, "inf2-a-x")), 2),
        ((("rack", "r1"), (HOST, "inf2-b-x")), 1),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        {"levels": [], "slices": []},
        {"levels": [HOST], "slices": [{"domainCount": 0}]},
        {"levels": [HOST], "slices": [{"domainCount": 1, "valuesPerLevel": []}]},
        {  # two domains, one value
            "levels": [HOST],
            "slices": [
                {
                    "domainCount": 2,
                    "valuesPerLevel": [{"individual": {"roots": ["a"]}}],
                    "podCounts": {"universal": 1},
                }
            ],
        },
        {  # no count for each domain
            "levels": [HOST],
            "slices": [{"domainCount": 1, "valuesPerLevel": [{"universal": "a"}]}],
        },
        {  # more domains than the check reads
            "levels": [HOST],
            "slices": [
                {
                    "domainCount": 10_001,
                    "valuesPerLevel": [{"universal": "a"}],
                    "podCounts": {"universal": 1},
                }
            ],
        },
    ],
)
def test_a_topology_assignment_kueue_would_not_write_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(KueueError):
        domains(msgspec.convert(bad, TopologyAssignment))


def test_a_workload_beyond_kueues_bounds_is_refused_with_the_bound() -> None:
    found = workload(1)
    found.spec.podSets = found.spec.podSets * 9
    with pytest.raises(KueueError, match="9 pod sets"):
        readable(found)
    huge = workload(1, count=20_000)
    with pytest.raises(KueueError, match="10000 at most"):
        readable(huge)
    answer = decide(huge, *fleet({"inf2-a": []}))
    assert isinstance(answer, NotPlaced) and answer.never
    assert "cannot be read" in answer.reason


# --- deciding --------------------------------------------------------------------------------


def test_devices_that_fit_by_count_but_not_in_a_row_are_not_placed_and_the_reason_says_so() -> None:
    ledger, occupancy = fleet({"inf2-a": HOLED})
    answer = decide(workload(3), ledger, occupancy)
    assert isinstance(answer, NotPlaced) and not answer.never and not answer.wait
    assert answer.reason.startswith(
        "pod set main: its pod (3 devices): 3 devices fit by count on 1 node of flavor inf2, "
        "but no node has 3 contiguous devices free (inf2-a: needs 3 contiguous devices; "
        "largest free contiguous run is 1 device"
    ), answer.reason


def test_a_block_freed_is_placed_and_each_pod_of_a_set_gets_its_own() -> None:
    ledger, occupancy = fleet({"inf2-a": [3, 5, 7, 9, 11]})  # free: 0-2, 4, 6, 8, 10
    answer = decide(workload(3), ledger, occupancy)
    assert isinstance(answer, Placed), answer
    assert [(b.node, b.devices) for b in answer.blocks] == [("inf2-a", (0, 1, 2))]
    assert "pod set main: 1 pod on inf2-a devices 0-2" in answer.text
    # Two pods of 2 devices: one run of 3 takes only one of them.
    two = decide(workload(2, count=2), ledger, occupancy)
    assert isinstance(two, NotPlaced)
    assert "1 of its 2 pods" in two.reason, two.reason


def test_a_topology_assignment_pinning_a_pod_where_no_block_is_is_not_placed() -> None:
    """Kueue's TAS at the hostname level ties on counts and picks inf2-a (first by name), whose
    6 free devices are single; inf2-b has a block. Pinned to inf2-a the check says no, naming
    the domain; without the pin it places the pod on inf2-b."""
    ledger, occupancy = fleet({"inf2-a": HOLED, "inf2-b": [6, 7, 8, 9, 10, 11]})
    answer = decide(workload(3, topology=pinned("a")), ledger, occupancy)
    assert isinstance(answer, NotPlaced), answer
    assert "the domain Kueue's topology assignment pins 1 to (kubernetes.io/hostname=inf2-a)" in (
        answer.reason
    ), answer.reason
    free = decide(workload(3), ledger, occupancy)
    assert isinstance(free, Placed) and [b.node for b in free.blocks] == ["inf2-b"]
    there = decide(workload(3, topology=pinned("b")), ledger, occupancy)
    assert isinstance(there, Placed) and [b.node for b in there.blocks] == ["inf2-b"]


def test_no_quota_reserved_or_an_unknown_flavor_waits() -> None:
    ledger, occupancy = fleet({"inf2-a": []})
    found = workload(1)
    found.status.admission = None
    answer = decide(found, ledger, occupancy)
    assert isinstance(answer, NotPlaced) and answer.wait
    other = workload(1)
    other.status.admission.podSetAssignments[0].flavors = {NEURON: "trn9"}  # type: ignore[union-attr]
    answer = decide(other, ledger, occupancy)
    assert isinstance(answer, NotPlaced) and answer.wait and "trn9" in answer.reason


# --- holding -----------------------------------------------------------------------------------


def pod_of_workload(name: str, devices: int, uid: str, **kwargs: Any) -> Pod:
    return pod(
        name,
        {NEURON: devices},
        namespace="ml",
        annotations={WORKLOAD_UID_ANNOTATION: uid, **kwargs.pop("annotations", {})},
        **kwargs,
    )


def test_a_held_block_is_the_workloads_own_whatever_the_priority_of_others() -> None:
    ledger, occupancy = fleet({"inf2-a": [3, 5, 7, 9, 11]})
    answer = decide(workload(3), ledger, occupancy)
    assert isinstance(answer, Placed)
    holds = AdmittedHolds(ledger)
    block = answer.blocks[0]
    holds.hold(
        "w1", "ml/job-three", "ml", [HeldBlock(block.node, block.request, block.cores)], 1, 1e12
    )
    urgent = pod("urgent", {NEURON: 3}, namespace="ml")
    urgent.spec.priority = 10**9
    theirs = ledger.state_for(Claimant.of(urgent, neuron_request(urgent)), "inf2-a")
    assert theirs.used_cores & block.cores == block.cores  # taken, for them
    mine = pod_of_workload("three-x", 3, "w1")
    own = ledger.state_for(Claimant.of(mine, neuron_request(mine)), "inf2-a")
    assert own.used_cores & block.cores == 0  # free, for the workload's pod
    other_namespace = pod("three-y", {NEURON: 3}, annotations={WORKLOAD_UID_ANNOTATION: "w1"})
    seen = ledger.state_for(Claimant.of(other_namespace, neuron_request(other_namespace)), "inf2-a")
    assert seen.used_cores & block.cores == block.cores  # a uid names a workload of its namespace
    # Once the workload's pod binds there, the hold ends: its own ids hold the devices.
    bound = pod_of_workload(
        "three-x", 3, "w1", node="inf2-a", annotations={"AWS_NEURON_IDS": "0,1,2"}
    )
    ledger.apply_pod(bound)
    holds.apply_pod(bound)
    assert not holds.admitted["w1"].blocks and holds.came(holds.admitted["w1"].owner) == 1


# --- the loop ------------------------------------------------------------------------------------


class FakeKueue:
    """What the loop writes: its check states and AdmissionCheck conditions."""

    def __init__(self) -> None:
        self.states: list[tuple[str, dict[str, Any]]] = []  # (workload uid, entry)
        self.active: list[str] = []

    async def apply_check_state(
        self, namespace: str, name: str, uid: str, resource_version: str, state: dict[str, Any]
    ) -> None:
        self.states.append((uid, state))

    async def apply_check_condition(self, name: str, condition: dict[str, Any]) -> None:
        self.active.append(name)


class Loop:
    def __init__(self, used: dict[str, list[int]]) -> None:
        self.now = 1_767_312_000.0
        self.api = FakeKueue()
        self.ledger, self.occupancy = fleet(used)
        self.objects = KueueObjects()
        self.objects.replace_checks(
            [
                msgspec.convert(
                    {"metadata": {"name": CHECK}, "spec": {"controllerName": CONTROLLER_NAME}},
                    AdmissionCheck,
                )
            ]
        )
        self.objects.replace_flavors(
            [
                msgspec.convert(
                    {"metadata": {"name": "inf2"}, "spec": {"nodeLabels": {INSTANCE: RING}}},
                    ResourceFlavor,
                )
            ]
        )
        self.holds = AdmittedHolds(self.ledger)
        reservations = Reservations(
            self.api,  # type: ignore[arg-type]  # (no training job here: no claim is written)
            self.occupancy,
            UnitPlacement(self.occupancy),
            self.ledger,
            ["my-scheduler"],
            60,
            wall_clock=lambda: self.now,
        )
        self.loop = Admissions(
            self.api,
            self.objects,
            self.holds,
            self.ledger,
            self.occupancy,
            reservations,
            ["my-scheduler"],
            hold_seconds=30,
            wall_clock=lambda: self.now,
        )

    def step(self) -> None:
        asyncio.run(self.loop.step())

    def last(self) -> dict[str, Any]:
        return self.api.states[-1][1]


def test_the_loop_retries_with_the_reason_then_holds_and_makes_ready_when_a_block_frees() -> None:
    world = Loop({"inf2-a": HOLED})
    world.objects.apply_workload(workload(3))
    world.step()
    assert world.api.active == [CHECK]
    entry = world.last()
    assert entry["state"] == "Retry" and entry["requeueAfterSeconds"] == RETRY_BASE
    assert "no node has 3 contiguous devices free" in entry["message"]
    assert not world.holds.admitted
    # Kueue requeues it (Pending again); device 1 has left meanwhile: 0-2 are free.
    world.ledger.replace_pods(
        [
            pod(f"fill-{d}", {NEURON: 1}, node="inf2-a", annotations={"AWS_NEURON_IDS": str(d)})
            for d in HOLED[1:]
        ]
    )
    world.objects.apply_workload(workload(3))
    world.step()
    entry = world.last()
    assert entry["state"] == "Ready", entry
    assert entry["podSetUpdates"] == [
        {"name": "main", "annotations": {WORKLOAD_UID_ANNOTATION: "w1"}}
    ]
    assert "pod set main: 1 pod on inf2-a devices 0-2" in entry["message"]
    (held,) = world.holds.admitted["w1"].blocks.values()
    assert held.node == "inf2-a"


def test_holds_end_and_the_check_retries_when_the_pods_do_not_come_in_time() -> None:
    world = Loop({"inf2-a": []})
    world.objects.apply_workload(workload(3))
    world.step()
    assert world.last()["state"] == "Ready"
    ready = workload(3, state="Ready", transition="2026-01-02T00:00:00Z")
    world.objects.apply_workload(ready)
    world.now += 29
    world.step()
    assert "w1" in world.holds.admitted and world.last()["state"] == "Ready"
    world.now += 2
    world.step()
    assert "w1" not in world.holds.admitted
    entry = world.last()
    assert entry["state"] == "Retry", entry
    assert "did not all bind within 30s of its admission (0 of 1 bound)" in entry["message"]
    taken = ledger_free(world.ledger)
    assert taken == 0  # nothing held any more


def test_an_evicted_workload_lets_go_at_once() -> None:
    world = Loop({"inf2-a": []})
    world.objects.apply_workload(workload(3))
    world.step()
    assert "w1" in world.holds.admitted and ledger_free(world.ledger) != 0
    evicted = workload(
        3,
        state="Ready",
        conditions=(("QuotaReserved", "True", ""), ("Evicted", "True", "Preempted")),
    )
    world.objects.apply_workload(evicted)
    world.step()
    assert "w1" not in world.holds.admitted and ledger_free(world.ledger) == 0


def ledger_free(ledger: Ledger) -> int:
    """The cores held on inf2-a for anyone (as a pod of no workload sees them)."""
    outsider = pod("outsider", {NEURON: 1})
    return ledger.state_for(Claimant.of(outsider, neuron_request(outsider)), "inf2-a").used_cores


def test_requeue_grows_with_retries_and_is_longest_for_what_can_never_run() -> None:
    assert [requeue_seconds(n, False) for n in (None, 0, 1, 2, 3, 9)] == [5, 5, 10, 20, 40, 60]
    assert requeue_seconds(0, True) == RETRY_MAX


def test_a_new_leader_holds_again_for_a_ready_workload_whose_pods_have_not_come() -> None:
    """The leader that made it Ready is gone (its holds were in its memory only): the next one
    plans the blocks anew and holds them until the time the check's Ready leaves; past that
    time it holds nothing and lets the time run out (Retry)."""
    world = Loop({"inf2-a": [3, 5, 7, 9, 11]})
    ready = workload(3, state="Ready", transition="2026-01-02T00:00:00Z")  # = world.now
    world.objects.apply_workload(ready)
    world.now += 10
    world.step()
    admitted = world.holds.admitted["w1"]
    assert admitted.until == 1_767_312_000.0 + 30
    assert [(b.node, b.cores) for b in admitted.blocks.values()] == [("inf2-a", 0b111111)]
    assert not world.api.states  # nothing written: it is Ready already
    late = Loop({"inf2-a": []})
    late.objects.apply_workload(ready)
    late.now += 40
    late.step()  # its pods' time only is tended ...
    assert not late.api.states and not late.holds.admitted["w1"].blocks
    late.step()  # ... and it has run out
    assert (
        late.last()["state"] == "Retry" and "did not all bind within 30s" in late.last()["message"]
    )
    assert "w1" not in late.holds.admitted and ledger_free(late.ledger) == 0
