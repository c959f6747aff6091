"""The reservation loop on an in-memory UltraServerClaim API that keeps kube-apiserver's rules: a
create of a name that exists is a 409, a replace or delete conditioned on a resourceVersion (or
uid) that no longer holds is a 409, and every write bumps the resourceVersion. Preemption for
training jobs (issue 40): the preempt verb and the loop on the same world, the pods' deletions
recorded in the order the API would see them."""

from __future__ import annotations

import asyncio
import itertools
import time
from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON
from neuron_scheduler.extender.loops import reserving
from neuron_scheduler.extender.loops.reserving import Reservations
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.admission import NotPlaced, Placed, place
from neuron_scheduler.extender.state.budgets import DisruptionBudgets
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.state.members import preemption_for
from neuron_scheduler.extender.verbs.preempting import Preemptor
from neuron_scheduler.extender.verbs.wire import (
    ExtenderPreemptionArgs,
    MetaPod,
    MetaVictims,
)
from neuron_scheduler.jobs.claims import BOUND, PENDING, NodeClaim, to_object
from neuron_scheduler.jobs.members import member_of
from neuron_scheduler.jobs.placement import (
    CLAIM_ENDED,
    CLAIM_MADE,
    Fit,
    Occupancy,
    Planned,
    Shortfall,
    UnitPlacement,
    job_progress,
)
from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.kueue import Workload
from neuron_scheduler.kube.objects import JobClaim, ObjectRef, Pod
from neuron_scheduler.kube.reading import KUEUE_ADMISSION_GATE
from tests.builders import node, pod_json

PREFIX = "neuron.amazonaws.com/ultraserver-"


class FakeClaims:
    def __init__(self) -> None:
        self.claims: dict[str, JobClaim] = {}
        self.version = itertools.count(1)
        self.uids = itertools.count(1)
        self.writes = 0
        self.fail_on: set[str] = set()  # names whose create fails with a 500
        self.log: list[str] = []  # claim writes and pod evictions, in order
        self.fail_deletes: set[str] = set()  # pod uids whose delete fails with a 500
        self.refuse_deletes: set[str] = set()  # pod uids whose delete admission refuses (400)
        self.dry_runs: list[str] = []  # pod uids whose delete was asked as a dry run
        self.on_delete: Any = None  # told the uid of a pod deleted (it is terminating)

    def _stamp(self, claim: JobClaim, uid: str) -> JobClaim:
        stored = msgspec.convert(msgspec.to_builtins(claim), JobClaim)
        stored.metadata.resourceVersion = str(next(self.version))
        stored.metadata.uid = uid
        known = self.claims.get(stored.metadata.name)
        stored.metadata.creationTimestamp = (
            known.metadata.creationTimestamp if known is not None else "2026-01-01T00:00:00Z"
        )
        self.claims[stored.metadata.name] = stored
        self.writes += 1
        self.log.append(f"claim {stored.metadata.name} {stored.spec.job}")
        return msgspec.convert(msgspec.to_builtins(stored), JobClaim)

    async def mark_preempted(self, namespace: str, name: str, uid: str, message: str) -> None:
        self.log.append(f"mark {uid}")

    async def delete_pod(self, namespace: str, name: str, uid: str, dry_run: bool = False) -> None:
        if uid in self.refuse_deletes:
            raise api_error("DELETE", name, 400, b'{"message": "denied by policy no-deletes"}')
        if uid in self.fail_deletes:
            raise api_error("DELETE", name, 500, b'{"message": "injected"}')
        if dry_run:
            self.dry_runs.append(uid)
            return
        self.log.append(f"delete {uid}")
        if self.on_delete is not None:
            self.on_delete(uid)

    async def create_claim(self, claim: JobClaim) -> JobClaim:
        name = claim.metadata.name
        if name in self.fail_on:
            raise api_error("POST", name, 500, b'{"message": "injected"}')
        if name in self.claims:
            raise api_error("POST", name, 409, b'{"reason": "AlreadyExists"}')
        return self._stamp(claim, f"uid-{next(self.uids)}")

    async def replace_claim(self, claim: JobClaim) -> JobClaim:
        known = self.claims.get(claim.metadata.name)
        if known is None:
            raise api_error("PUT", claim.metadata.name, 404, b"{}")
        if known.metadata.resourceVersion != claim.metadata.resourceVersion:
            raise api_error("PUT", claim.metadata.name, 409, b'{"reason": "Conflict"}')
        return self._stamp(claim, known.metadata.uid)

    async def delete_claim(self, name: str, uid: str, resource_version: str) -> None:
        known = self.claims.get(name)
        if known is None:
            raise api_error("DELETE", name, 404, b"{}")
        if known.metadata.uid != uid or known.metadata.resourceVersion != resource_version:
            raise api_error("DELETE", name, 409, b'{"reason": "Conflict"}')
        del self.claims[name]
        self.writes += 1


