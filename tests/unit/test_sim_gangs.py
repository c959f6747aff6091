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


def running(fleet: Fleet, name: str, size: int, started: float, **kwargs: float) -> Job:
    job = Job(name, size, 0.0, 10.0, **kwargs)
    assert fleet.try_place(job, started)
    job.started = started
    return job


def test_job_level_preemption_evicts_whole_jobs_only_when_the_job_then_fits() -> None:
    fleet = Fleet(2, "preempt", random.Random(1))
    older = running(fleet, "job-older", 4, 0.0)
    younger = running(fleet, "job-younger", 4, 1.0)
    huge = Job("job-huge", 12, 2.0, 1.0, priority=2)
    assert not fleet.try_place(huge, 2.0) and fleet.evicted == []  # 3 units of 2: nobody
    big = Job("job-big", 4, 2.0, 1.0, priority=2)
    assert fleet.try_place(big, 3.0)
    assert fleet.evicted == [younger] and younger.nodes == [] and older.nodes  # least work lost
    assert fleet.lost == 4 * (3.0 - 1.0)
    assert {fleet.unit(n) for n in big.nodes} == {1}


def test_preemption_as_it_was_evicts_a_node_per_member_whatever_fits() -> None:
    fleet = Fleet(2, "gangs-priority", random.Random(1))
    first = running(fleet, "job-first", 4, 0.0)
    second = running(fleet, "job-second", 4, 1.0)
    big = Job("job-big", 4, 2.0, 1.0, priority=2)
    assert fleet.try_place(big, 2.0)
    # Its four members each evicted a node, the youngest first: both jobs died for one unit.
    assert sorted(j.name for j in fleet.evicted) == ["job-first", "job-second"]
    assert first.nodes == [] and second.nodes == []


def test_backfill_lets_a_job_onto_reserved_units_only_if_it_declares_it_ends_before() -> None:
    fleet = Fleet(2, "backfill", random.Random(1))
    running(fleet, "job-a", 4, 0.0, declared=10.0)
    big = Job("job-big", 8, 1.0, 1.0, declared=1.0)
    fleet.head = big
    assert not fleet.try_place(big, 1.0)
    fleet.reserve_for(big, 1.0)
    assert fleet.shadow == 10.0 and len(fleet.reserved) == 8
    late = Job("job-late", 4, 1.0, 20.0, declared=20.0)
    assert not fleet.try_place(late, 1.0)  # it would still run when big's units are all free
    early = Job("job-early", 4, 1.0, 5.0, declared=5.0)
    assert fleet.try_place(early, 1.0)  # it ends (by what it declares) before: backfilled
    assert fleet.held_free() == 0


def test_new_rules_report_lost_work_and_idle_nodes() -> None:
    workload = GangWorkload(ultraservers=4, hours=48, load=1.0)
    assert run(workload, "gangs", seed=5).lost_node_hours == 0.0
    preempt = run(workload, "preempt", seed=5)
    assert preempt.idle_node_hours == 0.0 and preempt.lost_node_hours > 0
    assert preempt.preemptions > 0 and set(preempt.p95_by_size_h) == {4, 8, 16}
    assert run(workload, "backfill", seed=5).lost_node_hours == 0.0
