"""Which whole jobs to evict so a training job gets the units it needs. Pure.

Shared by the extender's training-job preemption (jobs/preemption.py) and the gang
simulator (sim/gangs.py). The caller lists the units the preemptor could have (`Opening`): each
with the lower-priority jobs to evict whole for it (none for a free unit) and the pods of no job
on it. Evicting a job frees every unit it holds, so a job spread over three units frees three;
a unit shared by two jobs (a 2-node job's pair beside another's, under a 4-node preemptor) needs
both. The choice is the cheapest set of units by, in order:

1. the fewest whole jobs evicted;
2. then the fewest pods of no job evicted;
3. then the least work lost (what the victims have run: the jobs' and the pods of no job's).

Units need not take as many members each (`Opening.room`: a node of its own with a failed device
takes fewer): the choice covers the members needed, not a number of units, so a smaller unit
never makes every unit count as small as it (3 jobs evicted where 2 would do).

Exact, by dynamic programming over groups (a multiple-choice knapsack): each unit no job holds is
a group of its own (taken or not); jobs linked by a shared unit, with their units, are one group,
whose options are each set of its jobs with, for each number of members, the units they free
that take them with the fewest pods of no job. A group of more than `MAX_LINKED` linked jobs (a
fleet of 1-node jobs sharing units in a chain) is offered whole only: never a wrong answer, at
worst a dearer one. A property test checks the choice against brute force (tests/property).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Generic, TypeVar

U = TypeVar("U", bound=Hashable)  # a unit
J = TypeVar("J", bound=Hashable)  # a job

Cost = tuple[int, int, float]  # jobs evicted, pods of no job evicted, work lost
MAX_LINKED = 10  # jobs of one group whose every subset is an option (2**10 sets)


@dataclass(frozen=True, slots=True)
class Opening(Generic[U, J]):
    """A unit the preemptor could have: the jobs to evict whole for it, the pods of no job on it
    (`loose`) and their work."""

    unit: U
    jobs: frozenset[J]
    loose: int = 0
    loose_work: float = 0.0
    room: int = 1  # the preemptor's members it takes once every pod there is gone


@dataclass(frozen=True, slots=True)
class Choice(Generic[U, J]):
    openings: tuple[
        Opening[U, J], ...
    ]  # units taking the members asked for, in the openings' order
    jobs: tuple[J, ...]  # evicted whole
    cost: Cost


@dataclass(frozen=True, slots=True)
class _Option(Generic[U, J]):
    """One way to take from a group: these units (and their jobs evicted)."""

    openings: tuple[Opening[U, J], ...]
    cost: Cost

    @property
    def room(self) -> int:
        return sum(o.room for o in self.openings)


def cheapest(
    openings: Sequence[Opening[U, J]], needed: int, work: Callable[[J], float]
) -> Choice[U, J] | None:
    """The cheapest units taking `needed` members together (order above; among equal choices
    one the same inputs always give, mostly the earlier openings: a group's option that gives
    more members for no more cost stands for those that give fewer), none of which could be
    left out; None when even all of them are too few.
    `work(job)`: what evicting it loses."""
    if needed <= 0:
        return Choice((), (), (0, 0, 0.0))
    openings = [o for o in openings if o.room > 0]
    if sum(o.room for o in openings) < needed:
        return None
    order = {id(o): n for n, o in enumerate(openings)}
    # best[c]: the cheapest options, one per group at most, taking c members (capped).
    best: list[tuple[Cost, tuple[_Option[U, J], ...]] | None] = [None] * (needed + 1)
    best[0] = ((0, 0, 0.0), ())
    for group in _groups(openings, work, order, needed):
        sized = [(option, option.room) for option in group]  # (a sum: once, not per count)
        reached_before = list(best)
        for reached, known in enumerate(reached_before):
            if known is None:
                continue
            for option, room in sized:
                to = min(needed, reached + room)
                cost = _add(known[0], option.cost)
                current = best[to]
                if current is None or cost < current[0]:
                    best[to] = (cost, (*known[1], option))
    found = best[needed]
    if found is None:
        return None
    kept = _trimmed([o for option in found[1] for o in option.openings], needed, order)
    jobs = tuple(dict.fromkeys(j for o in kept for j in sorted(o.jobs, key=repr)))
    cost = (
        len(jobs),
        sum(o.loose for o in kept),
        sum(work(j) for j in jobs) + sum(o.loose_work for o in kept),
    )
    return Choice(tuple(kept), jobs, cost)


def _trimmed(
    chosen: list[Opening[U, J]], needed: int, order: dict[int, int]
) -> list[Opening[U, J]]:
    """The chosen units less those the others cover for (an option may take more than needed):
    the dearest go first (most pods of no job, then work, then the latest). Leaving one out
    never costs more, so the choice stays the cheapest; and a unit that cannot be left out now
    cannot once others are, so one pass leaves none that could."""
    kept = list(chosen)
    total = sum(o.room for o in kept)
    for opening in sorted(chosen, key=lambda o: (o.loose, o.loose_work, order[id(o)]))[::-1]:
        if total - opening.room >= needed:
            kept.remove(opening)
            total -= opening.room
    kept.sort(key=lambda o: order[id(o)])
    return kept


def _add(a: Cost, b: Cost) -> Cost:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def _groups(
    openings: Sequence[Opening[U, J]],
    work: Callable[[J], float],
    order: dict[int, int],
    needed: int,
) -> list[list[_Option[U, J]]]:
    """Each group's options (taking nothing from it is always possible, so not listed)."""
    parent: dict[J, J] = {}

    def root(job: J) -> J:
        while parent[job] != job:
            parent[job] = parent[parent[job]]
            job = parent[job]
        return job

    for opening in openings:
        linked = list(opening.jobs)
        for job in linked:
            parent.setdefault(job, job)
        for job in linked[1:]:
            parent[root(job)] = root(linked[0])
    linked_units: dict[J, list[Opening[U, J]]] = {}
    groups: list[list[_Option[U, J]]] = []
    for opening in openings:
        if opening.jobs:
            linked_units.setdefault(root(next(iter(opening.jobs))), []).append(opening)
        else:
            groups.append([_Option((opening,), (0, opening.loose, opening.loose_work))])
    for units in linked_units.values():
        jobs = sorted({j for o in units for j in o.jobs}, key=repr)
        sets = (
            [c for k in range(1, len(jobs) + 1) for c in combinations(jobs, k)]
            if len(jobs) <= MAX_LINKED
            else [tuple(jobs)]
        )
        # The cheapest option for each number of members it gives (capped): the DP's cost is
        # the counts it reaches times the options, and 2**10 evicted sets would each add one
        # per count otherwise (25 s for one call at 256 members, measured).
        by_room: dict[int, _Option[U, J]] = {}
        for evicted in sets:
            chosen = set(evicted)
            freed = [o for o in units if o.jobs <= chosen]
            lost = sum(work(j) for j in evicted)
            for part in _covers(freed, needed, order):
                loose = sum(o.loose for o in part)
                option = _Option(
                    part, (len(evicted), loose, lost + sum(o.loose_work for o in part))
                )
                room = min(option.room, needed)
                known = by_room.get(room)
                if known is None or option.cost < known.cost:
                    by_room[room] = option
        # And none that gives fewer members for no less.
        options: list[_Option[U, J]] = []
        for room in sorted(by_room, reverse=True):
            option = by_room[room]
            if not options or option.cost < options[-1].cost:
                options.append(option)
        groups.append(options)
    return groups


