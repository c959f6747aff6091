"""Preemption for training jobs as the reservation loop carries it out, where it can go wrong
(an independent review of issue 40): a victim job's member binding while the claim is written, a
crash between the claim and the evictions, failed devices, a caller the extender should not
trust, victims that never leave, and evictions the watch has not shown yet. The world is
tests/unit/test_reserving.py's: the preempt verb and the loop on an in-memory claim API."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import msgspec
import pytest

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON
from neuron_scheduler.extender.state.members import preemption_for
from neuron_scheduler.extender.verbs.wire import ExtenderBindingArgs
from neuron_scheduler.extender.wiring import wire
from neuron_scheduler.jobs.claims import PENDING, NodeClaim, to_object
from neuron_scheduler.jobs.members import member_of
from neuron_scheduler.jobs.placement import Shortfall
from neuron_scheduler.jobs.preemption import Preemption
from neuron_scheduler.kube.errors import api_error
from neuron_scheduler.kube.objects import JobClaim, Pod
from tests.builders import node, pod_json
from tests.podapi import FakeAPI
from tests.unit.test_reserving import PREFIX, World, three_low_jobs, uids


def unit_labels(unit: str) -> dict[str, str]:
    return {PREFIX + "mode": "1_2_4", PREFIX + "server-id-4": unit * 16}


async def test_preemption_never_takes_a_unit_a_failed_device_keeps_its_members_off() -> None:
    """c0's device 3 failed: a member asking for all 16 devices can never run there, so evicting
    low2 (the youngest, the cheapest otherwise) would free nothing big can use."""
    world = World(units=3)
    low0, low1, low2 = await three_low_jobs(world)
    world.ledger.apply_node(node("c0", "trn2u.48xlarge", labels=unit_labels("c"), failed=[3]))
    big = world.job("big", 8, priority=1000)
    member = member_of(big[0])
    assert member is not None
    planned = preemption_for(world.ledger, world.occupancy, big[0], member, 4, world.now)
    assert isinstance(planned, Preemption)
    assert not any(n.startswith("c") for n in planned.nodes), planned.nodes
    await world.preempt(big[0], {"a0": ["low0-0"]})
    await world.loop.step()
    assert world.claimed("big") == [f"{u}{i}" for u in "ab" for i in range(4)]
    assert sorted(world.evicted()) == uids(low0, low1)  # low2 keeps running on c
    assert world.claimed("low2") == ["c0", "c1", "c2", "c3"] and low2


def test_preemption_on_nodes_of_their_own_counts_what_each_node_takes() -> None:
    """Nodes of their own take as many 4-device members as they have free blocks: x and y four,
    z three (its device 3 failed). Three low jobs of 3 members, one job a node, z's the oldest.
    An 8-member job needs x and y: two jobs evicted, not three (counting every node as the
    smallest, it asked for 8 / 3 rounded up = 3 nodes)."""
    world = World(units=0)
    nodes = [node(n, "trn2.48xlarge") for n in "xy"] + [node("z", "trn2.48xlarge", failed=[3])]
    for view in (world.ledger, world.occupancy):
        view.replace_nodes(nodes)
    for k, where in enumerate("zxy"):
        for i in range(3):
            started = f"2026-01-01T0{k}:00:00Z"
            world.member(f"low{k}", i, 3, where, priority=10, started=started, devices=4)
    big = world.job("big", 8, priority=1000, devices=4)
    member = member_of(big[0])
    assert member is not None
    planned = preemption_for(world.ledger, world.occupancy, big[0], member, 1, world.now)
    assert isinstance(planned, Preemption)
    assert (planned.nodes, planned.slots) == (("x", "y"), (4, 4))
    assert sorted(j[1] for j in planned.jobs) == ["low1", "low2"]
    assert sorted(planned.victims) == [f"low{k}-{i}" for k in (1, 2) for i in range(3)]


async def test_a_victim_the_api_server_will_not_delete_stops_the_preemption_before_any_eviction(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An admission policy refuses deleting one member of low2: evicting low1 and the rest of
    low2 first, then failing on it until the claim ended, left low2 partly evicted and its
    units held for nothing. A dry run of each deletion comes first; with one refused, nobody
    is evicted and nothing is claimed, and the log says which pod and why."""
    caplog.set_level(logging.INFO, "neuron_scheduler.extender.reserving")
    world = World(units=3)
    _, low1, low2 = await three_low_jobs(world)
    world.api.refuse_deletes = {"low2-2"}
    big = world.job("big", 8, priority=1000)
    await world.preempt(big[0], {"a0": ["low0-0"]})
    await world.loop.step()
    assert world.evicted() == [] and world.claimed("big") == []
    assert world.claimed("low2") == ["c0", "c1", "c2", "c3"]
    assert "the API server refuses to delete ns/low2-2: DELETE low2-2: HTTP 400: denied" in (
        caplog.text
    )
    # Asked again at once: the refusal is believed for a while, and nothing is asked again.
    world.api.dry_runs = []
    await world.preempt(big[0], {"a0": ["low0-0"]})
    await world.loop.step()
    assert world.evicted() == [] and world.api.dry_runs == []
    # Allowed again: the next ask after that preempts, each victim asked as a dry run first.
    world.api.refuse_deletes = set()
    world.now += 6
    await world.preempt(big[0], {"a0": ["low0-0"]})
    await world.loop.step()
    assert sorted(world.evicted()) == uids(low1, low2)
    assert sorted(world.api.dry_runs) == uids(low1, low2)
    # The steps after evict nobody again and ask nothing: the victims are leaving.
    world.api.dry_runs = []
    await world.loop.step()
    await world.loop.step()
    assert sorted(world.evicted()) == uids(low1, low2) and world.api.dry_runs == []


