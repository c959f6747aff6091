"""Where a training job's units go in the network: the topology levels, the closeness a job asks
for, and the choice among the units that could take its members now. Pure.

**Levels** are node-label keys, broadest first; the extender's default is what EKS labels every
node with (`topology.k8s.aws/network-node-layer-1`, `-2`, `-3`, and `-4` on types with four
layers). A node's place is the values of those labels; a domain at depth d is the set of nodes
sharing the first d values (a label a node lacks counts as one unknown value, so a fleet without
the labels is one domain, and types without `-4` have layer-4 domains equal to their layer-3
ones). Below the deepest level come the units (an UltraServer, or one node) and the nodes.

**Closeness** is what a job's members ask for: a level (a key above, or `kubernetes.io/hostname`)
that all of them must share (`required`) or should share (`preferred`). Ours, then Kueue's and
KAI-Scheduler's annotations, so a manifest written for them means the same here.

**The choice** (`choose`), among the units that could take members now, each with its room (how
many members it takes) and place:
1. a required level: all units within one domain of that level, or none at all;
2. a preferred level: within one domain of it, if any domain can hold the job;
3. the fewest domains of the deepest level, then of each broader level (the job's ranks span
   as few network hops as there are);
4. best fit: the domains it touches are the fullest that can hold it (it leaves whole the large
   free domains for the jobs after), deepest level first;
5. the fewest units, then the units' order (server id, node name).

The search tries every domain as the one enclosing the job (every depth, every value) and, inside
it, fills the deepest domains holding the job's own units first, then the best-fitting deepest
domain, else the largest ones until the best-fitting one completes it (the fewest deepest
domains there can be); the same for the units inside each domain. Scoring every enclosing domain
finds the closest of the fewest. It is a greedy heuristic, measured against first-fit by domain
and placement without closeness in the gang simulator (bench/gangs.py --topology,
BENCHMARKS.md), and checked against brute force on small fleets (tests/property).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from neuron_scheduler.kube.objects import Pod

K = TypeVar("K")

EKS_LEVELS = tuple(f"topology.k8s.aws/network-node-layer-{n}" for n in (1, 2, 3, 4))
HOSTNAME = "kubernetes.io/hostname"  # the node itself, as a level
MAX_LEVELS = 8
MAX_KEY = 317  # a label key: a 253-character prefix, '/', a 63-character name
MAX_VALUE = 63
# The most (domains x domains taken) `_tightest` works out: about 0.1 s of its table on the
# development VM (a job of 1024 members over 1100 single-node domains took 0.9 s and 70 MB).
TIGHTEST_CELLS = 100_000

# Read in this order: the first present wins, required before preferred.
REQUIRED_KEYS = (
    "neuron-scheduler.io/required-topology",
    "kueue.x-k8s.io/podset-required-topology",
    "kai.scheduler/topology-required-placement",
)
PREFERRED_KEYS = (
    "neuron-scheduler.io/preferred-topology",
    "kueue.x-k8s.io/podset-preferred-topology",
    "kai.scheduler/topology-preferred-placement",
)


class LevelsError(ValueError):
    """Topology levels that cannot be used (the extender refuses to start with them)."""


def parse_levels(text: str) -> tuple[str, ...]:
    """Levels from a comma-separated list of node-label keys, broadest first ("" for none)."""
    levels = tuple(key.strip() for key in text.split(",") if key.strip())
    if len(levels) > MAX_LEVELS:
        raise LevelsError(f"at most {MAX_LEVELS} topology levels, not {len(levels)}")
    for key in levels:
        if len(key) > MAX_KEY or any(c.isspace() for c in key):
            raise LevelsError(f"topology level {key[:60]!r} is not a node-label key")
        if key == HOSTNAME:
            raise LevelsError(f"{HOSTNAME} is always the last level: leave it out of the list")
    if len(set(levels)) != len(levels):
        raise LevelsError(f"topology levels {', '.join(levels)} name a key twice")
    return levels


def place_of(labels: Mapping[str, str], levels: Sequence[str]) -> tuple[str, ...]:
    """A node's place: its values of the levels ("" where it has none), bounded."""
    return tuple(labels.get(key, "")[:MAX_VALUE] for key in levels)


@dataclass(frozen=True, slots=True)
class Closeness:
    """What a job's member asks: all members in one domain of `key` (`required`), or preferably."""

    key: str
    required: bool
    source: str  # the annotation it was read from

    @property
    def text(self) -> str:
        return f"{'required' if self.required else 'preferred'} {self.key} ({self.source})"


