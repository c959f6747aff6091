"""Preemption for training jobs as the reservation loop carries it out, where it can go wrong
(an independent review of issue 40): a victim job's member binding while the claim is written, a
crash between the claim and the evictions, failed devices, a caller the extender should not
trust, victims that never leave, and evictions the watch has not shown yet. The world is
tests/unit/test_reserving.py's: the preempt verb and the loop on an in-memory claim API."""

from __future__ import annotations

from neuron_scheduler.extender.state.members import preemption_for
from neuron_scheduler.ultraserver.jobs import member_of
from neuron_scheduler.ultraserver.preemption import Preemption
from tests.builders import node
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
