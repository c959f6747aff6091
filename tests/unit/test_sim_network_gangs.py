"""The network-domain model of training jobs (sim/networkgangs.py, bench/gangs.py --topology):
what each rule does with a job on a small fleet, and the measures it reports."""

from __future__ import annotations

import random

from neuron_scheduler.sim.networkgangs import RULES, Cluster, Job, NetworkWorkload, run

# Two layer-3 domains of 4 nodes in one layer-2 domain, and one of 2 in another.
PLACES = [("nn-1", "s0", "d0")] * 4 + [("nn-1", "s0", "d1")] * 4 + [("nn-1", "s1", "d2")] * 2


def test_closest_takes_the_fullest_domain_that_holds_a_job_and_spans_the_fewest() -> None:
    cluster = Cluster(PLACES, "closest", random.Random(1))
    cluster.free -= {0}  # d0 has 3 free, d1 4, d2 2
    three = cluster.pick(Job(0, 3, 0.0, 1.0), 0.0)
    assert three is not None and {PLACES[n] for n in three} == {PLACES[1]}  # d0: best fit
    cluster.free -= set(three)
    six = cluster.pick(Job(1, 6, 0.0, 1.0), 0.0)
    assert six is not None and len(six) == 6
    assert {PLACES[n][2] for n in six} == {"d1", "d2"}  # two domains: no fewer hold it
    one_domain = cluster.pick(Job(2, 5, 0.0, 1.0), 0.0, one_domain=True)
    assert one_domain is None  # no layer-3 domain has 5 free


def test_first_fit_takes_the_first_domain_with_room() -> None:
    cluster = Cluster(PLACES, "first-fit", random.Random(1))
    cluster.free -= {0}
    assert cluster.pick(Job(0, 2, 0.0, 1.0), 0.0) == [1, 2]  # d0, though d2 fits exactly


def test_every_rule_starts_jobs_whole_and_reports_consistent_measures() -> None:
    workload = NetworkWorkload(nodes=48, domain_sizes=(8, 16), hours=48.0, load=0.8)
    results = {rule: run(workload, rule, seed=2) for rule in RULES}
    for rule, result in results.items():
        assert result == run(workload, rule, seed=2), rule  # the same seed, the same run
        assert 0 < result.started <= result.jobs
        assert result.mean_wait_h >= 0 and result.p95_wait_h >= 0
        assert 0.0 <= result.one_domain_share <= 1.0
        assert result.mean_domains >= 1.0
    # Without closeness jobs span domains at random; the extender's rule keeps them together.
    assert results["closest"].mean_domains < results["none"].mean_domains
    assert results["closest"].one_domain_share > results["none"].one_domain_share
