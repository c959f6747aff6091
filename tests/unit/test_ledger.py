from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest

from neuron_scheduler.core.allocation import NodeState, Placement, Policy, allocate
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import mask_ids
from neuron_scheduler.core.resources import NEURON as DEV
from neuron_scheduler.core.resources import NEURONCORE as CORE
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.ledger import ANNOUNCED_SECONDS, Claimant, Ledger
from neuron_scheduler.kube.reading import SidecarRequest, neuron_request
from tests.builders import node, pod


def ours(node_name: str, cores: str, devs: str, ids: str, resource: str = CORE) -> dict[str, str]:
    return {
        "AWS_NEURON_IDS": ids,
        "NEURON_RESOURCE_TYPE": resource,
        "NEURON_CORES": cores,
        "NEURON_DEVS": devs,
        "NEURON_NODE": node_name,
        "NEURON_ALLOCATED": "false",
    }


def mask(*ids: int) -> int:
    return sum(1 << i for i in ids)


def reserve(ledger: Ledger, uid: str, node_name: str, cores: int) -> None:
    """An in-flight bind of pod `uid` holding these cores on the node."""
    ids = tuple(mask_ids(cores))
    ledger.reserve(pod(uid, {CORE: len(ids)}, uid=uid), node_name, Placement((), ids, 10))


def ledger_with(*objects: object) -> Ledger:
    ledger = Ledger(Catalog.builtin())
    ledger.replace_nodes([node("n1", "inf1.6xlarge"), node("t1", "trn1.32xlarge")])
    return ledger


def test_bound_pod_with_our_annotations_holds_exactly_its_cores() -> None:
    ledger = ledger_with()
    ledger.apply_pod(pod("a", {CORE: 2}, node="n1", annotations=ours("n1", "2,3", "0", "2,3")))
    assert ledger.state("n1") == NodeState(mask(2, 3), 0)


def test_unbound_pending_and_finished_pods_hold_nothing() -> None:
    ledger = ledger_with()
    ledger.apply_pod(pod("pending", {CORE: 2}, annotations=ours("n1", "0,1", "0", "0,1")))
    ledger.apply_pod(
        pod(
            "done",
            {CORE: 2},
            node="n1",
            phase="Succeeded",
            annotations=ours("n1", "4,5", "1", "4,5"),
        )
    )
    assert ledger.state("n1") == NodeState()


def test_finishing_frees_at_once() -> None:
    ledger = ledger_with()
    running = pod("a", {DEV: 1}, node="t1", uid="u1", annotations=ours("t1", "0,1", "0", "0", DEV))
    ledger.apply_pod(running)
    assert ledger.state("t1").used_cores == mask(0, 1)
    running.status.phase = "Failed"
    ledger.apply_pod(running)
    assert ledger.state("t1") == NodeState()


def test_annotations_for_another_node_do_not_count_there() -> None:
    ledger = ledger_with()
    # Annotated for n1 but bound to t1 (a bind that failed and a later one elsewhere):
    # the ids are meaningless on t1, so its size counts with unknown ids.
    ledger.apply_pod(pod("a", {CORE: 2}, node="t1", annotations=ours("n1", "0,1", "0", "0,1")))
    assert ledger.state("n1") == NodeState()
    assert ledger.state("t1") == NodeState(0, 2)


def test_pods_from_another_scheduler_count_by_size() -> None:
    ledger = ledger_with()
    ledger.apply_pod(pod("other", {DEV: 2}, node="t1"))
    assert ledger.state("t1") == NodeState(0, 4)  # 2 devices x 2 cores, ids unknown


def test_pods_without_neuron_requests_never_count() -> None:
    ledger = ledger_with()
    ledger.apply_pod(pod("device-plugin", {"cpu": 1}, node="n1"))
    assert ledger.state("n1") == NodeState()
    assert ledger.pod_count == 0


def test_withheld_capacity_counts_as_unknown() -> None:
    ledger = Ledger(Catalog.builtin())
    ledger.apply_node(node("n1", "inf1.6xlarge", allocatable_cores=12))
    assert ledger.state("n1") == NodeState(0, 4)


def test_upstream_annotations_without_node_key_are_trusted() -> None:
    ledger = ledger_with()
    ledger.apply_pod(pod("up", {DEV: 2}, node="t1", annotations={"AWS_NEURON_IDS": "4,5"}))
    assert ledger.state("t1").used_cores == mask(8, 9, 10, 11)


