"""Which pods to evict from a node so a preemptor gets an allowed block. Pure.

Shared by the extender's preempt verb and the simulator. The sets examined are "the pods holding
cores of one allowed block" (a contiguous run on a ring or chain, a whole row or half on a torus,
a core window on allowed devices): any set that frees a block contains that block's holders, and
the order below only grows as pods are added, so the best block's holders are the best set of
all. Order: lowest priority of the highest victim, then fewest disruption-budget violations,
then fewest pods, then least work lost (the youngest pods). Only pods of lower priority than the
preemptor are victims. Pods whose ids are unknown (placed by another scheduler) hold a count of
cores somewhere: they are added, cheapest first, only when the block alone leaves too few cores
beside them. The answer is checked with the allocator itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    Policy,
    allocate,
    allowed_blocks,
)
from neuron_scheduler.core.ids import mask_ids
from neuron_scheduler.core.resources import NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology, TopologyKind

# Switches allow any set of devices: combinations of devices are tried only up to this many.
MAX_SWITCH_COMBINATIONS = 5000
LOWEST_PRIORITY = -(2**31)

Key = tuple[int, int, int, float]  # highest victim priority, PDB violations, pods, work lost
Violations = Callable[[Sequence[str]], int]  # disruption-budget violations of a set of pods


@dataclass(frozen=True, slots=True)
class Occupant:
    """A pod on the node, as eviction weighs it."""

    cores: int = 0  # mask of the cores it holds, when known
    unknown_cores: int = 0  # cores it holds somewhere, ids unknown
    priority: int = 0
    started: float = 0.0  # seconds since the epoch; 0 when unknown (counts as oldest)


@dataclass(frozen=True, slots=True)
class Eviction:
    victims: tuple[str, ...]  # highest priority first, then longest running (kube-scheduler's)
    block: Placement  # where the preemptor goes once they are gone
    key: Key
    kept: bool  # the caller's suggested victims (kube-scheduler's) were the answer


def no_budgets(_: Sequence[str]) -> int:
    return 0


def plan_eviction(
    topology: Topology,
    base: NodeState,
    request: NeuronRequest,
    priority: int,
    occupants: Mapping[str, Occupant],
    suggested: Sequence[str] = (),
    violations: Violations = no_budgets,
    policy: Policy = Policy.BEST_FIT,
) -> Eviction | None:
    """The pods to evict, or None when no set of lower-priority occupants frees a block.

    `base` is the node as the preemptor would find it with nobody evicted (pods already leaving
    taken out); `occupants` are the pods still there. `suggested` (kube-scheduler's own victims)
    is the answer when it frees a block and no other set is better (ties go to it)."""
    lower = {uid: o for uid, o in occupants.items() if o.priority < priority}
    key = _key_of(lower, violations)
    best: Eviction | None = None
    if suggested and set(suggested) <= set(lower):
        block = _frees(topology, base, request, [lower[u] for u in suggested], policy)
        if block is not None:
            best = Eviction(_ordered(lower, suggested), block, key(suggested), kept=True)
    options = eviction_options(topology, base, request, lower, occupants, violations, policy)
    if options and (best is None or options[0].key < best.key):
        best = options[0]
    return best


def eviction_options(
    topology: Topology,
    base: NodeState,
    request: NeuronRequest,
    eligible: Mapping[str, Occupant],
    occupants: Mapping[str, Occupant],
    violations: Violations = no_budgets,
    policy: Policy = Policy.BEST_FIT,
) -> list[Eviction]:
    """Every set of `eligible` occupants that frees an allowed block (one per block: its
    holders, plus eligible pods of unknown ids where the block alone leaves too few cores), best
    first by the order above. A block that any other occupant holds is no option. Consolidation
    walks this list for the first set it may move; preemption takes the first."""
    key = _key_of(eligible, violations)
    options: list[Eviction] = []
    seen: set[frozenset[str]] = set()
    for blockers in _block_holders(topology, request, occupants, eligible, base):
        chosen = _with_unknown(topology, base, request, blockers, eligible, key, policy)
        if chosen is None or frozenset(chosen[0]) in seen:
            continue
        victims, block = chosen
        seen.add(frozenset(victims))
        options.append(Eviction(_ordered(eligible, victims), block, key(victims), kept=False))
    options.sort(key=lambda option: option.key)  # stable: ties keep the fewest-holders order
    return options


def _key_of(
    eligible: Mapping[str, Occupant], violations: Violations
) -> Callable[[Sequence[str]], Key]:
    def key(victims: Sequence[str]) -> Key:
        chosen = [eligible[uid] for uid in victims]
        return (
            max((o.priority for o in chosen), default=LOWEST_PRIORITY),
            violations(victims),
            len(chosen),
            -sum(o.started for o in chosen),
        )

    return key


def _ordered(eligible: Mapping[str, Occupant], victims: Sequence[str]) -> tuple[str, ...]:
    """Highest priority first, then longest running (kube-scheduler reads Pods[0])."""
    return tuple(sorted(victims, key=lambda u: (-eligible[u].priority, eligible[u].started)))


def _frees(
    topology: Topology,
    base: NodeState,
    request: NeuronRequest,
    victims: Sequence[Occupant],
    policy: Policy,
) -> Placement | None:
    used, unknown = base.used_cores, base.unattributed_cores
    for occupant in victims:
        used &= ~occupant.cores
        unknown -= occupant.unknown_cores
    decision = allocate(topology, NodeState(used, max(unknown, 0)), request, policy)
    return decision if isinstance(decision, Placement) else None


def _block_holders(
    topology: Topology,
    request: NeuronRequest,
    occupants: Mapping[str, Occupant],
    eligible: Mapping[str, Occupant],
    base: NodeState,
) -> list[frozenset[str]]:
    """For each allowed block, the pods holding any of its cores; blocks held by a pod that is
    not eligible (for preemption: of equal or higher priority), or by something that is not a
    pod (a held or reserved block), are skipped."""
    owner: dict[int, str] = {}
    for uid, occupant in occupants.items():
        for core in mask_ids(occupant.cores):
            owner[core] = uid
    known = 0
    for occupant in occupants.values():
        known |= occupant.cores
    foreign = base.used_cores & ~known  # reservations and held blocks: not evictable
    blocks = list(allowed_blocks(topology, request.unit, request.count))
    if not blocks and topology.kind is TopologyKind.SWITCH:
        blocks = _switch_blocks(topology, request, owner, occupants)
    sets: set[frozenset[str]] = set()
    for block in blocks:
        if block & foreign:
            continue
        holders = frozenset(owner[c] for c in mask_ids(block) if c in owner)
        if all(uid in eligible for uid in holders):
            sets.add(holders)
    return sorted(sets, key=lambda s: (len(s), sorted(s)))


def _switch_blocks(
    topology: Topology,
    request: NeuronRequest,
    owner: dict[int, str],
    occupants: Mapping[str, Occupant],
) -> list[int]:
    """Any devices connect on a switch: blocks of the cheapest devices, a bounded number."""
    per_device = topology.cores_per_device
    size = request.count if request.unit is Unit.DEVICE else -(-request.count // per_device)

    def cost(device: int) -> tuple[int, int]:
        cores = range(device * per_device, (device + 1) * per_device)
        holders = {owner[c] for c in cores if c in owner}
        return (
            max((occupants[u].priority for u in holders), default=LOWEST_PRIORITY),
            len(holders),
        )

    devices = sorted(range(topology.devices), key=cost)
    blocks = []
    for chosen in combinations(devices[: min(len(devices), size + 4)], size):
        blocks.append(topology.core_mask_of_devices(sum(1 << d for d in chosen)))
        if len(blocks) >= MAX_SWITCH_COMBINATIONS:
            break
    return blocks


def _with_unknown(
    topology: Topology,
    base: NodeState,
    request: NeuronRequest,
    blockers: frozenset[str],
    eligible: Mapping[str, Occupant],
    key: Callable[[Sequence[str]], Key],
    policy: Policy,
) -> tuple[tuple[str, ...], Placement] | None:
    """The block's pods, plus eligible pods of unknown ids (the cheapest first) when the block
    alone leaves too few cores beside them."""
    victims = sorted(blockers)
    block = _frees(topology, base, request, [eligible[u] for u in victims], policy)
    if block is not None:
        return tuple(victims), block
    unknown = [uid for uid, o in eligible.items() if o.unknown_cores and uid not in blockers]
    unknown.sort(key=lambda uid: key((uid,)))
    for uid in unknown:
        victims.append(uid)
        block = _frees(topology, base, request, [eligible[u] for u in victims], policy)
        if block is not None:
            return tuple(victims), block
    return None