async def test_a_victim_refused_once_evictions_began_stops_them_and_keeps_the_claim(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """low2-2's deletion fails with a 500 (the dry run too: nothing refused), the others go.
    Then an admission policy comes to protect it: nobody more is evicted while it refuses (its
    job is half gone already; the claim waits, it cannot be used while low2-2 holds c2), and
    once the policy goes, it is evicted too."""
    caplog.set_level(logging.INFO, "neuron_scheduler.extender.reserving")
    world = World(units=3)
    _, low1, low2 = await three_low_jobs(world)
    world.api.fail_deletes = {"low2-2"}
    big = world.job("big", 8, priority=1000)
    await world.preempt(big[0], {"a0": ["low0-0"]})
    await world.loop.step()
    gone = sorted(set(uids(low1, low2)) - {"low2-2"})
    assert sorted(world.evicted()) == gone
    world.api.fail_deletes, world.api.refuse_deletes = set(), {"low2-2"}
    await world.loop.step()
    assert sorted(world.evicted()) == gone and world.claimed("big")
    assert "nobody more is evicted while it is refused" in caplog.text
    world.api.refuse_deletes = set()
    world.now += 6
    await world.loop.step()
    assert sorted(world.evicted()) == uids(low1, low2)


async def test_victims_are_evicted_once_when_the_watch_shows_them_leaving_late() -> None:
    world = World(units=3)
    _, low1, low2 = await three_low_jobs(world)
    world.api.on_delete = None  # the watch is later than the next steps
    big = world.job("big", 8, priority=1000)
    await world.preempt(big[0], {"a0": ["low0-0"]})
    for _ in range(3):
        await world.loop.step()
    assert sorted(world.evicted()) == uids(low1, low2)  # each once
    marks = [line for line in world.api.log if line.startswith("mark ")]
    assert len(marks) == 8
    preempted = [name for name, reason, _ in world.events if reason == "Preempted"]
    assert sorted(preempted) == uids(low1, low2)


class Crash(BaseException):
    """The extender killed where it stands."""


def crash_at(world: World, write: int) -> None:
    """The extender dies as it sends the `write`th claim replacement."""
    replace = world.api.replace_claim
    writes: list[str] = []

    async def crashing(claim: JobClaim) -> JobClaim:
        writes.append(claim.metadata.name)
        if len(writes) == write:
            world.api.replace_claim = replace  # type: ignore[method-assign]
            raise Crash()
        return await replace(claim)

    world.api.replace_claim = crashing  # type: ignore[method-assign]


async def crashed_mid_claim(world: World) -> tuple[list[Pod], list[Pod]]:
    """low0, low1, low2 run; big (8 members) preempts; the extender dies as it writes the
    second node of big's claim. low1 and low2."""
    _, low1, low2 = await three_low_jobs(world)
    big = world.job("big", 8, priority=1000)
    await world.preempt(big[0], {"a0": ["low0-0"]})
    crash_at(world, 2)
    with pytest.raises(Crash):
        await world.loop.step()
    return low1, low2


async def test_a_restart_after_a_crash_mid_claim_evicts_nobody_before_the_claim_is_whole() -> None:
    world = World(units=3)
    low1, low2 = await crashed_mid_claim(world)
    assert world.stored("big") == ["b0"]  # half a claim, its victims listed on it
    world.loop = world.restarted()  # it lists the claims as they are
    world.occupancy.replace_claims(list(world.api.claims.values()))
    # Then another writer changes c1 (the watch has not shown it yet): the plan the new leader
    # makes cannot be written whole.
    world.api.claims["c1"].metadata.resourceVersion = "999"
    mark = len(world.api.log)
    await world.loop.step()
    assert world.evicted() == [], world.api.log[mark:]
    # The watch shows c1 as it is now: the claim is completed, and only then are they evicted.
    world.occupancy.apply_claim(world.api.claims["c1"])
    await world.loop.step()
    assert len(world.claimed("big")) == 8
    assert sorted(world.evicted()) == uids(low1, low2)
    after = world.api.log[mark:]
    first = next(i for i, line in enumerate(after) if line.startswith("mark "))
    assert {line.split()[1] for line in after[:first] if line.endswith(" big")} == {
        f"{u}{i}" for u in "bc" for i in range(4)
    }


async def test_half_a_claim_a_crash_left_is_planned_again_and_its_victims_only_if_needed() -> None:
    """The crash left c0 claimed for big with low2's members listed to evict; by the restart,
    low1 has finished, so b and d are free: big takes them, c0 is let go, nobody is evicted."""
    world = World(units=4)
    low1, low2 = await crashed_mid_claim(world)
    assert world.stored("big") == ["c0"]
    for pod in low1:
        world.delete(pod)
    world.loop = world.restarted()
    world.occupancy.replace_claims(list(world.api.claims.values()))
    await world.loop.step()
    await world.loop.step()
    assert world.claimed("big") == [f"{u}{i}" for u in "bd" for i in range(4)]
    assert world.evicted() == [] and len(low2) == 4


async def low2_partly_bound_and_big_asking(world: World) -> list[Pod]:
    """low0 and low1 run on units a and b; low2 (4 members) holds its claim on unit c with one
    member bound on c0; big (8 members, priority 1000) has been through the preempt verb. The
    members of low2."""
    await world.running("low0", "a", priority=10, started="2026-01-01T00:00:00Z")
    await world.running("low1", "b", priority=10, started="2026-01-01T01:00:00Z")
    low2 = world.job("low2", 4, priority=10, started="2026-01-01T02:00:00Z")
    await world.loop.step()
    assert world.claimed("low2") == ["c0", "c1", "c2", "c3"]
    world.bind(low2[0], "c0")
    big = world.job("big", 8, priority=1000)
    await world.preempt(big[0], {"a0": ["low0-0"]})
    return low2


# --- a victim job's members binding while the claim is written ---------------------------------


@pytest.mark.parametrize("refused", [False, True], ids=["deletable", "refused"])
async def test_a_victim_jobs_member_bound_while_the_claim_is_written_is_evicted_with_it(
    refused: bool,
) -> None:
    """low2 has 1 of its 4 members bound when big's preemption is planned; kube-scheduler binds
    a second (filtered before) while the claim is written. Each node is held for big as soon
    as its claim is written (filter and bind refuse it to low2 from then on), and the victims
    are worked out again once the claim is whole: low2 goes whole, the late one too. Its
    deletion is asked as a dry run first, as the plan's victims' were: refused, the attempt is
    undone and nobody is evicted."""
    world = World(units=3)
    low2 = await low2_partly_bound_and_big_asking(world)
    replace = world.api.replace_claim
    admitted: dict[str, bool] = {}

    async def racing(claim: JobClaim) -> JobClaim:
        if claim.metadata.name == "c1":  # b0..b3 and c0 are written: c0 is big's already
            admitted["c0"] = world.filter.admits(low2[2], "c0", world.now)
            admitted["c2"] = world.filter.admits(low2[2], "c2", world.now)
            world.bind(low2[1], "c1")  # its bind, admitted before, lands meanwhile
        return await replace(claim)

    world.api.replace_claim = racing  # type: ignore[method-assign]
    if refused:
        world.api.refuse_deletes = {"low2-1"}
    await world.loop.step()
    # From the first node taken, low2's claim is not whole: none of its members is admitted.
    assert admitted == {"c0": False, "c2": False}
    if refused:
        assert world.evicted() == [] and world.claimed("big") == []
        assert world.claimed("low1") == ["b0", "b1", "b2", "b3"]
        assert world.claimed("low2") == ["c0", "c1", "c2", "c3"]
        return
    assert world.claimed("big") == [f"{u}{i}" for u in "bc" for i in range(4)]
    assert "low2-1" in world.evicted()
    assert sorted(world.evicted()) == sorted([f"low1-{i}" for i in range(4)] + ["low2-0", "low2-1"])
    # The claim lists the jobs evicted whole: a new leader works the victims out the same way.
    assert {world.occupancy.claims["b0"].victim_jobs} == {(("ns", "low1"), ("ns", "low2"))}


async def test_a_new_leader_evicts_a_victim_jobs_member_the_claim_does_not_list() -> None:
    """The extender dies after the claim is whole and before any eviction; a member of low2
    bound while the claim was written, so its uid is on no claim: the new leader evicts it too,
    from the victim jobs the claim lists."""
    world = World(units=3)
    low2 = await low2_partly_bound_and_big_asking(world)
    replace = world.api.replace_claim

    async def racing(claim: JobClaim) -> JobClaim:
        if claim.metadata.name == "c1":
            world.bind(low2[1], "c1")
        return await replace(claim)

    async def dying(namespace: str, name: str, uid: str, message: str) -> None:
        raise Crash()

    world.api.replace_claim = racing  # type: ignore[method-assign]
    world.api.mark_preempted = dying  # type: ignore[method-assign]
    with pytest.raises(Crash):
        await world.loop.step()
    assert world.evicted() == []
    assert "low2-1" not in world.occupancy.claims["c0"].victims
    del world.api.mark_preempted  # (the instance's own again)
    world.loop = world.restarted()
    world.occupancy.replace_claims(list(world.api.claims.values()))
    await world.loop.step()
    assert sorted(world.evicted()) == sorted([f"low1-{i}" for i in range(4)] + ["low2-0", "low2-1"])


async def test_a_whole_claim_left_by_an_undo_that_failed_evicts_nobody_and_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A late victim's deletion is refused, and the undo of the claim cannot be written (the API
    server errs on every claim write): big's claim stays whole, listing victims. The next step
    evicted them without asking, so low1 and low2 went but for the refused one. Their deletions
    are now asked as a dry run first: refused, nobody is evicted, and the claim ends once the
    API server takes the writes again."""
    caplog.set_level(logging.INFO, "neuron_scheduler.extender.reserving")
    world = World(units=3)
    low2 = await low2_partly_bound_and_big_asking(world)
    replace, delete = world.api.replace_claim, world.api.delete_claim
    broken, armed = False, True

    async def racing(claim: JobClaim) -> JobClaim:
        if broken:
            raise api_error("PUT", claim.metadata.name, 500, b'{"message": "injected"}')
        if claim.metadata.name == "c1":
            world.bind(low2[1], "c1")
        return await replace(claim)

    async def deleting(name: str, uid: str, resource_version: str) -> None:
        if broken:
            raise api_error("DELETE", name, 500, b'{"message": "injected"}')
        await delete(name, uid, resource_version)

    world.api.replace_claim = racing  # type: ignore[method-assign]
    world.api.delete_claim = deleting  # type: ignore[method-assign]
    world.api.refuse_deletes = {"low2-1"}
    original_refusals = world.loop.evictions.refusals

    async def refusals_then_break(uids: Iterable[str]) -> list[str]:
        nonlocal broken, armed
        found = await original_refusals(uids)
        if found and armed:  # the undo that follows the first refusal meets a failing server
            broken, armed = True, False
        return found

    world.loop.evictions.refusals = refusals_then_break  # type: ignore[method-assign]
    await world.loop.step()
    assert world.evicted() == []
    assert world.claimed("big") == [f"{u}{i}" for u in "bc" for i in range(4)]  # undo failed
    assert world.occupancy.complete(("ns", "big"))
    await world.loop.step()  # the API server still fails: the claim cannot end yet
    assert world.evicted() == []
    broken = False
    world.now += 1
    await world.loop.step()
    assert world.evicted() == [] and world.claimed("big") == []
    assert "refuses to delete ns/low2-1" in caplog.text and "nobody is evicted" in caplog.text


async def test_a_new_leader_evicts_nobody_when_a_victim_it_finds_will_not_be_deleted() -> None:
    """The extender dies after the claim is whole and before any eviction; meanwhile an admission
    policy came to protect one victim. The new leader asks before evicting: nobody is evicted,
    and big's claim ends."""
    world = World(units=3)
    _, low1, low2 = await three_low_jobs(world)
    big = world.job("big", 8, priority=1000)
    await world.preempt(big[0], {"a0": ["low0-0"]})

    async def dying(namespace: str, name: str, uid: str, message: str) -> None:
        raise Crash()

    world.api.mark_preempted = dying  # type: ignore[method-assign]
    with pytest.raises(Crash):
        await world.loop.step()
    assert world.evicted() == [] and world.claimed("big")
    del world.api.mark_preempted
    world.api.refuse_deletes = {"low2-3"}
    world.loop = world.restarted()
    world.occupancy.replace_claims(list(world.api.claims.values()))
    await world.loop.step()
    assert world.evicted() == [] and world.claimed("big") == []
    # Without the refusal, the new leader evicts them all, each asked as a dry run first.
    assert world.api.dry_runs  # the new leader asked before evicting
    world.api.refuse_deletes = set()
    world.api.dry_runs = []
    world.now += 6
    await world.preempt(big[0], {"a0": ["low0-0"]})
    await world.loop.step()
    assert sorted(world.evicted()) == uids(low1, low2)
    assert sorted(world.api.dry_runs) == uids(low1, low2)


