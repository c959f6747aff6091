"""Consolidation's controller (extender/loops/consolidating) on a ledger fed as the watches feed it
and a fake API: when it acts, what it writes and in which order, its holds, its bounds, and what
a restart leaves."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from neuron_scheduler.core import planrecord
from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import comma_ids, cores_of_devices
from neuron_scheduler.core.resources import NEURON, NeuronRequest
from neuron_scheduler.extender.loops.consolidating import (
    Concluded,
    Consolidator,
    Limits,
    Mode,
    evicted_event_name,
)
from neuron_scheduler.extender.loops.evictionbudget import EvictionBudget
from neuron_scheduler.extender.state.budgets import DisruptionBudgets
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.extender.state.movability import Movability
from neuron_scheduler.extender.state.pending import PendingPods
from neuron_scheduler.extender.state.plans import Plans
from neuron_scheduler.extender.state.plugins import NodeFilter
from neuron_scheduler.jobs.claims import PENDING, NodeClaim
from neuron_scheduler.jobs.placement import Occupancy, UnitPlacement
from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.objects import Lease, ObjectRef, Pod, PodDisruptionBudget
from neuron_scheduler.kube.reading import KUEUE_ADMISSION_GATE
from tests.builders import node, pod_json

CATALOG = Catalog.builtin()
TRN1 = CATALOG.resolve("trn1.32xlarge").topology
NOW = 1_800_000_000.0
CREATED = "2027-01-15T08:00:00Z"  # NOW is 2027-01-15T08:00:00Z


class Clock:
    def __init__(self) -> None:
        self.now = NOW + 60

    def __call__(self) -> float:
        return self.now


class FakeAPI:
    """Records the writes consolidation makes; `refuse` names pods whose eviction gets 429."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.refuse: set[str] = set()
        self.leases: dict[str, Lease] = {}
        self.versions = 0

    async def patch_annotations(
        self,
        namespace: str,
        name: str,
        uid: str,
        values: dict[str, str | None],
        *,
        resource_version: str | None = None,
    ) -> str:
        await asyncio.sleep(0)
        for key, value in values.items():
            self.calls.append(("annotate", name, key, "remove" if value is None else "set"))
        return "1"

    async def patch_nominated_node(self, namespace: str, name: str, uid: str, node: str) -> None:
        await asyncio.sleep(0)
        self.calls.append(("nominate", name, node))

    async def evict(self, namespace: str, name: str, uid: str) -> None:
        await asyncio.sleep(0)
        if name in self.refuse:
            raise api_error(
                "POST",
                name,
                429,
                b'{"message": "Cannot evict pod as it would violate a disruption budget."}',
            )
        self.calls.append(("evict", name))

    async def get_lease(self, namespace: str, name: str) -> Lease:
        await asyncio.sleep(0)
        if name not in self.leases:
            raise api_error("GET", name, 404, b"{}")
        return msgspec.convert(msgspec.to_builtins(self.leases[name]), Lease)

    async def create_lease(self, lease: Lease) -> Lease:
        return await self.replace_lease(lease)

    async def replace_lease(self, lease: Lease) -> Lease:
        await asyncio.sleep(0)
        self.versions += 1
        lease.metadata.resourceVersion = str(self.versions)
        self.leases[lease.metadata.name] = lease
        self.calls.append(("lease", lease.metadata.name))
        return lease


def owned(name: str, **kwargs: Any) -> dict[str, Any]:
    body = pod_json(name, {NEURON: kwargs.pop("devices", 1)}, uid=name, **kwargs)
    body["metadata"]["ownerReferences"] = [
        {"kind": "ReplicaSet", "name": "web", "uid": "rs-web", "controller": True}
    ]
    body["metadata"]["creationTimestamp"] = CREATED
    return body


def on_device(body: dict[str, Any], node_name: str, device: int) -> Pod:
    cores = cores_of_devices([device], TRN1.cores_per_device)
    body["spec"]["nodeName"] = node_name
    body["metadata"]["annotations"].update(
        {
            "AWS_NEURON_IDS": str(device),
            "NEURON_RESOURCE_TYPE": NEURON,
            "NEURON_CORES": comma_ids(cores),
            "NEURON_DEVS": str(device),
            "NEURON_NODE": node_name,
        }
    )
    body["status"] = {"phase": "Running", "startTime": CREATED}
    return msgspec.convert(body, Pod)


