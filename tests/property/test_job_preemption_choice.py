"""core/jobpreemption's choice against brute force (issue 40).

Random fleets of up to 7 units, each free, holding pods of no job, or held by one or two of up to
5 jobs (a job may span units; two jobs share a unit as a 2-node job's pair does inside a 4-node
unit), each job with its work, each unit taking 1 to 4 of the preemptor's members (a node of its
own with a failed device takes fewer): every set of units is tried. The answer:
- is None exactly when even every unit takes fewer members than needed;
- otherwise its units take the members needed, and none could be left out; each unit's jobs are
  all among the jobs it evicts, it evicts only those units' jobs, and no set is cheaper by the
  documented order (fewest whole jobs, then fewest pods of no job, then least work lost).
"""

from __future__ import annotations

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_scheduler.core.jobpreemption import Cost, Opening, cheapest

Fleet = tuple[list[Opening[int, str]], dict[str, float], int]


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    jobs = [f"j{i}" for i in range(draw(st.integers(0, 5)))]
    work = {job: float(draw(st.integers(0, 50))) for job in jobs}
    openings = []
    sized = draw(st.booleans())  # else every unit takes one member, as UltraServer nodes do
    for unit in range(draw(st.integers(1, 7))):
        held = draw(st.sets(st.sampled_from(jobs), max_size=2)) if jobs else set()
        loose = draw(st.integers(0, 3))
        lost = float(draw(st.integers(0, 20))) if loose else 0.0
        room = draw(st.integers(1, 4)) if sized else 1
        openings.append(Opening(unit, frozenset(held), loose, lost, room))
    return openings, work, draw(st.integers(1, 12 if sized else 7))


def brute_force(
    openings: list[Opening[int, str]], work: dict[str, float], needed: int
) -> Cost | None:
    best: Cost | None = None
    for k in range(len(openings) + 1):
        for kept in combinations(openings, k):
            if sum(o.room for o in kept) < needed:
                continue
            # A job goes whole whatever units are kept.
            used = {j for o in kept for j in o.jobs}
            cost = (
                len(used),
                sum(o.loose for o in kept),
                sum(work[j] for j in used) + sum(o.loose_work for o in kept),
            )
            if best is None or cost < best:
                best = cost
    return best


@settings(max_examples=600, deadline=None)
@given(fleets())
def test_the_cheapest_units_by_whole_jobs_then_pods_of_no_job_then_work(fleet: Fleet) -> None:
    openings, work, needed = fleet
    choice = cheapest(openings, needed, work.__getitem__)
    expected = brute_force(openings, work, needed)
    if expected is None:
        assert choice is None
        return
    assert choice is not None
    rooms = [o.room for o in choice.openings]
    assert sum(rooms) >= needed > sum(rooms) - min(rooms)  # enough, and none to spare
    evicted = set(choice.jobs)
    for opening in choice.openings:
        assert opening.jobs <= evicted  # every unit kept is freed by the jobs evicted
    assert evicted == {j for o in choice.openings for j in o.jobs}  # no job evicted in vain
    assert choice.cost == expected