async def test_bind_refuses_a_node_a_claim_took_since_filter() -> None:
    """Through the wired extender: kube-scheduler filtered low2's members onto their claim's
    nodes; then a preemption's claim took c1 for big (being written: big's claim is not whole).
    A bind to c1, or to c2 (low2's claim is no longer whole), is refused; before, one binds."""
    api = FakeAPI()
    members = []
    for i in range(4):
        body = pod_json(
            f"low2-{i}",
            {NEURON: 16},
            namespace="ns",
            uid=f"low2-{i}",
            labels={
                "training.kubeflow.org/job-name": "low2",
                "training.kubeflow.org/job-role": "worker",
            },
            annotations={"neuron-scheduler.io/gang-size": "4"},
        )
        body["metadata"]["resourceVersion"] = str(next(api.version))
        api.pods[body["metadata"]["name"]] = body
        members.append(msgspec.convert(body, Pod))
    extender = wire(api, Catalog.builtin())  # type: ignore[arg-type]
    nodes = [node(f"c{i}", "trn2u.48xlarge", labels=unit_labels("c")) for i in range(4)]
    for view in extender.views:
        view.replace_nodes(nodes)
        view.replace_pods(members)
    extender.synced.set()
    for i in range(4):
        low2 = NodeClaim(f"c{i}", ("ns", "low2"), 4, 4, PENDING, 0.0, 60, "my-scheduler")
        extender.occupancy.hold(low2)

    def bind(i: int, to: str) -> ExtenderBindingArgs:
        return ExtenderBindingArgs(f"low2-{i}", "ns", f"low2-{i}", to)

    assert await extender.binder.bind(bind(0, "c0")) == ""
    big = NodeClaim("c1", ("ns", "big"), 4, 8, PENDING, 0.0, 60, "my-scheduler")
    extender.occupancy.hold(big)
    for i, to in ((1, "c1"), (2, "c2")):
        answer = await extender.binder.bind(bind(i, to))
        assert "ultraserver_unit rule no longer admits it there" in answer, answer
        assert not api.pods[f"low2-{i}"]["spec"].get("nodeName")