def stuck(
    name: str = "big", devices: int = 4, priority: int = 0, gates: tuple[str, ...] = ()
) -> Pod:
    body = pod_json(name, {NEURON: devices}, uid=name, gates=gates)
    body["metadata"]["creationTimestamp"] = CREATED
    body["spec"]["priority"] = priority
    body["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    ]
    return msgspec.convert(body, Pod)


class ClaimedNodes:
    """A node filter as consolidation asks it (the UltraServer rule keeps pods of other jobs off
    nodes claimed for a training job): these nodes admit no pod but those named in `except_for`."""

    outcome = "ultraserver"

    def __init__(self, *nodes: str, except_for: tuple[str, ...] = ()) -> None:
        self.nodes = set(nodes)
        self.except_for = except_for

    def filter(self, pod: Pod, passed: list[str], now: float) -> tuple[list[str], dict[str, str]]:
        kept = [n for n in passed if self.admits(pod, n, now)]
        return kept, {n: "claimed" for n in passed if n not in kept}

    def admits(self, pod: Pod, node: str, now: float) -> bool:
        return node not in self.nodes or pod.metadata.name in self.except_for


class World:
    """Two trn1.32xlarge: `a` with one free device per row (3, 7, 11, 15), taken by pods of a
    ReplicaSet; `b` with devices 13-15 free, 0-12 taken by bare pods. A 4-device pod of equal
    priority has waited a minute."""

    def __init__(
        self, mode: Mode = Mode.ON, claimed: NodeFilter | None = None, **limits: Any
    ) -> None:
        self.clock = Clock()
        self.claimed = claimed or ClaimedNodes()
        self.api = FakeAPI()
        self.events: list[tuple[str, str, str]] = []
        self.named: list[str] = []  # events sent under a name of their own
        self.ledger = Ledger(CATALOG, report=self._report, wall_clock=self.clock)
        self.movability = Movability()
        self.budgets = DisruptionBudgets()
        self.limits = Limits(mode, **limits)
        self.consolidator = self._consolidator()
        self.ledger.replace_nodes([node("a", "trn1.32xlarge"), node("b", "trn1.32xlarge")])
        self.pods: dict[str, Pod] = {}
        for device in range(16):
            if device % 4 != 3:
                self.pods[f"w{device}"] = on_device(owned(f"w{device}"), "a", device)
        for device in range(13):
            bare = pod_json(f"x{device}", {NEURON: 1}, uid=f"x{device}")
            self.pods[f"x{device}"] = on_device(bare, "b", device)
        self.pods["big"] = stuck()
        self.feed()

    def _consolidator(self) -> Consolidator:
        budget = EvictionBudget(
            self.api,
            "kube-system",
            "budget",
            self.limits.evictions_per_hour,
            self.limits.node_cooldown,
            self.limits.max_plans,
            self.clock,
        )
        self.plans = Plans(self.ledger, self.movability, self.clock)
        self.pending = PendingPods(["my-scheduler"])
        return Consolidator(
            self.ledger,
            self.movability,
            self.plans,
            self.budgets,
            self.api,  # type: ignore[arg-type]
            budget,
            self.pending,
            CollectorRegistry(),
            limits=self.limits,
            report=self._report,
            wall_clock=self.clock,
            filters=[self.claimed],
        )

    def _report(
        self, ref: ObjectRef, reason: str, message: str, warning: bool, name: str = ""
    ) -> None:
        self.events.append((ref.name, reason, message))
        if name:
            self.named.append(name)

    def views(self) -> tuple[Any, ...]:
        return (self.ledger, self.movability, self.plans, self.pending, self.consolidator)

    def feed(self) -> None:
        for view in self.views():
            view.replace_pods(list(self.pods.values()))

    def apply(self, pod: Pod) -> None:
        self.pods[pod.metadata.name] = pod
        for view in self.views():
            view.apply_pod(pod)

    def remove(self, name: str) -> None:
        pod = self.pods.pop(name)
        for view in self.views():
            view.remove_pod(pod.metadata.uid)

    def step(self) -> None:
        asyncio.run(self.consolidator.step())

    def annotated(self, name: str = "big") -> Pod:
        """The pod as the watch shows it after consolidation's patch."""
        pod = self.pods[name]
        record = self.plans.plans[pod.metadata.uid].record
        body = msgspec.to_builtins(pod)
        body["metadata"].setdefault("annotations", {})[planrecord.PLAN_ANNOTATION] = (
            planrecord.encode(record)
        )
        return msgspec.convert(body, Pod)

    def evicted(self) -> list[str]:
        return [c[1] for c in self.api.calls if c[0] == "evict"]

    def small_fits_on_a(self, device_count: int = 1) -> bool:
        request = NeuronRequest(NEURON, device_count)
        claimant = Claimant.of(stuck("small", device_count), request)
        return "a" in self.ledger.fill_verdicts(["a"], request, Policy.BEST_FIT, claimant).fitting()


def test_dry_run_says_what_it_would_evict_and_does_nothing() -> None:
    world = World(Mode.DRY_RUN)
    world.step()
    assert world.api.calls == []
    (event,) = [e for e in world.events if e[1] == "NeuronConsolidation"]
    assert event[0] == "big"
    assert event[2].startswith("would evict default/w")
    assert event[2].endswith(" from node a to free devices " + event[2].rsplit(" ", 1)[1])
    assert world.ledger.plan_holds == {}
    world.step()  # said once
    assert len([e for e in world.events if e[1] == "NeuronConsolidation"]) == 1


def test_too_young_or_fitting_pods_are_left_alone() -> None:
    world = World(pending_seconds=120)
    world.step()
    assert world.api.calls == []
    world = World()
    world.remove("w0")  # row 0 now has two free devices; still no row free
    world.remove("w1")
    world.remove("w2")  # row 0 free: it fits
    world.step()
    assert world.api.calls == []


def test_on_writes_the_plan_first_then_nominates_then_evicts_one_row() -> None:
    world = World()
    world.step()
    kinds = [c[0] for c in world.api.calls]
    assert kinds[:3] == ["lease", "annotate", "nominate"], world.api.calls
    evicted = world.evicted()
    assert len(evicted) == 3
    rows = {int(name[1:]) // 4 for name in evicted}
    assert len(rows) == 1
    active = world.plans.plans["big"]
    assert active.record.node == "a"
    # Each replacement's place is held on b (13-15 free) or a's free devices outside the row.
    assert all(v.node for v in active.record.victims)
    assert [e[1] for e in world.events].count("NeuronConsolidationEvicted") == 3
    # The block is held against a pod of equal priority even once the pods are gone.
    for name in evicted:
        world.remove(name)
    assert not world.small_fits_on_a(4)
    assert any(e[1] == "NeuronBlockHeld" and e[0] == "big" for e in world.events)


def test_replacements_take_their_places_and_the_plan_ends_when_all_are_bound() -> None:
    world = World()
    world.step()
    active = world.plans.plans["big"]
    world.apply(world.annotated())
    for name in world.evicted():
        world.remove(name)
    assert len(world.ledger.plan_holds) == 1 + 3
    # The pod is bound on the freed block.
    devices = active.record.devices
    big = msgspec.to_builtins(world.annotated())
    big["spec"]["nodeName"] = "a"
    world.apply(msgspec.convert(big, Pod))
    assert "big" not in world.ledger.plan_holds
    for i, victim in enumerate(active.record.victims):
        body = owned(f"new-{i}")
        body["metadata"]["creationTimestamp"] = "2027-01-15T08:01:00Z"
        assert victim.node and victim.cores
        device = victim.cores[0] // TRN1.cores_per_device
        world.apply(on_device(body, victim.node, device))
    assert world.ledger.plan_holds == {}
    assert active.ended == "done"
    world.step()
    assert ("annotate", "big", planrecord.PLAN_ANNOTATION, "remove") in world.api.calls
    del devices


def test_only_pods_created_after_the_plan_take_a_replacements_place() -> None:
    """A pod of the moved pods' controller created before the plan (seconds before it: the
    Deployment's pods that made the fragmentation) is no replacement, bound or not, read live or
    after a restart: the places stay held for the real ones."""
    world = World()
    world.clock.now += 0.5  # a plan starts within a second; creation times are whole seconds
    world.step()
    world.apply(world.annotated())
    active = world.plans.plans["big"]
    victim = active.record.victims[0]
    assert victim.node and victim.cores
    device = victim.cores[0] // TRN1.cores_per_device
    place = f"big/{victim.uid}"
    assert world.clock() == NOW + 60.5 == active.record.started  # 08:01:00.5
    sibling = owned("sibling")
    sibling["metadata"]["creationTimestamp"] = "2027-01-15T08:00:58Z"  # 1.5-2.5 s before it
    world.apply(on_device(sibling, victim.node, device))
    assert place in world.ledger.plan_holds and not active.satisfied
    assert place in restart(world).ledger.plan_holds
    # One that reads a second earlier than the plan's own second (a clock a little behind
    # ours) is one.
    replacement = owned("replacement")
    replacement["metadata"]["creationTimestamp"] = "2027-01-15T08:00:59Z"
    world.apply(on_device(replacement, victim.node, device))
    assert place not in world.ledger.plan_holds
    assert active.satisfied == {victim.uid: "replacement"}


def test_a_refused_eviction_cancels_the_plan_and_lets_go_of_its_holds() -> None:
    world = World()
    world.api.refuse = {f"w{d}" for d in range(16)}
    world.step()
    active = world.plans.plans["big"]
    assert active.ended == "cancelled"
    assert world.ledger.plan_holds == {}
    assert any(e[1] == "NeuronConsolidationCancelled" for e in world.events)
    world.step()
    assert ("annotate", "big", planrecord.PLAN_ANNOTATION, "remove") in world.api.calls


def test_a_budget_that_allows_no_disruption_stops_it_and_says_why() -> None:
    world = World()
    budget = msgspec.convert(
        {
            "metadata": {"name": "web", "namespace": "default"},
            "spec": {"selector": {"matchLabels": {}}},
            "status": {"disruptionsAllowed": 0},
        },
        PodDisruptionBudget,
    )
    world.budgets.replace([budget])
    world.step()
    assert world.api.calls == []
    (event,) = [e for e in world.events if e[1] == "NeuronConsolidationBlocked"]
    assert "PodDisruptionBudget" in event[2] and "allows no disruption" in event[2]


def test_bare_pods_are_never_moved() -> None:
    world = World()
    for device in range(16):
        if device % 4 != 3:
            body = pod_json(f"w{device}", {NEURON: 1}, uid=f"w{device}")
            world.apply(on_device(body, "a", device))
    world.step()
    assert world.api.calls == []
    (event,) = [e for e in world.events if e[1] == "NeuronConsolidationBlocked"]
    assert "a bare pod" in event[2]


def test_the_hourly_budget_and_the_node_cooldown_bound_plans() -> None:
    world = World(evictions_per_hour=2)
    world.step()
    assert world.evicted() == []
    assert any("evictions are left" in e[2] for e in world.events)
    world = World(node_cooldown=600)
    world.step()
    first = world.plans.plans["big"]
    world.remove("big")  # the plan ends with its pod
    assert first.ended == "gone"
    world.apply(stuck("big2"))
    world.step()
    assert "big2" not in world.plans.plans  # node a cools down
    world.clock.now += 601
    world.step()
    assert "big2" in world.plans.plans


def restart(world: World) -> World:
    """A new leader on the same cluster (`world.pods`), the same API and clock."""
    restarted = World.__new__(World)
    restarted.clock = world.clock
    restarted.api = world.api
    restarted.events = []
    restarted.named = []
    restarted.ledger = Ledger(CATALOG, report=restarted._report, wall_clock=world.clock)
    restarted.movability = Movability()
    restarted.budgets = DisruptionBudgets()
    restarted.limits = world.limits
    restarted.claimed = world.claimed
    restarted.consolidator = restarted._consolidator()
    restarted.ledger.replace_nodes([node("a", "trn1.32xlarge"), node("b", "trn1.32xlarge")])
    restarted.pods = dict(world.pods)
    restarted.feed()
    return restarted


def test_a_restart_rebuilds_the_holds_and_evicts_only_what_was_not_evicted() -> None:
    world = World()
    world.api.refuse = set()
    world.step()
    evicted = world.evicted()
    annotated = world.annotated()
    # A restart after the first eviction only: the others are still running.
    world.pods["big"] = annotated
    gone, *kept = evicted
    world.pods.pop(gone)
    world.api.calls.clear()
    restarted = restart(world)
    assert "big" in restarted.ledger.plan_holds
    restarted.step()
    assert sorted(restarted.evicted()) == sorted(kept)  # gone is not evicted again
    assert ("lease", "budget") not in restarted.api.calls  # no new plan, no new spending
    # The pod evicted before the kill gets its event, under the name the earlier leader would
    # have used (the API server refuses a second one of that name).
    assert evicted_event_name(gone) in restarted.named
    assert sorted(restarted.named) == sorted(evicted_event_name(uid) for uid in evicted)
    assert world.named == [evicted_event_name(uid) for uid in evicted]
    # The earlier leader nominated the pod before its first eviction: a nomination set again
    # now would stand (kube-scheduler's next try of the pod fails by count) and refuse the
    # replacements still pending by count.
    assert not any(c[0] == "nominate" for c in restarted.api.calls)
    restarted.step()
    assert not any(c[0] == "nominate" for c in restarted.api.calls)
    assert len(restarted.named) == len(evicted)


def test_a_restart_between_the_plan_and_its_first_eviction_nominates_the_pod_once() -> None:
    world = World()
    world.step()
    evicted = world.evicted()
    world.pods["big"] = world.annotated()  # (the fake API's evictions leave the pods as they were)
    world.api.calls.clear()
    restarted = restart(world)
    restarted.step()
    assert restarted.api.calls.count(("nominate", "big", "a")) == 1
    assert sorted(restarted.evicted()) == sorted(evicted)
    restarted.step()
    assert restarted.api.calls.count(("nominate", "big", "a")) == 1


def test_an_expired_plan_lets_go_of_its_holds() -> None:
    world = World()
    world.step()
    world.apply(world.annotated())
    assert world.ledger.plan_holds
    world.clock.now += world.limits.plan_seconds + 1
    assert world.plans.seconds_to_next_expiry() is not None
    world.plans.expire()
    assert world.ledger.plan_holds == {}
    assert world.plans.plans["big"].ended == "expired"


@pytest.mark.parametrize(
    "label", ["training.kubeflow.org/job-name", "jobset.sigs.k8s.io/jobset-name"]
)
def test_gang_workers_are_never_moved(label: str) -> None:
    world = World()
    for device in range(16):
        if device % 4 != 3:
            body = owned(f"w{device}", labels={label: "job"})
            world.apply(on_device(body, "a", device))
    world.step()
    assert world.api.calls == []
    (event,) = [e for e in world.events if e[1] == "NeuronConsolidationBlocked"]
    assert "gang job moves only whole" in event[2]


def test_a_late_event_from_before_the_plan_does_not_end_it() -> None:
    """The watch may deliver an update of the pod made before the plan was written (say
    kube-scheduler's condition) after the write: the plan stands until the watch has shown it."""
    world = World()
    older = world.pods["big"]
    world.step()
    world.apply(older)  # without the annotation, from before
    assert world.plans.plans["big"].ended == ""
    assert "big" in world.ledger.plan_holds
    world.apply(world.annotated())
    world.apply(older)  # now a removal: by a person
    assert world.plans.plans.get("big") is None
    assert "big" not in world.ledger.plan_holds


def test_no_plan_frees_a_block_or_places_a_replacement_where_the_node_filter_refuses() -> None:
    """A node the extender's node filter refuses the pod on (claimed for a training job) is no
    node it is stranded on: nothing is evicted there. A replacement is placed only where the
    filter admits it."""
    world = World(claimed=ClaimedNodes("a"))
    world.step()
    assert world.api.calls == []
    # The same with the extender's own rule: `a` is an UltraServer node claimed for a job.
    occupancy = Occupancy()
    occupancy.replace_nodes(
        [node("a", "trn1.32xlarge", labels={"neuron.amazonaws.com/ultraserver-mode": "1_2_4"})]
    )
    occupancy.hold(NodeClaim("a", ("default", "job"), 1, 1, PENDING, NOW, 120))
    world = World(claimed=UnitPlacement(occupancy))
    world.step()
    assert world.api.calls == []
    world = World(claimed=ClaimedNodes("a", except_for=("big",)))  # replacements not on a
    world.step()
    record = world.plans.plans["big"].record
    assert record.node == "a" and {v.node for v in record.victims} == {"b"}, record.victims
    world = World(claimed=ClaimedNodes("a", "b", except_for=("big",)))  # nowhere to go
    world.step()
    assert world.evicted() == []


def rings(replicas_on_r1: bool = False) -> World:
    """Two inf2.48xlarge rings (issue 41's report, as a new user met it): r1 has four devices
    free (0, 3, 6, 9), every other device held by a bare pod, or with `replicas_on_r1` by
    ReplicaSet replicas; r2 has devices 0-2 free, a replica on 3 and bare pods on 4-11. A
    4-device pod has waited a minute. Moving r2's one replica frees 0-3 there."""
    world = World.__new__(World)
    world.clock = Clock()
    world.claimed = ClaimedNodes()
    world.api = FakeAPI()
    world.events = []
    world.named = []
    world.ledger = Ledger(CATALOG, report=world._report, wall_clock=world.clock)
    world.movability = Movability()
    world.budgets = DisruptionBudgets()
    world.limits = Limits(Mode.ON)
    world.consolidator = world._consolidator()
    world.ledger.replace_nodes([node("r1", "inf2.48xlarge"), node("r2", "inf2.48xlarge")])
    world.pods = {}
    for device in range(12):
        if device not in (0, 3, 6, 9):
            name = f"x{device}"
            body = owned(name) if replicas_on_r1 else pod_json(name, {NEURON: 1}, uid=name)
            world.pods[name] = on_device(body, "r1", device)
    for device in range(4, 12):
        world.pods[f"y{device}"] = on_device(
            pod_json(f"y{device}", {NEURON: 1}, uid=f"y{device}"), "r2", device
        )
    world.pods["w3"] = on_device(owned("w3"), "r2", 3)
    world.pods["big"] = stuck()
    world.feed()
    return world


def test_a_plan_may_free_a_block_on_a_node_without_the_pods_count_free() -> None:
    """Only r1 has 4 devices free, and nothing there may move; moving r2's replica (to a free
    device of r1) frees r2's devices 0-3. Planning only where the count was free found nothing."""
    world = rings()
    world.step()
    assert world.evicted() == ["w3"]
    active = world.plans.plans["big"]
    assert (active.record.node, active.record.devices) == ("r2", (0, 1, 2, 3))
    (victim,) = active.record.victims
    assert victim.node == "r1"  # its replacement's place: a free device of r1
    assert world.consolidator.concluded("big") is None


def test_the_fewest_moves_win_over_a_node_with_the_count_free() -> None:
    """r1 has 4 free but every run of four there needs two replicas moved; r2 needs one."""
    world = rings(replicas_on_r1=True)
    world.step()
    assert world.evicted() == ["w3"]
    assert world.plans.plans["big"].record.node == "r2"


def test_when_nothing_may_move_anywhere_it_concludes_so_and_names_each_node() -> None:
    world = rings()
    world.apply(on_device(pod_json("w3", {NEURON: 1}, uid="w3"), "r2", 3))  # a bare pod now
    world.step()
    assert world.api.calls == []
    assert world.consolidator.concluded("big") is Concluded.NO_MOVE
    (event,) = [e for e in world.events if e[1] == "NeuronConsolidationBlocked"]
    assert "r1: " in event[2] and "r2: " in event[2], event


def test_a_pod_short_of_devices_is_not_counted_as_blocked_by_plans_in_flight() -> None:
    """The plans-in-flight bound is checked after the stranded check: a pod that no node has
    the count for is no business of consolidation's, whatever is in flight. (No plan may be in
    flight at all here: every stranded pod is held back by the bound.)"""
    world = World(max_plans=0)
    world.apply(stuck("huge", 16))  # 16 devices free on no node: short, not stranded
    world.remove("big")
    blocked = world.consolidator.metrics.blocked.labels("plans_in_flight")
    world.step()
    assert blocked._value.get() == 0
    assert world.consolidator.concluded("huge") is None
    world.apply(stuck("big"))  # stranded: held back by the bound
    world.step()
    assert blocked._value.get() == 1
    assert world.consolidator.concluded("big") is Concluded.PLANS_IN_FLIGHT
    assert world.api.calls == []


def test_a_gated_pod_gets_no_plan_and_is_not_counted_as_stranded() -> None:
    """Issue 48: a pod with a scheduling gate (Kueue's, until it admits the workload) is not
    pending: no plan, no event, not among the stranded pods consolidation did not act for. Its
    PodScheduled condition says Unschedulable here: the gates decide, whoever wrote that."""
    world = World(max_plans=0)  # every stranded pod is counted as held back by the bound
    world.apply(stuck(gates=(KUEUE_ADMISSION_GATE,)))
    blocked = world.consolidator.metrics.blocked.labels("plans_in_flight")
    world.step()
    assert blocked._value.get() == 0
    assert world.consolidator.concluded("big") is None
    assert world.api.calls == [] and world.events == []
    world = World(Mode.DRY_RUN)
    world.apply(stuck(gates=(KUEUE_ADMISSION_GATE,)))
    world.step()
    assert world.events == []
    world.apply(stuck())  # Kueue admitted it: the gate is gone
    world.step()
    assert [e[1] for e in world.events] == ["NeuronConsolidation"]


def forged_plan(victims: list[str], node_name: str = "b", owner: str = "rs-any") -> str:
    """A plan as anyone able to write the pod's annotation could write it: pods of node b."""
    record = planrecord.PlanRecord(
        node_name,
        (0, 1, 2, 3),
        tuple(cores_of_devices([0, 1, 2, 3], TRN1.cores_per_device)),
        NOW,
        NOW + 300,
        tuple(
            planrecord.Replacement(uid, f"default/{uid}", owner, NeuronRequest(NEURON, 1))
            for uid in victims
        ),
    )
    return planrecord.encode(record)


def test_a_plan_read_back_evicts_only_what_a_plan_of_the_extender_could() -> None:
    """A plan found on a pod's annotation (after a restart, or written by whoever could write
    the pod) naming pods consolidation never moves (bare pods here) evicts none of them: the
    plan is cancelled with the reason, its holds let go."""
    world = World()
    body = msgspec.to_builtins(world.pods["big"])
    body["metadata"].setdefault("annotations", {})[planrecord.PLAN_ANNOTATION] = forged_plan(
        ["x0", "x1"]
    )
    world.apply(msgspec.convert(body, Pod))
    assert world.plans.plans["big"].record.node == "b"
    world.step()
    assert not {"x0", "x1"} & set(world.evicted())
    assert world.plans.plans["big"].ended == "cancelled"
    (event,) = [e for e in world.events if e[1] == "NeuronConsolidationCancelled"]
    assert "default/x0 may not be moved: a bare pod" in event[2], event
    assert "big" not in world.ledger.plan_holds


def test_a_pod_that_opts_out_after_the_plan_is_not_evicted() -> None:
    world = World()
    world.api.refuse = set()
    world.step()
    first, *_ = world.evicted()
    record = world.plans.plans["big"].record
    assert len(record.victims) == 3
    # A restart after the first eviction; meanwhile a second victim opted out.
    world.apply(world.annotated())
    world.remove(first)
    left = [v.uid for v in record.victims if v.uid != first]
    opted = msgspec.to_builtins(world.pods[left[0]])
    opted["metadata"].setdefault("annotations", {})["neuron-scheduler.io/do-not-disrupt"] = "true"
    world.apply(msgspec.convert(opted, Pod))
    world.api.calls.clear()
    active = world.plans.plans["big"]
    active.asked.clear()
    asyncio.run(world.consolidator._evict(active))  # as a restarted leader's step does
    assert left[0] not in world.evicted()
    assert active.ended == "cancelled"


@pytest.mark.parametrize(
    ("started", "until", "why"),
    [(NOW, NOW + 3601, "lasts 3600 s at most"), (NOW + 3600, NOW + 3700, "in the future")],
)
def test_a_plan_that_holds_longer_than_any_the_extender_writes_is_ignored(
    started: float, until: float, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "neuron_scheduler.extender.consolidating")
    world = World()
    record = planrecord.decode(forged_plan(["w0"], "a", "rs-web"))
    text = planrecord.encode(
        planrecord.PlanRecord(
            record.node, record.devices, record.cores, started, until, record.victims
        )
    )
    body = msgspec.to_builtins(world.pods["big"])
    body["metadata"].setdefault("annotations", {})[planrecord.PLAN_ANNOTATION] = text
    world.apply(msgspec.convert(body, Pod))
    assert "big" not in world.plans.plans and "big" not in world.ledger.plan_holds
    assert "big" in world.plans.unreadable
    assert why in caplog.text


def test_a_victim_gone_while_an_earlier_eviction_is_awaited_is_passed_over() -> None:
    world = World()
    evict = world.api.evict
    gone: list[str] = []

    async def evicting(namespace: str, name: str, uid: str) -> None:
        await evict(namespace, name, uid)
        if not gone:  # the watch shows the next victim deleted meanwhile
            record = world.plans.plans["big"].record
            later = next(v.uid for v in record.victims if v.uid != uid)
            gone.append(later)
            world.remove(later)

    world.api.evict = evicting  # type: ignore[method-assign]
    world.step()
    assert len(world.evicted()) == 2 and gone[0] not in world.evicted()
    assert world.plans.plans["big"].ended == ""
