"""The reservation loop on an in-memory UltraServerClaim API that keeps kube-apiserver's rules: a
create of a name that exists is a 409, a replace or delete conditioned on a resourceVersion (or
uid) that no longer holds is a 409, and every write bumps the resourceVersion."""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgspec

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON
from neuron_scheduler.extender.loops.reserving import Reservations
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.objects import Pod, UltraServerClaim
from neuron_scheduler.ultraserver.claims import BOUND, PENDING, NodeClaim, to_object
from neuron_scheduler.ultraserver.placement import CLAIM_ENDED, CLAIM_MADE, Occupancy, UnitPlacement
from tests.builders import node, pod_json

PREFIX = "neuron.amazonaws.com/ultraserver-"


class FakeClaims:
    def __init__(self) -> None:
        self.claims: dict[str, UltraServerClaim] = {}
        self.version = itertools.count(1)
        self.uids = itertools.count(1)
        self.writes = 0
        self.fail_on: set[str] = set()  # names whose create fails with a 500

    def _stamp(self, claim: UltraServerClaim, uid: str) -> UltraServerClaim:
        stored = msgspec.convert(msgspec.to_builtins(claim), UltraServerClaim)
        stored.metadata.resourceVersion = str(next(self.version))
        stored.metadata.uid = uid
        self.claims[stored.metadata.name] = stored
        self.writes += 1
        return msgspec.convert(msgspec.to_builtins(stored), UltraServerClaim)

    async def create_claim(self, claim: UltraServerClaim) -> UltraServerClaim:
        name = claim.metadata.name
        if name in self.fail_on:
            raise api_error("POST", name, 500, b'{"message": "injected"}')
        if name in self.claims:
            raise api_error("POST", name, 409, b'{"reason": "AlreadyExists"}')
        return self._stamp(claim, f"uid-{next(self.uids)}")

    async def replace_claim(self, claim: UltraServerClaim) -> UltraServerClaim:
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
        self.now = 1_000_000.0
        self.api = FakeClaims()
        self.ledger = Ledger(Catalog.builtin())
        self.occupancy = Occupancy()
        self.filter = UnitPlacement(self.occupancy)
        self.heard: list[tuple[tuple[str, ...], str]] = []
        self.occupancy.on_freed = lambda nodes, cause: self.heard.append((tuple(nodes), cause))
        self.leading = True
        self.loop = Reservations(
            self.api,
            self.occupancy,
            self.filter,
            self.ledger,
            ["my-scheduler"],
            60,
            is_leader=lambda: self.leading,
            wall_clock=lambda: self.now,
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

    def member(self, job: str, index: int, size: int, node_name: str = "", **kwargs: Any) -> Pod:
        body = pod_json(
            f"{job}-{index}",
            {NEURON: 16},
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
        pod = msgspec.convert(body, Pod)
        self.pods[pod.metadata.uid] = pod
        for view in (self.ledger, self.occupancy):
            view.apply_pod(pod)
        return pod

    def job(self, job: str, size: int, **kwargs: Any) -> list[Pod]:
        return [self.member(job, i, size, **kwargs) for i in range(size)]

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
    world2 = World()
    written = await world2.api.create_claim(
        to_object(NodeClaim("b0", ("ns", "j"), 4, 4, PENDING, world2.now, 60, "my-scheduler"))
    )
    world2.occupancy.apply_claim(written)
    for i, pod in enumerate(world2.job("busy", 4)):
        world2.bind(pod, f"a{i}")
    world2.bind(world2.member("busy2", 0, 1), "b1")
    world2.job("j", 4)
    await world2.loop.step()
    assert world2.claimed("j") == [] and world2.stored("j") == []


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
