"""The waker: refused pods are woken once room frees for them, once per refusal, greedily, only
for pods of our schedulers, only by the leader, never during their bind (tests/podapi.py's API)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import pytest

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.handoff import ALLOC_TIME
from neuron_scheduler.core.resources import NEURON
from neuron_scheduler.extender.loops.waking import WAKE_ANNOTATION, Waker
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.verbs.judging import Judge
from neuron_scheduler.extender.verbs.wire import ExtenderArgs
from neuron_scheduler.jobs.claims import PENDING, NodeClaim
from neuron_scheduler.jobs.placement import Occupancy, UnitPlacement
from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import KUEUE_ADMISSION_GATE
from tests.builders import node, pod_json
from tests.podapi import FakeAPI

RING = "inf2-a"  # inf2.48xlarge: a ring of 12 devices
ONE = "inf2-b"  # inf2.xlarge: one device


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class World:
    """A ledger, a judge and a waker on a fake API, with one clock for all of them."""

    def __init__(self, rate: float = 100.0, grace: float = 0.5, **waker: Any) -> None:
        self.clock = Clock()
        self.api = FakeAPI()
        self.ledger = Ledger(Catalog.builtin(), clock=self.clock, wall_clock=self.clock)
        self.occupancy = Occupancy()
        self.units = UnitPlacement(self.occupancy)
        self.waker = Waker(
            self.ledger,
            self.api,  # type: ignore[arg-type]
            ["my-scheduler"],
            filters=[self.units],
            keepers=[self.ledger],
            rate=rate,
            grace=grace,
            clock=self.clock,
            wall_clock=self.clock,
            **waker,
        )
        self.ledger.on_freed = self.occupancy.on_freed = self.waker.node_changed
        self.ledger.on_deadline = self.waker.deadline_changed
        self.judge = Judge(
            self.ledger,
            Metrics(self.ledger),
            filters=[self.units],
            listener=self.waker,
            clock=self.clock,
        )
        self.views = (self.ledger, self.occupancy, self.waker)
        for view in self.views:
            view.replace_nodes([node(RING, "inf2.48xlarge"), node(ONE, "inf2.xlarge")])
            view.replace_pods([])

    def add(self, name: str, devices: int, **kwargs: Any) -> Pod:
        body = pod_json(name, {NEURON: devices}, uid=f"uid-{name}", **kwargs)
        body["metadata"]["resourceVersion"] = str(next(self.api.version))
        self.api.pods[name] = body
        pod = msgspec.convert(body, Pod)
        for view in self.views:
            view.apply_pod(pod)
        return pod

    def delete(self, pod: Pod) -> None:
        del self.api.pods[pod.metadata.name]
        for view in self.views:
            view.remove_pod(pod.metadata.uid)

    def fill(self, node_name: str, devices: list[int]) -> list[Pod]:
        """One-device pods bound to these devices, as our bind annotates them."""
        return [
            self.add(
                f"{node_name}-d{d}",
                1,
                node=node_name,
                annotations={
                    "AWS_NEURON_IDS": str(d),
                    "NEURON_NODE": node_name,
                    ALLOC_TIME: "1",
                    "NEURON_RESOURCE_TYPE": NEURON,
                },
            )
            for d in devices
        ]

    def filter(self, pod: Pod, nodes: list[str] | None = None) -> list[str]:
        return self.judge.filter(ExtenderArgs(Pod=pod, NodeNames=nodes or [RING, ONE])).passed

    async def run(self, seconds: float = 0.0) -> None:
        """Moves the clock on and lets the waker do what is due, writes included."""
        self.clock.now += seconds
        self.waker.step()
        for _ in range(5):
            await asyncio.sleep(0)

    def woken(self) -> list[str]:
        return sorted(
            name
            for name, body in self.api.pods.items()
            if WAKE_ANNOTATION in body["metadata"].get("annotations", {})
        )


async def test_a_pod_refused_for_a_block_is_woken_once_its_holder_is_deleted() -> None:
    world = World()
    holders = world.fill(RING, list(range(0, 12, 2)))  # every other device busy: no pair free
    waiter = world.add("waiter", 2)
    assert world.filter(waiter) == []
    world.delete(holders[0])  # devices 0,1 free now
    await world.run(0.1)
    assert world.woken() == [], "kube-scheduler gets the grace to retry on the deletion itself"
    await world.run(0.5)
    assert world.woken() == ["waiter"]
    value = world.api.pods["waiter"]["metadata"]["annotations"][WAKE_ANNOTATION]
    assert value.endswith(f"{RING}: pod deleted"), value


async def test_a_pod_kube_scheduler_asked_about_after_the_room_freed_is_not_woken() -> None:
    world = World()
    holders = world.fill(RING, list(range(0, 12, 2)))
    waiter = world.add("waiter", 2)
    assert world.filter(waiter) == []
    world.delete(holders[0])
    world.clock.now += 0.1
    assert world.filter(waiter) == [RING]  # kube-scheduler retried it: it fits
    await world.run(1.0)
    assert world.woken() == []


async def test_room_freed_while_no_pod_waits_is_not_kept() -> None:
    """Only pods refused before a change are woken for it: with none waiting the change is not
    kept (every bind changes its node twice, issue 50), and changes after a refusal still wake."""
    world = World()
    await world.run(1.0)
    holders = world.fill(RING, list(range(0, 12, 2)))  # every other device busy
    world.delete(holders[0])  # devices 0,1 free; nobody waits
    assert world.waker.changes == {}
    waiter = world.add("waiter", 4)
    assert world.filter(waiter) == []  # no 4 in a row
    world.delete(holders[1])  # devices 0-3 free
    assert list(world.waker.changes) == [RING]
    await world.run(1.0)
    assert world.woken() == ["waiter"]


def _announced(world: World, name: str, ends_in: float, node: str = RING) -> None:
    """A pending pod of another scheduler with the ids a bind wrote on `node`, held for `ends_in`
    more seconds."""
    written = int((world.clock.now + ends_in - 90) * 1e9)
    world.add(
        name,
        1,
        scheduler="nobody",
        annotations={
            "AWS_NEURON_IDS": "0",
            "NEURON_NODE": node,
            ALLOC_TIME: str(written),
            "NEURON_RESOURCE_TYPE": NEURON,
        },
    )


async def test_a_new_hold_wakes_the_loop_only_when_it_ends_before_the_next_step() -> None:
    world = World()
    waker = world.waker
    task = asyncio.get_running_loop().create_task(waker.run())
    try:
        await asyncio.sleep(0.05)  # the loop has stepped and waits (up to 5 s) for its next step
        assert not waker._signal.is_set()
        _announced(world, "bind-90s", 90.0)  # a bind's hold: a step comes long before it ends
        assert not waker._signal.is_set()
        _announced(world, "bind-2s", 2.0)  # ends before the next step: the loop is woken
        assert waker._signal.is_set()
    finally:
        task.cancel()


async def test_a_hold_that_ends_silently_wakes_at_once() -> None:
    """Ids a bind wrote on a pending pod hold its devices until ANNOUNCED_SECONDS after they
    were written; no cluster event says when that ends."""
    world = World()
    await world.run(1.0)  # the nodes' own changes examined
    assert world.waker.step() == 5.0  # nothing held: the next look is the safety net's
    _announced(world, "failed-bind", 5.0, ONE)
    waiter = world.add("waiter", 1)
    assert world.filter(waiter, [ONE]) == []
    assert world.waker.step() == pytest.approx(5.0)  # the next step comes when the hold ends
    world.clock.now += 1.0
    assert world.waker.step() == pytest.approx(4.0)
    await world.run(3.0)
    assert world.woken() == []
    await world.run(1.0)  # the hold's end is due: no grace, no read needed
    assert world.woken() == ["waiter"]
    assert "hold expired" in world.api.pods["waiter"]["metadata"]["annotations"][WAKE_ANNOTATION]


async def test_only_as_many_pods_as_the_room_takes_are_woken_highest_priority_first() -> None:
    world = World()
    holders = world.fill(RING, list(range(0, 12, 2)))
    low = world.add("low", 2)
    high = world.add("high", 2)
    high = msgspec.structs.replace(high, spec=msgspec.structs.replace(high.spec, priority=10))
    for pod in (low, high):
        assert world.filter(pod) == []
    world.delete(holders[0])  # one pair free
    await world.run(1.0)
    assert world.woken() == ["high"]


async def test_a_woken_pod_is_not_woken_again_until_refused_again() -> None:
    world = World()
    holders = world.fill(RING, list(range(0, 12, 2)))
    waiter = world.add("waiter", 2)

    def writes() -> str:
        return str(world.api.pods["waiter"]["metadata"]["resourceVersion"])

    assert world.filter(waiter) == []
    world.delete(holders[0])  # devices 0,1 free
    await world.run(1.0)
    first = writes()
    assert world.woken() == ["waiter"]
    world.delete(holders[1])  # 2,3 free too: kube-scheduler has not asked yet
    await world.run(1.0)
    assert writes() == first
    world.fill(RING, [0, 1, 2, 3])  # others took both pairs; kube-scheduler asks again
    assert world.filter(waiter) == []
    world.delete(holders[2])  # devices 4,5 free
    await world.run(1.0)
    assert writes() != first


async def test_pods_whose_spec_keeps_them_off_the_node_are_not_woken() -> None:
    world = World()
    holders = world.fill(RING, list(range(0, 12, 2)))
    waiter = world.add("waiter", 2, node_selector={"team": "b"})
    assert world.filter(waiter) == []
    world.delete(holders[0])
    await world.run(1.0)
    assert world.woken() == []


async def test_pods_of_other_schedulers_and_a_replica_that_is_not_leader_wake_nothing() -> None:
    leading = [False]
    world = World(is_leader=lambda: leading[0])
    holders = world.fill(RING, list(range(0, 12, 2)))
    other = world.add("other", 2, scheduler="default-scheduler")
    waiter = world.add("waiter", 2)
    for pod in (other, waiter):
        assert world.filter(pod) == []
    world.delete(holders[0])
    await world.run(1.0)
    assert world.woken() == []
    leading[0] = True
    world.delete(holders[1])
    await world.run(1.0)
    assert world.woken() == ["waiter"]


async def test_the_rate_limits_writes() -> None:
    world = World(rate=1.0)
    world.fill(ONE, [0])
    holders = world.fill(RING, list(range(12)))
    one_device = [world.add(f"w{i}", 1) for i in range(3)]
    for pod in one_device:
        assert world.filter(pod) == []
    for pod in holders[:3]:
        world.delete(pod)
    await world.run(1.0)
    assert len(world.woken()) == 1
    await world.run(1.0)
    assert len(world.woken()) == 2


async def test_no_wake_is_written_while_the_pod_is_being_bound() -> None:
    world = World()
    holders = world.fill(RING, list(range(0, 12, 2)))
    waiter = world.add("waiter", 2)
    assert world.filter(waiter) == []
    async with world.waker.quiet(waiter.metadata.uid):
        world.delete(holders[0])
        await world.run(1.0)
        assert world.woken() == []


async def test_a_bind_waits_for_a_wake_already_on_its_way() -> None:
    world = World()
    holders = world.fill(RING, list(range(0, 12, 2)))
    waiter = world.add("waiter", 2)
    assert world.filter(waiter) == []
    world.delete(holders[0])
    world.clock.now += 1.0
    world.waker.step()  # the write is a task now, not done yet
    assert world.woken() == []
    async with world.waker.quiet(waiter.metadata.uid):
        assert world.woken() == ["waiter"]  # landed before the bind reads the pod


async def test_a_failed_wake_is_logged_once_and_left_to_the_flush(
    caplog: pytest.LogCaptureFixture,
) -> None:
    world = World()
    holders = world.fill(RING, list(range(0, 12, 2)))
    waiters = [world.add(f"w{i}", 2) for i in range(2)]
    for pod in waiters:
        assert world.filter(pod) == []

    async def forbidden(*_: object, **__: object) -> str:
        raise api_error("PATCH", "pods", 403, b'{"message": "cannot patch pods"}')

    world.api.patch_annotations = forbidden  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, "neuron_scheduler.extender.waking"):
        world.delete(holders[0])
        world.delete(holders[1])
        await world.run(1.0)
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == "neuron_scheduler.extender.waking" and r.levelno >= logging.WARNING
    ]
    assert len(lines) == 1, lines
    assert "needs patch on pods" in lines[0] and "5 minutes" in lines[0]
    assert world.waker.waiting == {}


async def refused_job() -> tuple[World, list[str]]:
    """One UltraServer of four trn2u nodes and an MPI job "b" of four members, each refused (no
    claim yet)."""
    world = World()
    labels = {
        "neuron.amazonaws.com/ultraserver-mode": "1_2_4",
        "neuron.amazonaws.com/ultraserver-server-id-4": "a" * 16,
    }
    trn = [node(f"trn-{i}", "trn2u.48xlarge", labels=labels) for i in range(4)]
    for view in world.views:
        view.replace_nodes(trn)
    names = [n.metadata.name for n in trn]
    job = {"training.kubeflow.org/job-name": "b", "training.kubeflow.org/job-role": "worker"}
    members = [world.add(f"b-worker-{i}", 16, labels=job) for i in range(4)]
    for pod in members:
        assert world.filter(pod, names) == []
    await world.run(1.0)
    return world, names


async def test_a_claim_made_for_a_training_job_wakes_its_members() -> None:
    """A job's members are refused until its UltraServer claim is written (by the reservation
    loop, no cluster event kube-scheduler acts on): then they are woken at once."""
    world, names = await refused_job()
    assert world.woken() == []
    for name in names:
        world.occupancy.hold(NodeClaim(name, ("default", "b"), 4, 4, PENDING, world.clock(), 120))
    await world.run(0.0)
    assert world.woken() == [f"b-worker-{i}" for i in range(4)]
    value = world.api.pods["b-worker-0"]["metadata"]["annotations"][WAKE_ANNOTATION]
    assert "claim made" in value, value


async def test_the_first_list_seeds_pods_kube_scheduler_left_unschedulable() -> None:
    world = World()
    world.fill(ONE, [0])
    body = pod_json("left", {NEURON: 1}, uid="uid-left")
    body["metadata"]["resourceVersion"] = "1"
    body["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    ]
    world.api.pods["left"] = body
    fresh = Ledger(Catalog.builtin(), clock=world.clock, wall_clock=world.clock)
    waker = Waker(fresh, world.api, ["my-scheduler"], clock=world.clock)  # type: ignore[arg-type]
    waker.replace_pods([msgspec.convert(body, Pod)])
    assert list(waker.waiting) == ["uid-left"]


async def test_a_gated_pod_is_never_seeded_nor_woken() -> None:
    """Issue 48: kube-scheduler does not try a pod with a scheduling gate, so a wake would be
    for nothing; its condition (Unschedulable here, whoever wrote it) does not make it pending."""
    leading = [False]
    world = World(is_leader=lambda: leading[0])
    holders = world.fill(RING, list(range(0, 12, 2)))
    body = pod_json("queued", {NEURON: 2}, uid="uid-queued", gates=[KUEUE_ADMISSION_GATE])
    body["metadata"]["resourceVersion"] = "1"
    body["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    ]
    world.api.pods["queued"] = body
    fresh = Waker(world.ledger, world.api, ["my-scheduler"], clock=world.clock)  # type: ignore[arg-type]
    fresh.replace_pods([msgspec.convert(body, Pod)])  # the first list
    assert fresh.waiting == {}
    for view in world.views:
        view.apply_pod(msgspec.convert(body, Pod))
    await world.run(1.0)
    leading[0] = True  # a new leader seeds what its predecessor refused: not this one
    await world.run(1.0)
    world.delete(holders[0])
    await world.run(1.0)
    assert world.woken() == [] and world.waker.waiting == {}


async def test_a_claim_seen_node_by_node_wakes_every_member_once_complete() -> None:
    """The claim watch delivers one node at a time; half a claim admits nobody, so the waker
    hears of all the job's nodes when the last one makes it complete."""
    world, names = await refused_job()
    for name in names:
        world.occupancy.hold(NodeClaim(name, ("default", "b"), 4, 4, PENDING, world.clock(), 120))
        await world.run(0.0)
    assert world.woken() == [f"b-worker-{i}" for i in range(4)]


async def test_a_replica_that_becomes_leader_wakes_the_pods_its_predecessor_refused() -> None:
    leading = [False]
    world = World(is_leader=lambda: leading[0])
    holders = world.fill(RING, list(range(0, 12, 2)))
    body = pod_json("waiter", {NEURON: 2}, uid="uid-waiter")
    body["metadata"]["resourceVersion"] = "1"
    body["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    ]
    world.api.pods["waiter"] = body
    for view in world.views:  # refused by the previous leader: this replica's filter never was
        view.apply_pod(msgspec.convert(body, Pod))
    await world.run(1.0)
    leading[0] = True
    await world.run(1.0)
    world.delete(holders[0])
    await world.run(1.0)
    assert world.woken() == ["waiter"]