def test_unreadable_annotations_count_by_size() -> None:
    ledger = ledger_with()
    ledger.apply_pod(pod("bad", {CORE: 3}, node="n1", annotations={"AWS_NEURON_IDS": "x,y"}))
    assert ledger.state("n1") == NodeState(0, 3)


def test_reservation_holds_until_the_watch_shows_the_binding() -> None:
    ledger = ledger_with()
    reserve(ledger, "u9", "n1", mask(0, 1, 2))
    assert ledger.state("n1").used_cores == mask(0, 1, 2)
    # A stale event from before the bind (still unbound) must not drop the reservation.
    ledger.apply_pod(pod("a", {CORE: 3}, uid="u9"))
    assert ledger.state("n1").used_cores == mask(0, 1, 2)
    ledger.apply_pod(
        pod("a", {CORE: 3}, uid="u9", node="n1", annotations=ours("n1", "0,1,2", "0", "0,1,2"))
    )
    assert ledger.reservation("u9") is None
    assert ledger.state("n1").used_cores == mask(0, 1, 2)
    ledger.remove_pod("u9")
    assert ledger.state("n1") == NodeState()


def test_relist_lets_go_of_a_reservation_whose_pod_was_deleted_meanwhile() -> None:
    """A bind succeeded while the pod watch was down, and the pod was deleted before the watch
    came back: no event will ever release the reservation, so the re-list must (issue 15's API
    faults test leaked devices this way). One made after the list was asked for stays."""
    now = [100.0]
    ledger = Ledger(Catalog.builtin(), clock=lambda: now[0])
    ledger.replace_nodes([node("n1", "inf1.6xlarge")])
    reserve(ledger, "gone", "n1", mask(0, 1))
    now[0] = 101.0
    reserve(ledger, "newer", "n1", mask(4, 5))  # its pod may be newer than the list
    ledger.replace_pods([], listed_since=100.5)
    assert ledger.reservation("gone") is None
    assert ledger.reservation("newer") is not None
    assert ledger.state("n1").used_cores == mask(4, 5)
    # A pending pod that is in the list keeps its reservation (its bind is still going on).
    ledger.replace_pods([pod("newer", {CORE: 2}, uid="newer")], listed_since=102.0)
    assert ledger.state("n1").used_cores == mask(4, 5)


def test_a_pod_set_on_a_node_with_ids_of_a_bind_in_flight_counts_by_its_request() -> None:
    """A bind's ids are on its pending pod before its Binding lands (announced), and a bind of
    this extender holds them from the start (reserved): a pod set on the node by its creator with
    those ids is not counted as the same cores, then or once the pending pod is bound."""
    now = [1000.0]
    ledger = Ledger(Catalog.builtin(), wall_clock=lambda: now[0])
    ledger.replace_nodes([node("n1", "inf1.6xlarge")])
    written = ours("n1", "4,5", "1", "4,5") | {"NEURON_ALLOC_TIME": str(int(990e9))}
    copy = pod("copy", {CORE: 2}, uid="copy", node="n1", annotations=written)
    ledger.apply_pod(pod("a", {CORE: 2}, uid="a", annotations=written))  # announced
    ledger.apply_pod(copy)
    assert ledger.set_aside("n1") == {"copy"}
    assert ledger.state("n1") == NodeState(mask(4, 5), 2)
    ledger.apply_pod(pod("a", {CORE: 2}, uid="a", node="n1", annotations=written))  # bound
    assert ledger.state("n1") == NodeState(mask(4, 5), 2)
    # The same for a bind of this extender's own, before the pod shows its ids.
    ledger = Ledger(Catalog.builtin(), wall_clock=lambda: now[0])
    ledger.replace_nodes([node("n1", "inf1.6xlarge")])
    placement = Placement((1,), (4, 5), 0)
    ledger.reserve(pod("b", {CORE: 2}, uid="b"), "n1", placement)
    ledger.apply_pod(copy)
    assert ledger.state("n1") == NodeState(mask(4, 5), 2)
    # A pod's own ids and its own bind in flight are one holding.
    ledger.remove_pod("copy")
    ledger.apply_pod(pod("b", {CORE: 2}, uid="b", node="n1", annotations=written))
    assert ledger.set_aside("n1") == frozenset()
    assert ledger.state("n1") == NodeState(mask(4, 5), 0)