# --- who may make the extender delete pods --------------------------------------------------


def never_preempts(world: World, pods: list[Pod]) -> list[Pod]:
    """The pods as the watch shows them with `preemptionPolicy: Never`."""
    changed = []
    for pod in pods:
        spec = msgspec.structs.replace(pod.spec, preemptionPolicy="Never")
        changed.append(msgspec.structs.replace(pod, spec=spec))
        world.pods[pod.metadata.uid] = changed[-1]
        for view in (world.ledger, world.occupancy):
            view.apply_pod(changed[-1])
    return changed


async def test_the_preempt_verb_asks_only_for_a_pending_member_the_watch_knows() -> None:
    """Anyone holding kube-scheduler's client certificate can call the verb with any body: a
    pod that is not pending, one whose name does not match the watch's, or a member that must
    never preempt, gets no preemption, whatever the body says."""
    world = World(units=3)
    await three_low_jobs(world)
    big = world.job("big", 8, priority=1000)
    forged = msgspec.structs.replace(
        big[0], metadata=msgspec.structs.replace(big[0].metadata, uid="made-up")
    )
    renamed = msgspec.structs.replace(
        big[0], metadata=msgspec.structs.replace(big[0].metadata, name="other")
    )
    for body in (forged, renamed, world.pods["low0-0"]):  # (low0-0 is running)
        assert await world.preempt(body, {"a0": ["low0-0"]}) == {}
        assert world.occupancy.preemption_asks == {}
    never_preempts(world, big)
    assert await world.preempt(big[0], {"a0": ["low0-0"]}) == {}  # the body says nothing
    assert world.occupancy.preemption_asks == {}
    # Nor does the loop preempt for it, asked or not.
    world.occupancy.preemption_asks[("ns", "big")] = world.now
    await world.loop.step()
    assert world.evicted() == [] and world.claimed("big") == []


