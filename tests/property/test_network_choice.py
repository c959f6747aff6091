"""The network choice (jobs/network.py) against brute force on small fleets: it fits whenever some
set of units fits, never takes too little room, keeps a required level's one domain, keeps a
preferred one whenever one can hold the job, and spans the fewest deepest domains there are."""

from __future__ import annotations

from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_scheduler.jobs.network import HOSTNAME, Atom, Closeness, choose

LEVELS = ("l1", "l2")


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[Atom[str]], int]:
    count = draw(st.integers(1, 7))
    atoms = []
    for n in range(count):
        place = (draw(st.sampled_from("ab")), draw(st.sampled_from("xyz")))
        room = draw(st.integers(1, 3))
        atoms.append(Atom(f"u{n}", room, place, 1, f"u{n}"))
    need = draw(st.integers(1, sum(a.room for a in atoms) + 1))
    return atoms, need


def subsets(atoms: list[Atom[str]], need: int) -> list[tuple[Atom[str], ...]]:
    return [
        chosen
        for k in range(1, len(atoms) + 1)
        for chosen in combinations(atoms, k)
        if sum(a.room for a in chosen) >= need
    ]


def domains(chosen: tuple[Atom[str], ...] | list[Atom[str]], depth: int) -> int:
    return len({a.place[:depth] for a in chosen})


@settings(max_examples=400, deadline=None)
@given(fleets())
def test_the_fewest_deepest_domains_whenever_anything_fits(
    fleet: tuple[list[Atom[str]], int],
) -> None:
    atoms, need = fleet
    found = choose(atoms, need, LEVELS)
    every = subsets(atoms, need)
    if not every:
        assert found is None
        return
    assert found is not None
    assert sum(a.room for a in found.atoms) >= need
    assert len({a.key for a in found.atoms}) == len(found.atoms)
    assert all(0 < a.room <= next(b.room for b in atoms if b.key == a.key) for a in found.atoms)
    assert found.domains == min(domains(s, 2) for s in every)


@settings(max_examples=400, deadline=None)
@given(fleets(), st.sampled_from(["l1", "l2", HOSTNAME]), st.booleans())
def test_a_required_level_holds_and_a_preferred_one_is_kept_when_it_can_be(
    fleet: tuple[list[Atom[str]], int], key: str, required: bool
) -> None:
    atoms, need = fleet
    depth = {"l1": 1, "l2": 2, HOSTNAME: 3}[key]

    def within(chosen: tuple[Atom[str], ...] | list[Atom[str]]) -> bool:
        if depth == 3:
            return len(chosen) == 1
        return domains(chosen, depth) == 1

    found = choose(atoms, need, LEVELS, Closeness(key, required, "test"))
    close = [s for s in subsets(atoms, need) if within(s)]
    if required and not close:
        assert found is None
        return
    if close:
        assert found is not None and within(found.atoms)
    elif subsets(atoms, need):
        assert found is not None  # preferred: the closest there is


@settings(max_examples=300, deadline=None)
@given(fleets(), st.integers(0, 6))
def test_units_the_job_keeps_are_always_part_of_its_choice(
    fleet: tuple[list[Atom[str]], int], which: int
) -> None:
    atoms, need = fleet
    kept = [atoms[which % len(atoms)]]
    rest = [a for a in atoms if a not in kept]
    found = choose(rest, need, LEVELS, fixed=kept)
    if not subsets(atoms, need):
        assert found is None
        return
    assert found is not None and kept[0] in found.atoms
    assert sum(a.room for a in found.atoms) >= need