def closeness_of(pod: Pod) -> Closeness | None:
    """The closeness the pod asks for, or None. A value that is no label key is no request."""
    annotations = pod.metadata.annotations
    for keys, required in ((REQUIRED_KEYS, True), (PREFERRED_KEYS, False)):
        for source in keys:
            value = annotations.get(source, "").strip()
            if value and len(value) <= MAX_KEY and not any(c.isspace() for c in value):
                return Closeness(value, required, source)
    return None


def depth_of(key: str, levels: Sequence[str]) -> int | None:
    """The depth a closeness key names: 1 for the broadest level, len(levels) + 1 for the node;
    None for a key that is no level."""
    if key == HOSTNAME:
        return len(levels) + 1
    return levels.index(key) + 1 if key in levels else None


@dataclass(frozen=True, slots=True)
class Atom(Generic[K]):
    """A unit a job could take now: `room` members, at `place`, `nodes` many nodes (a unit of one
    node is its own hostname domain); `order` breaks ties (its server id or node name)."""

    key: K
    room: int
    place: tuple[str, ...]
    nodes: int = 1
    order: str = ""


@dataclass(frozen=True, slots=True)
class Choice(Generic[K]):
    atoms: tuple[Atom[K], ...]  # fixed ones included
    domains: int  # of the deepest level
    span: str  # "1 topology.k8s.aws/network-node-layer-3 domain" ("" without labels): logs, why


def choose(
    atoms: Sequence[Atom[K]],
    need: int,
    levels: Sequence[str],
    closeness: Closeness | None = None,
    fixed: Sequence[Atom[K]] = (),
    avoid: Collection[tuple[str, ...]] = (),
) -> Choice[K] | None:
    """The units for `need` members (the room of `fixed`, units the job keeps, counted first),
    or None when they do not fit as asked. `atoms` excludes `fixed`. A required key that is no
    level fits nowhere (`depth_of`: the caller says why)."""
    depth = len(levels)
    required = preferred = None
    if closeness is not None:
        at = depth_of(closeness.key, levels)
        if closeness.required:
            if at is None:
                return None
            required = at
            atoms = _labelled(atoms, at, depth)
        else:
            preferred = at
    rooms = _rooms((*atoms, *fixed), depth)
    if not _held_somewhere(rooms, (*atoms, *fixed), need, required):
        return None  # (every domain a search would try holds too few)
    best: tuple[tuple[object, ...], list[Atom[K]]] | None = None
    picks: dict[tuple[str, ...], list[Atom[K]] | None] = {}  # by the enclosing domain
    for anchor_depth, domain, inside, same in _anchors(atoms, fixed, depth, need):
        picked = picks[domain[:-1]] if same else _fill(inside, need, fixed)
        picks[domain] = picked
        if picked is None or (required is not None and anchor_depth < required):
            continue
        key = _score(picked, depth, preferred, need, rooms, avoid)
        if best is None or key < best[0]:
            best = (key, picked)
    if best is None:
        return None
    picked = best[1]
    return Choice(tuple(picked), len({a.place for a in picked}), span(picked, levels))


def holds(
    atoms: Sequence[Atom[K]],
    need: int,
    levels: Sequence[str],
    closeness: Closeness | None = None,
) -> bool:
    """Whether `choose` finds units for `need` members among these (with nothing fixed), as a
    sum: the fleet, or for a required level one domain of it, has room for them. A required key
    that is no level holds nothing."""
    required = None
    if closeness is not None and closeness.required:
        required = depth_of(closeness.key, levels)
        if required is None:
            return False
        atoms = _labelled(atoms, required, len(levels))
    return _held_somewhere(_rooms(atoms, len(levels)), atoms, need, required)


def _labelled(atoms: Sequence[Atom[K]], required: int, depth: int) -> Sequence[Atom[K]]:
    """The units whose nodes carry the required level's label: where a node is in the network is
    unknown without it, so it is in no domain of that level (as Kueue and KAI-Scheduler leave
    such nodes out). The node level (hostname) every node has."""
    if required > depth:
        return atoms
    return [a for a in atoms if a.place[required - 1]]


def _rooms(atoms: Iterable[Atom[K]], depth: int) -> list[dict[tuple[str, ...], int]]:
    """The room of every domain, by depth (0: the fleet)."""
    rooms: list[dict[tuple[str, ...], int]] = [{} for _ in range(depth + 1)]
    for atom in atoms:
        for d in range(depth + 1):
            prefix = atom.place[:d]
            rooms[d][prefix] = rooms[d].get(prefix, 0) + atom.room
    return rooms


def _held_somewhere(
    rooms: list[dict[tuple[str, ...], int]],
    atoms: Iterable[Atom[K]],
    need: int,
    required: int | None,
) -> bool:
    if required is None:
        return rooms[0].get((), 0) >= need
    if required < len(rooms):
        return any(room >= need for room in rooms[required].values())
    return any(a.nodes == 1 and a.room >= need for a in atoms)  # the node itself