async def forge_claim(world: World, job: str, unit: str, victims: tuple[str, ...]) -> None:
    """A whole claim of `unit` for a 4-member job, listing `victims`, as another writer of
    claims could make it."""
    for i in range(4):
        forged = NodeClaim(
            f"{unit}{i}", ("ns", job), 4, 4, PENDING, world.now, 60, "my-scheduler", victims=victims
        )
        world.occupancy.apply_claim(await world.api.create_claim(to_object(forged)))


async def test_a_claim_makes_the_extender_evict_only_pods_of_lower_priority_than_its_job() -> None:
    """A claim another writer made (claims' write access is enough) lists a pod of higher
    priority than its job among the victims: only those below the job's priority go."""
    world = World(units=3)
    await world.running("vip", "a", priority=5000)
    low1 = await world.running("low1", "b", priority=10)
    world.job("big", 4, priority=1000)
    await forge_claim(world, "big", "c", ("vip-0", "vip-1", *uids(low1)))
    await world.loop.step()
    assert sorted(world.evicted()) == uids(low1)
    # Nor for a job whose members must never preempt.
    world = World(units=3)
    low0 = await world.running("low0", "a", priority=10)
    never_preempts(world, world.job("big", 4, priority=1000))
    await forge_claim(world, "big", "b", ("low0-0",))
    await world.loop.step()
    assert world.evicted() == [] and low0