def test_ids_a_bind_wrote_on_a_pending_pod_stay_held_until_its_binding_can_no_longer_land() -> None:
    """The extender wrote a pod's ids, sent its Binding and was killed (or gave up waiting); the
    Binding may still land. Until it can no longer (or the ids are removed, or the pod is bound
    or deleted), no other pod gets those ids; the pod itself may (issue 15's API faults test
    bound two pods to one core this way)."""
    now = [1000.0]
    ledger = Ledger(Catalog.builtin(), wall_clock=lambda: now[0])
    ledger.replace_nodes([node("n1", "inf1.6xlarge")])
    written = ours("n1", "4,5", "1", "4,5") | {"NEURON_ALLOC_TIME": str(int(990e9))}
    pending = pod("a", {CORE: 2}, uid="a", annotations=written)
    ledger.apply_pod(pending)
    assert ledger.state("n1").used_cores == mask(4, 5)
    assert ledger.state_for(Claimant.of(pending), "n1").used_cores == 0
    # Ids for another node, or stale ones, hold nothing.
    ledger.apply_pod(pod("b", {CORE: 1}, uid="b", annotations=written | {"NEURON_NODE": "x"}))
    assert ledger.state("n1").used_cores == mask(4, 5)
    # Bound: the pod's own holding takes over; unbound again without ids: nothing held.
    ledger.apply_pod(pod("a", {CORE: 2}, uid="a", node="n1", annotations=written))
    assert ledger.state("n1").used_cores == mask(4, 5)
    ledger.apply_pod(pending)
    assert ledger.state("n1").used_cores == mask(4, 5)
    ledger.apply_pod(pod("a", {CORE: 2}, uid="a"))
    assert ledger.state("n1").used_cores == 0
    # Held for ANNOUNCED_SECONDS after they were written, then let go, even with no event.
    ledger.apply_pod(pending)
    now[0] = 990 + ANNOUNCED_SECONDS - 1
    verdicts = ledger.fill_verdicts(["n1"], NeuronRequest(CORE, 15), Policy.BEST_FIT)
    assert "n1" not in verdicts.fitting()
    now[0] = 990 + ANNOUNCED_SECONDS
    verdicts = ledger.fill_verdicts(["n1"], NeuronRequest(CORE, 15), Policy.BEST_FIT)
    assert "n1" in verdicts.fitting()
    assert ledger.state("n1").used_cores == 0


def test_ids_beyond_what_a_pod_requests_hold_nothing_beyond_its_request() -> None:
    """Anyone allowed to create pods can write our annotations. A pod set on a node by its
    creator, asking for one core, names all 16 of an inf1.6xlarge: its ids are not used (a
    warning event says why) and it holds its one core by count, not the node. A device request
    naming two devices alike. Ids of the pod's own size still hold exactly those."""
    reports: list[tuple[str, str]] = []
    ledger = Ledger(
        Catalog.builtin(),
        report=lambda ref, reason, message, *_, **__: reports.append((reason, message)),
    )
    ledger.replace_nodes([node("n1", "inf1.6xlarge")])
    every_core = ",".join(map(str, range(16)))
    ledger.apply_pod(
        pod(
            "grab",
            {CORE: 1},
            uid="g",
            node="n1",
            annotations=ours("n1", every_core, "0,1,2,3", every_core),
        )
    )
    assert ledger.state("n1") == NodeState(0, 1)
    assert reports == [
        (
            "NeuronAnnotationsRejected",
            "Neuron ids in the annotations are not used: ids for 16 cores, more than the pod's "
            "1 core (aws.amazon.com/neuroncore); the pod's 1 core (aws.amazon.com/neuroncore) "
            "stays held on n1 until it ends",
        )
    ]
    ledger.apply_pod(
        pod(
            "two",
            {DEV: 1},
            uid="d",
            node="n1",
            annotations=ours("n1", "4,5,6,7,8,9,10,11", "1,2", "1,2", DEV),
        )
    )
    assert ledger.state("n1") == NodeState(0, 1 + 4)
    ledger.apply_pod(
        pod("fair", {CORE: 2}, uid="f", node="n1", annotations=ours("n1", "12,13", "3", "12,13"))
    )
    assert ledger.state("n1") == NodeState(mask(12, 13), 1 + 4)
    # An init container asking for more than the app containers: the pod's request is its.
    ledger.apply_pod(
        pod(
            "init",
            {CORE: 1},
            uid="i",
            node="n1",
            init_limits=[{CORE: 2}],
            annotations=ours("n1", "14,15", "3", "14,15"),
        )
    )
    assert ledger.state("n1") == NodeState(mask(12, 13, 14, 15), 1 + 4)