def span(atoms: Sequence[Atom[K]], levels: Sequence[str]) -> str:
    """How many domains the units span at the deepest level their nodes are labelled with
    ("2 topology.k8s.aws/network-node-layer-3 domains"; "" without labels)."""
    labelled = [d for d in range(len(levels)) if any(a.place[d] for a in atoms)]
    if not labelled:
        return ""
    deepest = labelled[-1] + 1
    count = len({a.place[:deepest] for a in atoms})
    return f"{count} {levels[deepest - 1]} domain{'s' if count != 1 else ''}"


def _anchors(
    atoms: Sequence[Atom[K]], fixed: Sequence[Atom[K]], depth: int, need: int
) -> Iterable[tuple[int, tuple[str, ...], list[Atom[K]], bool]]:
    """Every domain that could enclose the job (its depth, its place, the atoms inside it): the
    fleet (depth 0), each domain of each level that holds all the fixed units, and each
    single-node unit that holds the whole job (the hostname level) when none is fixed. The flag
    says a domain holds the same atoms as its parent (one child: nothing new to work out)."""
    yield 0, (), list(atoms), False
    parents: dict[tuple[str, ...], int] = {(): len(atoms)}
    for d in range(1, depth + 1):
        wanted = {a.place[:d] for a in fixed}
        if len(wanted) > 1:
            return  # the fixed units span domains at this depth: no deeper domain holds them
        by_domain: dict[tuple[str, ...], list[Atom[K]]] = {p: [] for p in wanted}
        for atom in atoms:
            prefix = atom.place[:d]
            if not wanted or prefix in wanted:
                by_domain.setdefault(prefix, []).append(atom)
        for domain, inside in by_domain.items():
            yield d, domain, inside, parents.get(domain[:-1]) == len(inside)
        parents = {domain: len(inside) for domain, inside in by_domain.items()}
    if not fixed:
        for atom in atoms:
            if atom.nodes == 1 and atom.room >= need:
                yield depth + 1, (*atom.place, atom.order), [atom], False


def _fill(inside: Sequence[Atom[K]], need: int, fixed: Sequence[Atom[K]]) -> list[Atom[K]] | None:
    """Units for `need` members within these atoms, or None when they hold too few: the fixed
    first, then the rest of the deepest domains holding fixed units, then the deepest domains
    `_shares` picks; inside each, the units by best fit, else the largest first."""
    remaining = need - sum(a.room for a in fixed)
    if remaining <= 0:
        return list(fixed)
    if sum(a.room for a in inside) < remaining:
        return None
    groups: dict[tuple[str, ...], list[Atom[K]]] = {}
    for atom in inside:
        groups.setdefault(atom.place, []).append(atom)
    taken = list(fixed)
    mine = {a.place for a in fixed}
    for domain in sorted(mine & groups.keys()):
        share = min(sum(a.room for a in groups[domain]), remaining)
        if share > 0:
            taken += _best_fit(groups[domain], share, _room, _order, _units)
            remaining -= share
    others = {domain: atoms for domain, atoms in groups.items() if domain not in mine}
    room = {domain: sum(a.room for a in atoms) for domain, atoms in others.items()}
    shares = _shares(room, remaining)
    if len(shares) <= 1:
        return taken + [
            a
            for domain, share in shares.items()
            for a in _best_fit(others[domain], share, _room, _order, _units)
        ]
    # The domains are the fewest there can be; which of them is the one taken in part (best fit
    # says the smallest that completes) is then chosen for the fewest units: every other domain
    # whole, this one what is left. (Each domain's units taken whole are worked out once: a
    # job spanning k domains costs k best fits, not k * k.)
    whole = {
        domain: _best_fit(others[domain], room[domain], _room, _order, _units) for domain in shares
    }
    total = sum(room[domain] for domain in shares)
    units_whole = sum(len(units) for units in whole.values())
    parts = {
        partial: _best_fit(
            others[partial], remaining - (total - room[partial]), _room, _order, _units
        )
        for partial in shares
    }
    # (min keeps the first of the fewest, in the order of `shares`)
    partial = min(shares, key=lambda d: units_whole - len(whole[d]) + len(parts[d]))
    part = parts[partial]
    return taken + [a for domain in shares for a in (part if domain == partial else whole[domain])]