class World:
    def __init__(self, units: int = 2) -> None:
        self.now = 1_767_312_000.0  # 2026-01-02T00:00:00Z: after the pods' start times
        self.grace = 30.0  # a deleted pod's terminationGracePeriodSeconds
        self.api = FakeClaims()
        self.ledger = Ledger(Catalog.builtin())
        self.occupancy = Occupancy()
        self.filter = UnitPlacement(self.occupancy)
        self.heard: list[tuple[tuple[str, ...], str]] = []
        self.occupancy.on_freed = lambda nodes, cause: self.heard.append((tuple(nodes), cause))
        self.leading = True
        self.events: list[tuple[str, str, str]] = []  # (pod, reason, message)
        self.loop = self.restarted()
        self.api.on_delete = self.terminating
        self.verb = Preemptor(
            self.ledger,
            DisruptionBudgets(),
            Metrics(self.ledger),
            occupancy=self.occupancy,
            clock=lambda: self.now,
        )
        nodes = []
        for unit in "abcd"[:units]:
            for i in range(4):
                labels = {PREFIX + "mode": "1_2_4", PREFIX + "server-id-4": unit * 16}
                nodes.append(node(f"{unit}{i}", "trn2u.48xlarge", labels=labels))
        for view in (self.ledger, self.occupancy):
            view.replace_nodes(nodes)
            view.replace_pods([])
        self.pods: dict[str, Pod] = {}

    def restarted(self) -> Reservations:
        """A reservation loop, as a new leader (or a restarted extender) starts one."""

        def report(ref: ObjectRef, reason: str, message: str, warning: bool) -> None:
            self.events.append((ref.name, reason, message))

        return Reservations(
            self.api,
            self.occupancy,
            self.filter,
            self.ledger,
            ["my-scheduler"],
            60,
            is_leader=lambda: self.leading,
            wall_clock=lambda: self.now,
            clock=lambda: self.now,
            report=report,
        )

    def terminating(self, uid: str) -> None:
        """A deleted pod, as the watch shows it until its kubelet is done with it (at the latest
        when its grace period ends: deletionTimestamp)."""
        pod = self.pods[uid]
        by = datetime.fromtimestamp(self.now + self.grace, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta = msgspec.structs.replace(pod.metadata, deletionTimestamp=by)
        self.pods[uid] = leaving = msgspec.structs.replace(pod, metadata=meta)
        for view in (self.ledger, self.occupancy):
            view.apply_pod(leaving)

    def member(
        self,
        job: str,
        index: int,
        size: int,
        node_name: str = "",
        priority: int = 0,
        started: str = "",
        devices: int = 16,
        **kwargs: Any,
    ) -> Pod:
        body = pod_json(
            f"{job}-{index}",
            {NEURON: devices},
            namespace="ns",
            node=node_name,
            uid=f"{job}-{index}",
            labels={
                "training.kubeflow.org/job-name": job,
                "training.kubeflow.org/job-role": "worker",
            },
            annotations={"neuron-scheduler.io/gang-size": str(size)},
            **kwargs,
        )
        body["metadata"]["creationTimestamp"] = f"2026-01-01T00:00:{len(self.pods):02d}Z"
        body["spec"]["priority"] = priority
        if started:
            body.setdefault("status", {})["startTime"] = started
        pod = msgspec.convert(body, Pod)
        self.pods[pod.metadata.uid] = pod
        for view in (self.ledger, self.occupancy):
            view.apply_pod(pod)
        return pod

    def job(self, job: str, size: int, **kwargs: Any) -> list[Pod]:
        return [self.member(job, i, size, **kwargs) for i in range(size)]

    async def running(self, job: str, unit: str, **kwargs: Any) -> list[Pod]:
        """A 4-member job bound whole on one unit, its claim Bound."""
        members = self.job(job, 4, **kwargs)
        await self.loop.step()
        assert self.claimed(job) == [f"{unit}{i}" for i in range(4)]
        bound = [self.bind(p, f"{unit}{i}") for i, p in enumerate(members)]
        await self.loop.step()
        return bound

    async def preempt(self, pod: Pod, victims: dict[str, list[str]]) -> dict[str, list[str]]:
        """The preempt verb asked about `pod` with kube-scheduler's victims per node; its
        answer, node -> victims."""
        args = ExtenderPreemptionArgs(
            Pod=pod,
            NodeNameToMetaVictims={
                n: MetaVictims([MetaPod(u) for u in uids]) for n, uids in victims.items()
            },
        )
        answer = await self.verb.preempt(args)
        return {n: [p.UID for p in v.Pods] for n, v in answer.NodeNameToMetaVictims.items()}

    def evicted(self) -> list[str]:
        return [line.split()[1] for line in self.api.log if line.startswith("delete ")]

    def delete(self, pod: Pod) -> None:
        del self.pods[pod.metadata.uid]
        for view in (self.ledger, self.occupancy):
            view.remove_pod(pod.metadata.uid)

    def bind(self, pod: Pod, node_name: str) -> Pod:
        bound = msgspec.structs.replace(
            pod, spec=msgspec.structs.replace(pod.spec, nodeName=node_name)
        )
        self.pods[pod.metadata.uid] = bound
        for view in (self.ledger, self.occupancy):
            view.apply_pod(bound)
        return bound

    def claimed(self, job: str) -> list[str]:
        return sorted(n for n, c in self.occupancy.claims.items() if c.job == ("ns", job))

    def stored(self, job: str) -> list[str]:
        return sorted(n for n, c in self.api.claims.items() if c.spec.job == job)


async def test_a_job_whose_members_all_fit_gets_every_node_at_once() -> None:
    world = World()
    world.job("j", 8)
    await world.loop.step()
    nodes = [f"{u}{i}" for u in "ab" for i in range(4)]
    assert world.claimed("j") == nodes
    assert world.stored("j") == nodes
    assert {c.phase for c in world.occupancy.claims.values()} == {PENDING}
    assert sorted(n for nodes, cause in world.heard if cause == CLAIM_MADE for n in nodes) == nodes
    assert world.occupancy.complete(("ns", "j"))


async def test_two_jobs_racing_for_one_unit_one_gets_it_all_the_other_nothing() -> None:
    world = World(units=1)
    world.job("first", 4)
    world.job("second", 4)
    await world.loop.step()
    assert world.claimed("first") == ["a0", "a1", "a2", "a3"]
    assert world.claimed("second") == []
    assert world.occupancy.shortfalls[("ns", "second")] == (
        "job ns/second needs 1 free UltraServer of 4 nodes for its 4 members, 0 free; "
        "nothing is reserved until all of them fit"
    )


async def test_members_told_their_job_fits_hear_when_another_job_took_the_room() -> None:
    """filter's first refusal of a job without a claim said it fits now; the loop then gave the
    unit to an older job. kube-scheduler asks again only on a cluster event, so the loop tells
    the members itself (their events said "fits now" until then; seen in CI). Once: the next
    steps, with the same reason, say nothing more, and a job never told it fits hears nothing."""
    world = World(units=1)
    rule = UnitPlacement(world.occupancy, lambda pod: Fit(lambda n: None))
    world.job("first", 4)
    second = world.job("second", 4)
    names = [f"a{i}" for i in range(4)]
    _, failed = rule.filter(second[0], names, now=world.now)
    assert "job ns/second fits now (on 4 nodes)" in failed["a0"]
    await world.loop.step()
    assert world.claimed("first") == names
    reason = world.occupancy.shortfalls[("ns", "second")]
    assert reason.startswith("job ns/second needs 1 free UltraServer of 4 nodes")
    assert world.events == [(f"second-{i}", "FailedScheduling", reason) for i in range(4)]
    await world.loop.step()
    await world.loop.step()
    assert len(world.events) == 4
    third = world.job("third", 4)
    await world.loop.step()
    assert ("ns", "third") in world.occupancy.shortfalls
    assert not [e for e in world.events if e[0].startswith("third")]
    _, failed = rule.filter(third[0], names, now=world.now)  # (the loop's word stands)
    assert failed["a0"] == world.occupancy.shortfalls[("ns", "third")]


async def test_a_gated_job_gets_no_claim_and_a_job_outside_kueue_takes_the_free_unit() -> None:
    """Issue 48: Kueue holds a pod group's members back with its scheduling gate until it admits
    the workload. They are not pending: no claim for them (the unit stays free for a job outside
    Kueue), until Kueue lifts the gate; then they wait for a unit like any job."""
    world = World(units=1)
    queued = world.job("queued", 4, gates=[KUEUE_ADMISSION_GATE])  # the oldest
    await world.loop.step()
    assert world.claimed("queued") == [] and world.stored("queued") == []
    assert world.occupancy.jobs() == {}
    world.job("outside", 4)
    await world.loop.step()
    assert world.claimed("outside") == ["a0", "a1", "a2", "a3"]
    assert ("ns", "queued") not in world.occupancy.shortfalls
    for pod in queued:  # admitted: Kueue removes the gate
        world.member("queued", int(pod.metadata.name.rsplit("-", 1)[1]), 4)
    await world.loop.step()
    assert world.claimed("queued") == []
    assert "needs 1 free UltraServer" in world.occupancy.shortfalls[("ns", "queued")]


async def test_a_job_larger_than_what_is_free_waits_then_gets_it_all() -> None:
    world = World()
    others = [world.bind(p, f"b{i}") for i, p in enumerate(world.job("other", 4))]
    await world.loop.step()
    world.job("big", 8)
    await world.loop.step()
    assert world.claimed("big") == []
    assert (
        "needs 2 free UltraServers of 4 nodes for its 8 members, 1 free"
        in (world.occupancy.shortfalls[("ns", "big")])
    )
    for pod in others:
        world.delete(pod)
    await world.loop.step()  # the other job is gone: its claim ends, then big's is written
    await world.loop.step()
    assert len(world.claimed("big")) == 8


async def test_a_conflict_undoes_what_the_attempt_wrote() -> None:
    world = World(units=1)
    stranger = NodeClaim("a2", ("elsewhere", "x"), 4, 4, PENDING, world.now, 60)
    await world.api.create_claim(to_object(stranger))  # one this replica did not see
    world.job("j", 4)
    await world.loop.step()
    assert world.claimed("j") == []
    assert world.stored("j") == []  # a0 and a1 were written, then deleted
    world.api.fail_on = {"a1"}
    del world.api.claims["a2"]
    await world.loop.step()
    assert world.stored("j") == []  # an API error undoes it the same way


async def test_a_pending_claim_ends_when_its_job_does_nothing_and_lives_while_it_works() -> None:
    world = World(units=1)
    members = world.job("j", 4)
    await world.loop.step()
    world.now += 30
    world.filter.filter(members[0], ["a0"], now=world.now)  # kube-scheduler asks: renewed
    await world.loop.step()
    world.now += 45  # 75 s after the claim, 45 s after the renewal
    await world.loop.step()
    assert world.claimed("j") == ["a0", "a1", "a2", "a3"]
    world.now += 60  # nothing asked for a minute
    await world.loop.step()
    assert world.claimed("j") == [] and world.stored("j") == []
    assert sorted(n for nodes, cause in world.heard if cause == CLAIM_ENDED for n in nodes) == [
        "a0", "a1", "a2", "a3",
    ]  # fmt: skip
    await world.loop.step()
    assert world.claimed("j") == []  # not planned for again while nobody asks about it
    world.now += 1
    world.filter.filter(members[1], ["a0"], now=world.now)
    await world.loop.step()
    assert world.claimed("j") == ["a0", "a1", "a2", "a3"]


async def test_a_claim_whose_members_are_all_bound_is_bound_and_does_not_end() -> None:
    world = World(units=1)
    members = world.job("j", 4)
    await world.loop.step()
    for i, pod in enumerate(members):
        world.bind(pod, f"a{i}")
    await world.loop.step()
    assert {c.phase for c in world.occupancy.claims.values()} == {BOUND}
    world.now += 3600
    await world.loop.step()
    assert world.claimed("j") == ["a0", "a1", "a2", "a3"]
    # A member that comes back returns to its job's nodes; the rest keep theirs.
    world.delete(world.pods["j-1"])
    again = world.member("j", 9, 4)
    passed, failed = world.filter.filter(again, ["a0", "a1", "a2", "a3"], now=world.now)
    assert passed == ["a1"] and failed["a0"] == "already runs a member of job ns/j"
    for pod in list(world.pods.values()):
        world.delete(pod)
    await world.loop.step()
    assert world.claimed("j") == []  # the job is gone


async def test_a_job_deleted_before_any_bind_frees_its_unit_for_the_next() -> None:
    world = World(units=1)
    first = world.job("first", 4)
    world.job("second", 4)
    await world.loop.step()
    for pod in first:
        world.delete(pod)
    await world.loop.step()
    await world.loop.step()
    assert world.claimed("second") == ["a0", "a1", "a2", "a3"]


async def test_a_replica_that_is_not_leader_writes_nothing() -> None:
    world = World()
    world.leading = False
    world.job("j", 4)
    await world.loop.step()
    assert world.api.writes == 0
    world.leading = True
    await world.loop.step()
    assert world.api.writes == 4


async def test_a_half_written_claim_is_completed_or_let_go() -> None:
    world = World()
    for name in ("a0", "a1"):  # a crash after two of four nodes
        written = await world.api.create_claim(
            to_object(NodeClaim(name, ("ns", "j"), 4, 4, PENDING, world.now, 60, "my-scheduler"))
        )
        world.occupancy.apply_claim(written)
    world.job("j", 4)
    passed, _ = world.filter.filter(world.pods["j-0"], ["a0", "a1"], now=world.now)
    assert passed == []  # half a claim admits nobody
    await world.loop.step()
    assert world.claimed("j") == ["a0", "a1", "a2", "a3"]
    # Another crash left half a claim on b, whose other nodes another job has now.
    world2 = await left_on_b0_beside_busy_units(World())
    assert world2.claimed("j") == [] and world2.stored("j") == []


async def left_on_b0_beside_busy_units(world: World) -> World:
    """The job's claim on b0 alone (a crash), unit a full and b1 taken, then a step for the job."""
    written = await world.api.create_claim(
        to_object(NodeClaim("b0", ("ns", "j"), 4, 4, PENDING, world.now, 60, "my-scheduler"))
    )
    world.occupancy.apply_claim(written)
    for i, pod in enumerate(world.job("busy", 4)):
        world.bind(pod, f"a{i}")
    world.bind(world.member("busy2", 0, 1), "b1")
    world.job("j", 4)
    await world.loop.step()
    return world


async def test_a_half_written_claim_the_new_plan_leaves_out_is_let_go() -> None:
    """A crash left the job's claim on b0 alone; unit b can no longer hold the job, unit c can.
    The job claims c and lets b0 go: kept, b0 passed the rule beside the whole unit c, a member
    landed there (the job split over two UltraServers) and b was held for nothing."""
    world = await left_on_b0_beside_busy_units(World(units=3))
    assert world.claimed("j") == ["c0", "c1", "c2", "c3"]
    assert world.stored("j") == ["c0", "c1", "c2", "c3"]


async def test_claims_under_running_members_are_kept_when_their_unit_stops_being_whole() -> None:
    """A job runs on units a and b; a replacement node joins b's UltraServer (5 nodes: no unit
    any more) and one member is recreated. The plan goes to unit c, and what lies outside it is
    let go, but never the claims under running members: released, those members ran outside any
    claim, the job's claim never went Bound again, and when it expired every claim of the job
    ended (found by the review of the change that lets go what lies outside a plan)."""
    world = World(units=3)
    members = world.job("j", 8)
    await world.loop.step()
    bound = [
        world.bind(p, f"{u}{i}")
        for (u, i), p in zip([(u, i) for u in "ab" for i in range(4)], members, strict=True)
    ]
    await world.loop.step()
    world.delete(bound[7])  # on b3: its controller makes it again
    again = world.member("j", 8, 8)
    labels = {PREFIX + "mode": "1_2_4", PREFIX + "server-id-4": "b" * 16}
    for view in (world.ledger, world.occupancy):
        view.apply_node(node("b4", "trn2u.48xlarge", labels=labels))
    await world.loop.step()
    kept = ["a0", "a1", "a2", "a3", "b0", "b1", "b2"]
    assert set(kept) <= set(world.claimed("j")), world.claimed("j")
    world.bind(again, "c0")  # where the rule sends it
    await world.loop.step()
    world.now += 61
    await world.loop.step()
    assert set(kept) <= set(world.claimed("j")), world.claimed("j")


async def test_claims_of_another_schedulers_jobs_are_its_extenders_to_tend() -> None:
    world = World()
    written = await world.api.create_claim(
        to_object(NodeClaim("a0", ("ns", "theirs"), 1, 1, PENDING, world.now - 600, 60, "other"))
    )
    world.occupancy.apply_claim(written)
    await world.loop.step()  # expired, no member seen: still not ours to end
    assert world.claimed("theirs") == ["a0"]


async def test_a_step_with_many_waiting_jobs_stays_cheap() -> None:
    """100 UltraServers, 95 of them busy, 20 jobs of 32 members waiting: what a step costs is
    printed (the loop runs a step per burst of changes, in the event loop); the plans' answer is
    checked."""
    world = World(units=0)
    nodes = []
    for unit in range(100):
        labels = {PREFIX + "mode": "1_2_4", PREFIX + "server-id-4": f"{unit:016x}"}
        nodes += [node(f"u{unit}-{i}", "trn2u.48xlarge", labels=labels) for i in range(4)]
    for view in (world.ledger, world.occupancy):
        view.replace_nodes(nodes)
    for unit in range(95):
        for i, pod in enumerate(world.job(f"busy{unit}", 4)):
            world.bind(pod, f"u{unit}-{i}")
    for j in range(20):
        world.job(f"big{j}", 32)
    started = time.perf_counter()
    await world.loop.step()
    print(f"\nstep with 20 waiting jobs on 100 UltraServers: {time.perf_counter() - started:.4f}s")
    assert (
        "needs 8 free UltraServers of 4 nodes for its 32 members, 5 free"
        in (world.occupancy.shortfalls[("ns", "big0")])
    )


def without_size(pod: Pod) -> Pod:
    """The pod as an MPIJob's controller makes it: no size anywhere on it."""
    annotations = dict(pod.metadata.annotations)
    annotations.pop("neuron-scheduler.io/gang-size", None)
    return msgspec.structs.replace(
        pod, metadata=msgspec.structs.replace(pod.metadata, annotations=annotations)
    )


async def test_a_job_seen_growing_gets_its_claim_grown() -> None:
    """A job that says no size is as large as its members seen: when more arrive after its
    claim, the claim grows (all or nothing for the new units)."""
    world = World()
    first = without_size(world.member("j", 0, 1))
    world.occupancy.apply_pod(first)
    await world.loop.step()
    assert world.claimed("j") == ["a0", "a1", "a2", "a3"]
    for i in range(1, 8):
        world.occupancy.apply_pod(without_size(world.member("j", i, 1)))
    await world.loop.step()
    assert world.claimed("j") == [f"{u}{i}" for u in "ab" for i in range(4)]
    assert world.occupancy.complete(("ns", "j")) and world.occupancy.claimed_size(("ns", "j")) == 8


async def test_a_claim_this_extender_cannot_read_keeps_its_node_and_no_loop_fights_it() -> None:
    world = World()
    odd = to_object(NodeClaim("a2", ("ns", "x"), 4, 4, PENDING, world.now, 60, "my-scheduler"))
    odd.spec.node = "elsewhere"  # the schema allows it; this extender could not have written it
    world.occupancy.apply_claim(await world.api.create_claim(odd))
    world.job("j", 4)
    writes = world.api.writes
    for _ in range(3):
        await world.loop.step()
    assert world.claimed("j") == ["b0", "b1", "b2", "b3"]  # unit a is not free, b is
    assert world.api.writes == writes + 4  # written once, not fought over every step
    passed, failed = world.filter.filter(world.member("k", 0, 1), ["a2"], now=world.now)
    assert passed == [] and "cannot read" in failed["a2"]


async def test_why_a_job_waits_is_forgotten_when_the_job_goes() -> None:
    world = World(units=1)
    busy = [world.bind(p, f"a{i}") for i, p in enumerate(world.job("busy", 4))]
    big = world.job("big", 8)
    await world.loop.step()
    assert ("ns", "big") in world.occupancy.shortfalls
    for pod in big:
        world.delete(pod)
    await world.loop.step()
    assert ("ns", "big") not in world.occupancy.shortfalls and busy


# --- issue 40: preemption moves whole jobs, or nothing ----------------------------------------


async def three_low_jobs(world: World) -> list[list[Pod]]:
    """low0, low1, low2 (priority 10) on units a, b, c, started an hour apart: low2 is the
    youngest (the least work lost)."""
    return [
        await world.running(f"low{k}", unit, priority=10, started=f"2026-01-01T0{k}:00:00Z")
        for k, unit in enumerate("abc")
    ]


def uids(*jobs: list[Pod]) -> list[str]:
    return sorted(p.metadata.uid for job in jobs for p in job)


async def test_a_job_of_higher_priority_takes_the_youngest_whole_jobs_claim_first() -> None:
    world = World(units=3)
    _, low1, low2 = await three_low_jobs(world)
    big = world.job("big", 8, priority=1000)
    # kube-scheduler's own victims: one member on each full node it found; none is answered.
    assert await world.preempt(big[0], {f"{u}{i}": [f"low{k}-{i}"] for k, u in enumerate("abc")
                                        for i in range(4)}) == {}  # fmt: skip
    assert ("ns", "big") in world.occupancy.preemption_asks
    await world.loop.step()
    nodes = [f"{u}{i}" for u in "bc" for i in range(4)]
    assert world.claimed("big") == nodes
    assert {tuple(sorted(world.occupancy.claims[n].victims)) for n in nodes} == {
        tuple(uids(low1, low2))
    }
    assert sorted(world.evicted()) == uids(low1, low2)  # whole, both; none of low0
    first_eviction = next(i for i, line in enumerate(world.api.log) if line.startswith("mark"))
    assert all(line.startswith("claim") for line in world.api.log[:first_eviction])
    assert [line for line in world.api.log[:first_eviction] if line.endswith(" big")] == [
        f"claim {n} big" for n in nodes
    ]
    assert world.claimed("low0") == ["a0", "a1", "a2", "a3"]
    assert sorted(name for name, reason, _ in world.events if reason == "Preempted") == sorted(
        p.metadata.name for p in low1 + low2
    )
    # The victims leave; big's members fill b before c.
    for pod in low1 + low2:
        world.delete(pod)
    passed, failed = world.filter.filter(big[0], nodes, now=world.now)
    assert passed == nodes[:4]  # one unit at a time: the lowest server id while none has any
    world.bind(big[0], "c0")
    passed, failed = world.filter.filter(big[1], nodes, now=world.now)
    assert passed == ["c1", "c2", "c3"], failed
    assert "fills UltraServer " + "c" * 16 + " first" in failed["b0"]


async def test_a_job_that_cannot_fit_with_every_lower_job_gone_evicts_nobody() -> None:
    world = World(units=3)
    await three_low_jobs(world)
    huge = world.job("huge", 16, priority=1000)
    assert await world.preempt(huge[0], {"a0": ["low0-0"], "b0": ["low1-0"]}) == {}
    assert ("ns", "huge") in world.occupancy.preemption_asks  # the loop works it out
    await world.loop.step()
    assert ("ns", "huge") not in world.occupancy.preemption_asks
    await world.loop.step()
    assert world.evicted() == [] and world.claimed("huge") == []
    why = world.occupancy.shortfalls[("ns", "huge")]
    assert why.startswith("job ns/huge can never run here: it needs 4 UltraServers of 4 nodes")
    # Its members hear it although kube-scheduler, every node being full, never asks filter.
    told = [(name, reason) for name, reason, text in world.events if text == why]
    assert told == [(p.metadata.name, "FailedScheduling") for p in huge]  # once each
    # A job that fits the fleet, but not with a unit of higher priority in the way: nobody.
    world = World(units=3)
    await world.running("vip", "a", priority=5000)
    await world.running("low1", "b", priority=10)
    await world.running("low2", "c", priority=10)
    wide = world.job("wide", 12, priority=1000)
    assert await world.preempt(wide[0], {"b0": ["low1-0"], "c0": ["low2-0"]}) == {}
    await world.loop.step()
    assert world.evicted() == []
    member = member_of(wide[0])
    assert member is not None
    planned = preemption_for(world.ledger, world.occupancy, wide[0], member, 4, world.now)
    assert isinstance(planned, Shortfall)
    assert planned.reason == (
        "job ns/wide needs 3 UltraServers of 4 nodes for its 12 members; with every job and "
        "pod of lower priority evicted there would be 2: no preemption"
    )


async def test_a_pod_of_no_job_never_evicts_a_member() -> None:
    """kube-scheduler evicts on one node only: a job would lose a member, not go whole. Pods of
    no job stay its victims."""
    world = World(units=2)
    await world.running("low", "a", priority=10)
    loose = pod_json("loose", {NEURON: 16}, namespace="ns", node="b0", uid="loose-0")
    loose["spec"]["priority"] = 10
    for view in (world.ledger, world.occupancy):
        view.apply_pod(msgspec.convert(loose, Pod))
    body = pod_json("solo", {NEURON: 16}, namespace="ns", uid="solo")
    body["spec"]["priority"] = 1000
    solo = msgspec.convert(body, Pod)
    answer = await world.preempt(solo, {"a0": ["low-0"], "b0": ["loose-0"]})
    assert answer == {"b0": ["loose-0"]}
    await world.loop.step()
    assert world.evicted() == []  # (the extender evicts nothing itself for a pod of no job)


async def test_a_restart_finishes_the_evictions_a_preemption_began() -> None:
    world = World(units=3)
    _, low1, low2 = await three_low_jobs(world)
    big = world.job("big", 8, priority=1000)
    world.api.fail_deletes = {"low2-1", "low2-3"}
    await world.preempt(big[0], {"a0": ["low0-0"]})
    await world.loop.step()
    assert sorted(world.evicted()) == sorted(set(uids(low1, low2)) - {"low2-1", "low2-3"})
    world.api.fail_deletes = set()
    world.loop = world.restarted()  # a new leader: only the claims say what is going on
    await world.loop.step()
    assert sorted(world.evicted()) == uids(low1, low2)
    await world.loop.step()
    assert sorted(world.evicted()) == uids(low1, low2)  # each once


async def test_a_preempting_claim_lives_while_its_victims_leave() -> None:
    world = World(units=3)
    _, low1, low2 = await three_low_jobs(world)
    big = world.job("big", 8, priority=1000)
    await world.preempt(big[0], {"a0": ["low0-0"]})
    world.grace = 3600
    await world.loop.step()
    world.now += 600  # victims with a long grace period; nobody asks about big meanwhile
    await world.loop.step()
    assert len(world.claimed("big")) == 8
    for pod in low1 + low2:
        world.delete(pod)
    await world.loop.step()
    world.now += 59
    await world.loop.step()
    assert len(world.claimed("big")) == 8  # claim_seconds from when its victims were last there
    world.now += 2
    await world.loop.step()
    assert world.claimed("big") == []


async def test_a_conflict_while_taking_units_gives_them_back_and_evicts_nobody() -> None:
    world = World(units=3)
    await three_low_jobs(world)
    big = world.job("big", 8, priority=1000)
    await world.preempt(big[0], {"a0": ["low0-0"]})
    changed = world.api.claims["c1"]  # written by someone else since the watch showed it
    changed.metadata.resourceVersion = "999"
    await world.loop.step()
    assert world.evicted() == []
    assert [c.spec.job for n, c in sorted(world.api.claims.items()) if n[0] == "b"] == ["low1"] * 4
    assert world.claimed("low1") == ["b0", "b1", "b2", "b3"]


async def test_a_pending_claim_ends_claim_seconds_after_the_last_ask() -> None:
    """kube-scheduler asks about a member every 10 s for 50 s, then no more: the claim ends 60 s
    after the last ask (it ended 110 s after it before: renewals counted from themselves)."""
    world = World(units=1)
    members = world.job("j", 4)
    await world.loop.step()
    start, ended = world.now, None
    for tick in range(1, 25):
        world.now = start + 10 * tick
        if world.now <= start + 50:
            world.filter.filter(members[0], ["a0"], now=world.now)
        await world.loop.step()
        if ended is None and not world.claimed("j"):
            ended = world.now - start
    assert ended == 110  # the last ask at 50 s, claim_seconds 60


async def test_status_says_how_far_an_incomplete_job_is() -> None:
    world = World(units=2)
    members = world.job("j", 8)
    await world.loop.step()
    world.bind(members[0], "b2")
    everywhere = [f"{u}{n}" for u in "ab" for n in range(4)]
    for member in members[1:4]:
        passed, _ = world.filter.filter(member, everywhere, now=world.now)
        world.bind(member, passed[0])
    assert sorted(w.node for w in world.occupancy.job_workers(("ns", "j"))) == [
        "b0", "b1", "b2", "b3",
    ]  # fmt: skip
    text = job_progress(world.occupancy, ("ns", "j"), world.now)
    assert text is not None and text.startswith(
        f"job ns/j has 4 of its 8 members, holding UltraServers {'a' * 16}, {'b' * 16} since "
        "2026-01-01T00:00:00Z ("
    )


class Stop(BaseException):
    """Ends the loop under test (a cancel may be lost in Python 3.11's asyncio.wait_for when
    the signal it waits for is set in the same turn)."""


async def test_the_loop_outlives_a_failing_step_and_joins_a_burst_of_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(reserving, "TICK", 0.05)
    monkeypatch.setattr(reserving, "COALESCE", 0.02)
    world = World(units=1)
    steps: list[int] = []
    stop = False

    async def step() -> None:
        steps.append(len(steps))
        if len(steps) == 1:
            raise RuntimeError("a bug")
        if stop:
            raise Stop()

    world.loop.step = step  # type: ignore[method-assign]
    world.loop.ready.set()
    task = asyncio.create_task(world.loop.run())
    while len(steps) < 3:  # steps after the one that failed
        await asyncio.sleep(0.01)
    before, stop = len(steps), True
    for _ in range(20):  # a burst of changes: one step
        world.loop.changed()
    with pytest.raises(Stop):
        await task
    assert len(steps) == before + 1


def test_a_kueue_workloads_claim_lets_go_what_a_crash_left_outside_its_plan() -> None:
    """Half a claim left on unit b (b0) by a crash is not renewed for the workload planned on
    unit a: it is let go, so the workload's members cannot split over a and b."""
    world = World()
    job = ("ml", "llama")
    left = NodeClaim("b0", job, 4, 4, PENDING, world.now, 60, "my-scheduler")
    world.occupancy.apply_claim(asyncio.run(world.api.create_claim(to_object(left))))
    planned = Planned({f"a{i}": 1 for i in range(4)}, 4, "")
    assert asyncio.run(world.loop.claim_for_workload(job, "my-scheduler", 4, planned, "w1", 90))
    assert sorted(world.occupancy.claimed(job)) == ["a0", "a1", "a2", "a3"]
    assert sorted(world.api.claims) == ["a0", "a1", "a2", "a3"]


def test_claims_for_a_kueue_workload_name_it_renew_the_jobs_own_and_are_undone_on_an_error() -> (
    None
):
    """The placement check claims a job's units before any member exists (Pending, naming the
    workload, lasting the hold's seconds); nodes the job holds already are written again so. A
    write that fails undoes what was written: no claim is left half made."""
    world = World()
    job = ("ml", "llama")
    planned = Planned({f"a{i}": 1 for i in range(4)}, 4, "")
    made = asyncio.run(world.loop.claim_for_workload(job, "my-scheduler", 4, planned, "w1", 90))
    assert made
    claims = {n: world.occupancy.claims[n] for n in world.occupancy.claimed(job)}
    assert sorted(claims) == ["a0", "a1", "a2", "a3"]
    assert all(
        c.workload == "w1" and c.seconds == 90 and c.phase == PENDING for c in claims.values()
    )
    again = asyncio.run(world.loop.claim_for_workload(job, "my-scheduler", 4, planned, "w2", 60))
    assert again and all(world.occupancy.claims[n].workload == "w2" for n in claims)
    other = ("ml", "other")
    world.api.fail_on = {"b2"}
    unit_b = Planned({f"b{i}": 1 for i in range(4)}, 4, "")
    failed = asyncio.run(world.loop.claim_for_workload(other, "my-scheduler", 4, unit_b, "w3", 60))
    assert not failed
    assert not world.occupancy.claimed(other)
    assert sorted(world.api.claims) == ["a0", "a1", "a2", "a3"]


def test_the_placement_check_refuses_a_pin_to_a_claim_its_workload_would_let_go() -> None:
    """Kueue's topology assignment pins a member to b0, which a crash left claimed for the job
    beside busy units; the plan is unit c, and the workload's claim lets b0 go. Accepted, the
    member pinned there could never land, and the workload would time out into a retry."""
    world = World(units=3)
    job = ("ml", "k")  # a job of a Kueue workload: no member exists yet
    left = NodeClaim("b0", job, 4, 4, PENDING, world.now, 60, "my-scheduler")
    world.occupancy.apply_claim(asyncio.run(world.api.create_claim(to_object(left))))
    for i, pod in enumerate(world.job("busy", 4)):
        world.bind(pod, f"a{i}")
    world.bind(world.member("busy2", 0, 1), "b1")
    template = pod_json(
        "x",
        {NEURON: 16},
        labels={"training.kubeflow.org/job-name": "k", "training.kubeflow.org/job-role": "worker"},
        annotations={"neuron-scheduler.io/gang-size": "4"},
    )
    flavors = {"trn2u": ({"node.kubernetes.io/instance-type": "trn2u.48xlarge"}, [])}

    def asked(*hosts: str) -> Placed | NotPlaced:
        pinned = {
            "levels": ["kubernetes.io/hostname"],
            "slices": [
                {
                    "domainCount": len(hosts),
                    "valuesPerLevel": [{"individual": {"roots": list(hosts)}}],
                    "podCounts": {"universal": 1},
                }
            ],
        }
        assignment = {"name": "w", "flavors": {NEURON: "trn2u"}, "count": 4}
        body = {
            "metadata": {"name": "w", "namespace": "ml", "uid": "w1", "resourceVersion": "7"},
            "spec": {
                "podSets": [
                    {
                        "name": "w",
                        "count": 4,
                        "template": {
                            "metadata": {
                                "labels": template["metadata"]["labels"],
                                "annotations": template["metadata"]["annotations"],
                            },
                            "spec": template["spec"],
                        },
                    }
                ]
            },
            "status": {
                "conditions": [{"type": "QuotaReserved", "status": "True"}],
                "admission": {
                    "clusterQueue": "cq",
                    "podSetAssignments": [{**assignment, "topologyAssignment": pinned}],
                },
            },
        }
        workload = msgspec.convert(body, Workload)
        return place(
            workload, flavors, world.ledger, world.occupancy, Policy.BEST_FIT, {"my-scheduler"}
        )

    placed = asked("c0", "c1", "c2", "c3")
    assert isinstance(placed, Placed), placed
    assert [sorted(u.planned.nodes) for u in placed.jobs] == [["c0", "c1", "c2", "c3"]]
    refused = asked("b0", "c1", "c2", "c3")
    assert isinstance(refused, NotPlaced)
    assert "pins members of job ml/k to b0, which are not among the units" in refused.reason