def test_a_device_pod_naming_part_of_its_device_counts_the_device() -> None:
    """Its containers are handed the whole device: ids naming device 0 with one of its four
    cores would leave three to others. Rejected; the pod counts its device by count."""
    ledger = ledger_with()
    ledger.apply_pod(
        pod("part", {DEV: 1}, uid="p", node="n1", annotations=ours("n1", "0", "0", "0", DEV))
    )
    assert ledger.state("n1") == NodeState(0, 4)


def test_ids_on_a_pending_pod_hold_only_what_it_requests() -> None:
    """Ids a bind wrote on a pending pod are held until its Binding can no longer land (above);
    our bind writes them only on a pod asking for that much. A pending pod asking for no Neuron
    resource, or for less than its ids, holds nothing: otherwise any pod, of a scheduler nobody
    runs, could keep a node's devices from everyone by writing a fresh NEURON_ALLOC_TIME. A time
    to come holds from when it is read, not until then."""
    now = [1000.0]
    ledger = Ledger(Catalog.builtin(), wall_clock=lambda: now[0])
    ledger.replace_nodes([node("n1", "inf1.6xlarge")])
    every_core = ",".join(map(str, range(16)))
    written = ours("n1", every_core, "0,1,2,3", "0,1,2,3", DEV)
    fresh = written | {"NEURON_ALLOC_TIME": str(int(995e9))}
    for name, limits in (
        ("none", {}),
        ("less", {DEV: 1}),
        ("cpu", {"cpu": 1}),
        ("cores", {CORE: 16}),
    ):
        ledger.apply_pod(pod(name, limits, uid=name, scheduler="nobody", annotations=fresh))
        assert ledger.state("n1") == NodeState(0, 0), name
        ledger.remove_pod(name)
    ledger.apply_pod(pod("whole", {DEV: 4}, uid="w", scheduler="nobody", annotations=fresh))
    assert ledger.state("n1") == NodeState(mask(*range(16)), 0)
    ledger.remove_pod("w")
    later = written | {"NEURON_ALLOC_TIME": "99999999999999999999"}
    ledger.apply_pod(pod("later", {DEV: 4}, uid="l", scheduler="nobody", annotations=later))
    now[0] = 1000 + ANNOUNCED_SECONDS - 1
    assert ledger.state("n1") == NodeState(mask(*range(16)), 0)
    now[0] = 1000 + ANNOUNCED_SECONDS
    assert ledger.state("n1") == NodeState(0, 0)


def test_disowned_ids_on_a_pending_pod_hold_nothing() -> None:
    """A failed bind knows its Binding can no longer land but could not remove its annotations:
    the devices are free at once, whatever versions of the pod the watch still delivers, until a
    later bind writes other ids."""
    ledger = ledger_with()
    written = ours("n1", "4,5", "1", "4,5") | {"NEURON_ALLOC_TIME": str(time.time_ns())}
    pending = pod("a", {CORE: 2}, uid="a", annotations=written)
    ledger.apply_pod(pending)
    assert ledger.state("n1").used_cores == mask(4, 5)
    ledger.disown(pending, str(time.time_ns()))  # another bind's ids: these still hold
    assert ledger.state("n1").used_cores == mask(4, 5)
    ledger.disown(pending, written["NEURON_ALLOC_TIME"])
    assert ledger.state("n1").used_cores == 0
    ledger.apply_pod(pod("a", {CORE: 2}, uid="a"))  # the version before the annotations
    ledger.apply_pod(pending)
    assert ledger.state("n1").used_cores == 0
    later = written | {"NEURON_ALLOC_TIME": str(time.time_ns() + 1)}
    ledger.apply_pod(pod("a", {CORE: 2}, uid="a", annotations=later))
    assert ledger.state("n1").used_cores == mask(4, 5)
    ledger.remove_pod("a")
    assert not ledger._disowned


def test_relist_diff_forgets_deleted_pods_and_rebuilds_identically() -> None:
    pods = [
        pod("a", {CORE: 2}, node="n1", uid="a", annotations=ours("n1", "0,1", "0", "0,1")),
        pod(
            "b",
            {DEV: 4},
            node="t1",
            uid="b",
            annotations=ours("t1", "0,1,2,3,4,5,6,7", "0,1,2,3", "0,1,2,3", DEV),
        ),
        pod("c", {DEV: 1}, node="t1", uid="c"),
    ]
    first = ledger_with()
    first.replace_pods(pods)
    # A re-list after missed events: pod a is gone.
    first.replace_pods(pods[1:])
    assert first.state("n1") == NodeState()
    # A restarted extender listing the same pods reaches the same state.
    second = ledger_with()
    second.replace_pods(pods[1:])
    for name in ("n1", "t1"):
        assert first.state(name) == second.state(name)