async def test_a_claim_waits_for_its_victims_no_longer_than_their_grace_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The victims' node is down: they stay Terminating, holding their devices, for ever. The
    claim waits for them while their grace period lasts, then ends claim_seconds (60) later,
    saying why, when nobody asks about its job."""
    caplog.set_level(logging.INFO, "neuron_scheduler.extender.reserving")
    world = World(units=3)
    await three_low_jobs(world)
    big = world.job("big", 8, priority=1000)
    await world.preempt(big[0], {"a0": ["low0-0"]})
    world.grace = 300
    await world.loop.step()
    assert len(world.claimed("big")) == 8
    for _ in range(29):  # 290 s: within their grace period
        world.now += 10
        await world.loop.step()
    assert len(world.claimed("big")) == 8
    ended = None
    for tick in range(1, 100):  # up to 990 s after
        world.now += 10
        await world.loop.step()
        if not world.claimed("big"):
            ended = tick * 10
            break
    assert ended is not None and 290 + ended <= 300 + 60 + 20  # (renewed every third of 60 s)
    assert "8 pods evicted for it still hold devices past the grace period" in caplog.text


async def test_a_unit_held_for_an_admitted_kueue_workload_is_never_preempted() -> None:
    """Kueue's admission check claims a unit for a workload before its pods exist (docs/kueue.md:
    nobody else may take it, whatever their priority). With no member yet its job counted as the
    lowest priority, so any job that asked the preempt verb took the claim, and the workload's
    pods then found no block."""
    world = World(units=1)
    for i in range(4):
        claim = NodeClaim(
            f"a{i}", ("ns", "k"), 4, 4, PENDING, world.now, 600, "my-scheduler", workload="wl-uid"
        )
        world.occupancy.apply_claim(await world.api.create_claim(to_object(claim)))
    asking = world.job("asking", 4, priority=1000)
    answer = await world.preempt(asking[0], {"a0": []})
    await world.loop.step()
    assert world.claimed("k") == ["a0", "a1", "a2", "a3"]
    assert world.claimed("asking") == []
    assert not any(answer.values()) and world.evicted() == []


async def test_the_plan_made_after_the_last_dry_runs_is_the_one_taken() -> None:
    """The plan is made again after each round of dry runs; the last one is looked at too: its
    own reason when it gives no preemption, and itself when its victims were all asked."""
    world = World(units=3)
    plans: list[Preemption | Shortfall] = [
        Preemption(("ns", "big"), ("a0",), (), (v,), (0, 0, 0.0)) for v in ("a", "b", "c")
    ]

    def planning(answers: list[Preemption | Shortfall]) -> Callable[[], Preemption | Shortfall]:
        return lambda: answers.pop(0)

    last = Shortfall("the real reason")
    assert await world.loop._deletable(planning([*plans, last])) == last
    again = Preemption(("ns", "big"), ("a0",), (), ("a", "b"), (0, 0, 0.0))
    assert await world.loop._deletable(planning([*plans, again])) == again
    changing = Preemption(("ns", "big"), ("a0",), (), ("d",), (0, 0, 0.0))
    found = await world.loop._deletable(planning([*plans, changing]))
    assert isinstance(found, Shortfall) and "kept changing" in found.reason


def test_a_bound_member_with_a_neuron_sidecar_is_still_its_jobs() -> None:
    """Never placed by us, but bound before, or by another scheduler: it holds its devices, and
    its job is evicted whole with it; a pending one is nobody's to place."""
    world = World(units=1)
    bound = world.member("side", 0, 2, node_name="a0", init_limits=[{NEURON: 1}])
    pending = world.member("side", 1, 2, init_limits=[{NEURON: 1}])
    for pod in (bound, pending):
        pod.spec.initContainers[0].restartPolicy = "Always"
        world.occupancy.apply_pod(pod)
    assert [w.node for w in world.occupancy.job_workers(("ns", "side"))] == ["a0"]
    assert not world.occupancy.jobs()
