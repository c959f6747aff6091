"""Which whole jobs to evict so a training job gets the units it needs. Pure.

Shared by the extender's UltraServer preemption (ultraserver/preemption.py) and the gang
simulator (sim/gangs.py). The caller lists the units the preemptor could have (`Opening`): each
with the lower-priority jobs to evict whole for it (none for a free unit) and the pods of no job
on it. Evicting a job frees every unit it holds, so a job spread over three units frees three;
a unit shared by two jobs (a 2-node job's pair beside another's, under a 4-node preemptor) needs
both. The choice is the cheapest set of units by, in order:

1. the fewest whole jobs evicted;
2. then the fewest pods of no job evicted;
3. then the least work lost (node-seconds the victims have run).

Exact by dynamic programming over "items": each unit no job holds is one item; the units of jobs
linked by a shared unit are one item (evicting the item's jobs frees all of them). Linking jobs
this way can only overcount in the rare case of units shared across configs: it never answers a
set that does not free the units.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

U = TypeVar("U", bound=Hashable)  # a unit
J = TypeVar("J", bound=Hashable)  # a job

Cost = tuple[int, int, float]  # jobs evicted, pods of no job evicted, work lost


@dataclass(frozen=True, slots=True)
class Opening(Generic[U, J]):
    """A unit the preemptor could have: the jobs to evict whole for it, the pods of no job on it
    (`loose`) and their work."""

    unit: U
    jobs: frozenset[J]
    loose: int = 0
    loose_work: float = 0.0


@dataclass(frozen=True, slots=True)
class Choice(Generic[U, J]):
    openings: tuple[Opening[U, J], ...]  # exactly the units asked for, in the openings' order
    jobs: tuple[J, ...]  # evicted whole
    cost: Cost


@dataclass(slots=True)
class _Item(Generic[U, J]):
    openings: list[Opening[U, J]]
    jobs: frozenset[J]
    cost: Cost


def cheapest(
    openings: Sequence[Opening[U, J]], needed: int, work: Callable[[J], float]
) -> Choice[U, J] | None:
    """The cheapest `needed` of the openings (order above; ties go to the earlier openings), or
    None when even all of them are too few. `work(job)`: what evicting it loses."""
    if needed <= 0:
        return Choice((), (), (0, 0, 0.0))
    if len(openings) < needed:
        return None
    items = _items(openings, work)
    # best[c]: the cheapest items reaching c units (c capped at `needed`).
    best: list[tuple[Cost, tuple[int, ...]] | None] = [None] * (needed + 1)
    best[0] = ((0, 0, 0.0), ())
    for index, item in enumerate(items):
        size = len(item.openings)
        for reached in range(needed, -1, -1):
            known = best[reached]
            if known is None:
                continue
            cost = _add(known[0], item.cost)
            to = min(needed, reached + size)
            current = best[to]
            if current is None or cost < current[0]:
                best[to] = (cost, (*known[1], index))
    found = best[needed]
    if found is None:
        return None
    chosen = [o for i in found[1] for o in items[i].openings]
    # The jobs are evicted whole whatever units are kept: keep those with the fewest pods of no
    # job when a linked item frees more than needed.
    order = {id(o): n for n, o in enumerate(openings)}
    kept = sorted(chosen, key=lambda o: (o.loose, o.loose_work, order[id(o)]))[:needed]
    kept.sort(key=lambda o: order[id(o)])
    jobs = tuple(dict.fromkeys(j for o in kept for j in sorted(o.jobs, key=repr)))
    cost = (
        len(jobs),
        sum(o.loose for o in kept),
        sum(work(j) for j in jobs) + sum(o.loose_work for o in kept),
    )
    return Choice(tuple(kept), jobs, cost)


def _add(a: Cost, b: Cost) -> Cost:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def _items(openings: Sequence[Opening[U, J]], work: Callable[[J], float]) -> list[_Item[U, J]]:
    """Units no job holds, one item each; the units of jobs linked by shared units, one item."""
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
    grouped: dict[J, list[Opening[U, J]]] = {}
    items: list[_Item[U, J]] = []
    for opening in openings:
        if not opening.jobs:
            items.append(_Item([opening], frozenset(), (0, opening.loose, opening.loose_work)))
        else:
            grouped.setdefault(root(next(iter(opening.jobs))), []).append(opening)
    for members in grouped.values():
        jobs = frozenset(j for o in members for j in o.jobs)
        loose = sum(o.loose for o in members)
        lost = sum(work(j) for j in jobs) + sum(o.loose_work for o in members)
        items.append(_Item(members, jobs, (len(jobs), loose, lost)))
    return items