def _covers(
    units: Sequence[Opening[U, J]], needed: int, order: dict[int, int]
) -> list[tuple[Opening[U, J], ...]]:
    """For each number of members up to `needed`, the units taking at least that many with the
    fewest pods of no job (then the least work, then the earliest), each set once."""

    def dearness(o: Opening[U, J]) -> tuple[int, float, int]:
        return (o.loose, o.loose_work, order[id(o)])

    ranked = sorted(units, key=dearness)
    rooms = {o.room for o in ranked}
    if len(rooms) <= 1:
        # Units of one size: the cheapest k are the best for k units' members (no more than
        # `needed` takes).
        most = min(len(ranked), -(-needed // max(rooms, default=1)))
        return [tuple(ranked[:k]) for k in range(1, most + 1)]
    # best[c]: the cheapest units taking c members (capped at `needed`), a 0/1 knapsack; the
    # cheapest first, and a tie keeps what it found first: the earlier units.
    best: list[tuple[tuple[int, float], tuple[Opening[U, J], ...]] | None] = [None] * (needed + 1)
    best[0] = ((0, 0.0), ())
    for opening in ranked:
        for reached in range(needed - 1, -1, -1):
            known = best[reached]
            if known is None:
                continue
            to = min(needed, reached + opening.room)
            (loose, lost), part = known
            key = (loose + opening.loose, lost + opening.loose_work)
            current = best[to]
            if current is None or key < current[0]:
                best[to] = (key, (*part, opening))
    found = dict.fromkeys(entry[1] for entry in best[1:] if entry is not None)
    return list(found)
