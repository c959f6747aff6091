"""The UltraServer gang model (sim/gangs.py): what each rule does with a job that does not fit."""

from __future__ import annotations

import random

from neuron_scheduler.sim.gangs import RULES, Fleet, GangWorkload, Job, run


def job(name: str, size: int) -> Job:
    return Job(name, size, 0.0, 1.0)


def test_all_or_nothing_binds_a_job_whole_or_not_at_all() -> None:
    fleet = Fleet(2, "gangs", random.Random(1))
    big, other = job("job-big", 8), job("job-other", 4)
    assert fleet.try_place(big, 0.0) and len(big.nodes) == 8
    assert not fleet.try_place(other, 0.0) and other.nodes == []  # nothing held while it waits
    fleet.release(big)
    assert fleet.try_place(other, 1.0) and len(other.nodes) == 4


def test_member_by_member_holds_nodes_for_a_job_that_cannot_run() -> None:
    fleet = Fleet(2, "workers", random.Random(1))
    single = Job("pod-1", 1, 0.0, 1.0)
    assert fleet.try_place(single, 0.0)
    big = job("job-big", 8)
    assert not fleet.try_place(big, 0.0)
    assert len(big.nodes) == 4  # one whole UltraServer held, the other one not free whole
    assert {fleet.unit(n) for n in big.nodes} == {1 - fleet.unit(single.nodes[0])}


def test_affinity_keeps_a_small_job_in_one_unit_and_other_jobs_out() -> None:
    fleet = Fleet(2, "affinity", random.Random(3))
    first, second = job("job-a", 4), job("job-b", 4)
    assert fleet.try_place(first, 0.0) and len({fleet.unit(n) for n in first.nodes}) == 1
    assert fleet.try_place(second, 0.0)
    assert {fleet.unit(n) for n in first.nodes}.isdisjoint({fleet.unit(n) for n in second.nodes})


def test_no_rule_puts_two_jobs_on_one_ultraserver_and_gangs_hold_nothing_idle() -> None:
    workload = GangWorkload(ultraservers=4, hours=48, load=1.0)
    for rule in RULES:
        result = run(workload, rule, seed=5)
        assert result.shared_units == 0, rule
        assert result.started > 0 and result.jobs >= result.started
        if rule == "gangs":
            assert result.idle_node_hours == 0.0
    assert run(workload, "workers", seed=5).idle_node_hours > 0