def _shares(room: dict[tuple[str, ...], int], remaining: int) -> dict[tuple[str, ...], int]:
    """How much of each domain the job takes: best fit (the one domain that holds it with the
    least room over); else the fewest domains there can be (as many as the largest hold), and of
    the sets of that many that hold it, the one with the least room in all (`_tightest`): a job
    that must span domains takes the most broken-up ones and leaves the emptiest whole."""
    fitting = [domain for domain in room if room[domain] >= remaining]
    if fitting:
        return {min(fitting, key=lambda domain: (room[domain], domain)): remaining}
    largest = sorted(room.values(), reverse=True)
    count = next(
        (k for k in range(1, len(largest) + 1) if sum(largest[:k]) >= remaining), len(largest)
    )
    return {domain: room[domain] for domain in _tightest(room, count, remaining)}


def _tightest(
    room: dict[tuple[str, ...], int], count: int, remaining: int
) -> list[tuple[str, ...]]:
    """`count` domains holding `remaining` with the least room in all: sums reachable with each
    number of domains, as bit sets (a subset-sum table), then walked back. A table larger than
    `TIGHTEST_CELLS` (a job of hundreds of members over as many domains of a node or two: node
    labels and job sizes are anyone's) is not worked out: the `count` largest domains hold the
    job (that is how `count` was found), and are taken."""
    domains = sorted(room, key=lambda domain: (-room[domain], domain))
    if len(domains) * (count + 1) > TIGHTEST_CELLS:
        return domains[:count]
    reach = [1] + [0] * count  # reach[c]: bit s set when c domains seen so far sum to s
    before: list[list[int]] = []
    for domain in domains:
        before.append(list(reach))
        for c in range(count, 0, -1):
            reach[c] |= reach[c - 1] << room[domain]
    over = reach[count] >> remaining
    total = remaining + (over & -over).bit_length() - 1
    chosen: list[tuple[str, ...]] = []
    c, s = count, total
    for i in range(len(domains) - 1, -1, -1):
        if c == 0:
            break
        if (before[i][c] >> s) & 1:
            continue  # reachable without this domain
        chosen.append(domains[i])
        s -= room[domains[i]]
        c -= 1
    return chosen


def _room(atom: Atom[K]) -> int:
    return atom.room


def _order(atom: Atom[K]) -> str:
    return atom.order


T = TypeVar("T")


def _units(atom: Atom[K], share: int) -> list[Atom[K]]:
    """The unit, with the room this job takes of it."""
    return [replace(atom, room=min(atom.room, share))]


def _best_fit(
    pool: Sequence[T],
    remaining: int,
    room: Callable[[T], int],
    order: Callable[[T], object],
    take: Callable[[T, int], list[Atom[K]]],
) -> list[Atom[K]]:
    """From `pool` (holding at least `remaining`): the one with the least room that holds the
    rest, else the one with the most room (the fewest taken), and again."""
    left = sorted(pool, key=lambda item: (-room(item), order(item)))
    taken: list[Atom[K]] = []
    for i, item in enumerate(left):
        if remaining <= 0:
            break
        if room(item) >= remaining:
            # left[i:] holds the ones that fit first (most room first): the last of them with
            # the least room, the first in order of those with that room.
            last = i
            while last + 1 < len(left) and room(left[last + 1]) >= remaining:
                last += 1
            least = room(left[last])
            chosen = next(x for x in left[i : last + 1] if room(x) == least)
            return taken + take(chosen, remaining)
        taken += take(item, room(item))
        remaining -= room(item)
    return taken


def _score(
    picked: Sequence[Atom[K]],
    depth: int,
    preferred: int | None,
    need: int,
    rooms: list[dict[tuple[str, ...], int]],
    avoid: Collection[tuple[str, ...]] = (),
) -> tuple[object, ...]:
    """Smaller is better: a preferred level kept, then the domains spanned (deepest level
    first), then the room the touched domains have over the job's need (best fit, deepest
    first), then the units taken, then their order."""
    spans = tuple(len({a.place[:d] for a in picked}) for d in range(depth, 0, -1))
    over = tuple(
        sum(rooms[d][p] for p in {a.place[:d] for a in picked}) - need for d in range(depth, -1, -1)
    )
    kept = 0
    if preferred is not None:
        if preferred > depth:
            kept = 0 if len(picked) == 1 and picked[0].nodes == 1 else 1
        else:
            kept = 0 if len({a.place[:preferred] for a in picked}) == 1 else 1
    kept_for_others = len({a.place for a in picked} & set(avoid))
    return (kept, spans, kept_for_others, over, len(picked), tuple(sorted(a.order for a in picked)))


def network_order(
    places: Mapping[str, tuple[str, ...]],
    nodes: Iterable[str],
    units: Mapping[str, str] | None = None,
) -> list[str]:
    """Nodes in network order: by place (broadest level first), then unit (`units`: a node's
    UltraServer, the domain below the deepest level), then name, so consecutive ranks sit in the
    same deepest domain and the same UltraServer."""
    within = units or {}
    return sorted(nodes, key=lambda n: (places.get(n, ()), within.get(n, ""), n))