def test_node_removed_and_relisted() -> None:
    ledger = ledger_with()
    ledger.replace_nodes([node("n1", "inf1.6xlarge")])
    assert set(ledger.nodes) == {"n1"}
    ledger.apply_node(node("cpu-only", "m5.large"))
    assert "cpu-only" not in ledger.nodes


def test_kept_decisions_follow_every_change_to_their_node() -> None:
    """fill_verdicts() keeps decisions per node; each way a node's state changes must drop them."""
    ledger = ledger_with()
    four_devices = NeuronRequest(DEV, 4)

    def fits() -> set[str]:
        return set(
            ledger.fill_verdicts(["n1", "t1", "unknown"], four_devices, Policy.BEST_FIT).fitting()
        )

    assert fits() == {"n1", "t1"}
    # A bound pod with our annotations.
    taken = pod("a", {CORE: 1}, node="n1", uid="u1", annotations=ours("n1", "0", "0", "0"))
    ledger.apply_pod(taken)
    assert fits() == {"t1"}
    ledger.remove_pod("u1")
    assert fits() == {"n1", "t1"}
    # An in-flight bind, then its release.
    reserve(ledger, "u2", "n1", mask(15))
    assert fits() == {"t1"}
    ledger.unreserve(pod("b", {CORE: 1}, uid="u2"), "t1")  # a hold elsewhere: not this one
    assert fits() == {"t1"}
    ledger.unreserve(pod("b", {CORE: 1}, uid="u2"), "n1")
    assert fits() == {"n1", "t1"}
    # A pod placed by another scheduler, counted by size.
    ledger.apply_pod(pod("c", {DEV: 16}, node="t1", uid="u3"))
    assert fits() == {"n1"}
    # The node itself changes: gone, then back.
    ledger.remove_pod("u3")
    ledger.replace_nodes([node("t1", "trn1.32xlarge")])
    assert fits() == {"t1"}
    ledger.replace_nodes([node("n1", "inf1.6xlarge"), node("t1", "trn1.32xlarge")])
    assert fits() == {"n1", "t1"}
    assert (
        "unknown" not in ledger.fill_verdicts(["unknown"], four_devices, Policy.BEST_FIT).decisions
    )


def test_kept_decisions_agree_with_a_fresh_decision() -> None:
    ledger = ledger_with()
    ledger.apply_pod(pod("a", {CORE: 3}, node="n1", annotations=ours("n1", "4,5,6", "1", "4,5,6")))
    for count in (1, 2, 4, 9):
        request = NeuronRequest(CORE, count)
        verdicts = ledger.fill_verdicts(["n1"], request, Policy.BEST_FIT)
        topology = ledger.nodes["n1"].topology
        fresh = allocate(
            topology, ledger.state("n1"), request, Policy.BEST_FIT, ledger.demand.weights
        )
        assert verdicts.decisions["n1"] == fresh
        assert verdicts.score("n1") == (fresh.score if isinstance(fresh, Placement) else 0)


def test_what_pods_ask_for_is_counted_once_and_exported() -> None:
    ledger = ledger_with()
    metrics = Metrics(ledger)
    for i in range(3):
        ledger.apply_pod(pod(f"c{i}", {CORE: 2}, uid=f"c{i}"))
    ledger.apply_pod(pod("d", {DEV: 8}, uid="d"))
    ledger.apply_pod(pod("d", {DEV: 8}, uid="d"))  # the same pod again: counted once
    text = generate_latest(metrics.registry).decode()
    weights = {
        line.split("{")[1].split("}")[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("neuron_scheduler_demand_weight{")
    }
    # 3 to 1 (the newest a little heavier: older asks decay); counted twice, it would be 3 to 2.
    assert set(weights) == {'count="2",unit="core"', 'count="8",unit="device"'}
    assert abs(weights['count="8",unit="device"'] - 256) <= 3
    assert abs(weights['count="2",unit="core"'] - 768) <= 3
    assert f"neuron_scheduler_demand_snapshots_total {float(ledger.demand.version)}" in text
    assert ledger.demand.version >= 2  # the first pod, then the new shape at a quarter


def test_decisions_computed_are_counted_and_exported() -> None:
    """Kept decisions are not computed again: the count says how often filter had to."""
    ledger = ledger_with()
    metrics = Metrics(ledger)
    four_cores = NeuronRequest(CORE, 4)
    ledger.fill_verdicts(["n1", "t1", "unknown"], four_cores, Policy.BEST_FIT)
    assert ledger.decisions == 2  # a node the cache does not know is not decided here
    ledger.fill_verdicts(["n1", "t1"], four_cores, Policy.BEST_FIT)
    assert ledger.decisions == 2
    reserve(ledger, "u1", "n1", mask(0))  # n1 changed: its decision goes
    ledger.fill_verdicts(["n1", "t1"], four_cores, Policy.BEST_FIT)
    assert ledger.decisions == 3
    text = generate_latest(metrics.registry).decode()
    assert "neuron_scheduler_decisions_total 3.0" in text


def test_decisions_stand_while_a_bind_shows_the_same_cores_again() -> None:
    """A bind holds its cores (the reservation); the watch then shows them twice more (the
    pod's announced ids, then the pod bound with them). The node's state does not change again,
    so its kept decisions are not computed again; a change of cores, or of the node, drops them
    (issue 50)."""
    ledger = ledger_with()
    ledger.demand.record(NeuronRequest(CORE, 4).unit, 4)  # decided by demand, as in a cluster
    ledger.apply_pod(pod("a", {CORE: 2}, uid="u1"))  # seen pending first: its ask is counted
    ledger.apply_pod(pod("b", {CORE: 1}, uid="u2"))
    four_cores = NeuronRequest(CORE, 4)

    def decide() -> int:
        before = ledger.decisions
        verdicts = ledger.fill_verdicts(["n1"], four_cores, Policy.BEST_FIT)
        topology = ledger.nodes["n1"].topology
        fresh = allocate(
            topology, ledger.state("n1"), four_cores, Policy.BEST_FIT, ledger.demand.weights
        )
        assert verdicts.decisions["n1"] == fresh  # kept or not, never stale
        return ledger.decisions - before

    assert decide() == 1
    reserve(ledger, "u1", "n1", mask(0, 1))
    assert decide() == 1  # the cores in use changed
    written = ours("n1", "0,1", "0", "0,1") | {"NEURON_ALLOC_TIME": str(time.time_ns())}
    ledger.apply_pod(pod("a", {CORE: 2}, uid="u1", annotations=written))  # announced
    assert decide() == 0
    ledger.apply_pod(pod("a", {CORE: 2}, uid="u1", node="n1", annotations=written))  # bound
    assert ledger.reservation("u1") is None
    assert decide() == 0
    ledger.apply_pod(
        pod("b", {CORE: 1}, uid="u2", node="n1", annotations=ours("n1", "8", "2", "8"))
    )
    assert decide() == 1
    ledger.replace_nodes([node("n1", "inf1.24xlarge"), node("t1", "trn1.32xlarge")])
    assert decide() == 1  # another node under the same name: decided afresh
    ledger.remove_pod("u1")
    assert decide() == 1


def test_a_pod_with_a_neuron_sidecar_placed_anyway_counts_what_kubelet_gave_it() -> None:
    """A sidecar (restartPolicy: Always) asking for Neuron resources is never placed by us (filter
    refuses it), but one bound by another scheduler, or before, holds its sidecar's devices
    beside the app containers': counted as kube-scheduler and kubelet count it, not dropped."""
    ledger = ledger_with()
    sidecar = pod("side", {DEV: 1}, uid="s", node="n1", init_limits=[{DEV: 1}, {DEV: 2}])
    sidecar.spec.initContainers[0].restartPolicy = "Always"
    ledger.apply_pod(sidecar)
    # max(app 1 + sidecar 1, sidecar 1 + the regular init container's 2) = 3 devices.
    assert ledger.state("n1") == NodeState(0, 3 * 4)
    with pytest.raises(SidecarRequest, match="init container 'init0' is a sidecar"):
        neuron_request(sidecar)
    # Ids a bind wrote before sidecars were refused, sized as if the sidecar's device were
    # reused (2 devices where kubelet holds 3): the pod counts by its size, not by them.
    bound = pod(
        "side2",
        {DEV: 1},
        uid="s2",
        node="n1",
        init_limits=[{DEV: 1}, {DEV: 2}],
        annotations=ours("n1", "4,5,6,7,8,9,10,11", "1,2", "1,2", DEV),
    )
    bound.spec.initContainers[0].restartPolicy = "Always"
    ledger.remove_pod("s")
    ledger.apply_pod(bound)
    assert ledger.state("n1") == NodeState(0, 3 * 4)
