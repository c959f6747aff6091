"""Which pods to move off one node so that a pending pod gets an allowed block, and where each of
them can go again right now. Pure: shared by the extender's consolidation
(extender/loops/consolidating) and the simulator (sim/consolidation).

A pod is stranded by fragmentation when some node has its count free but no node has an allowed
block for it (`fits_by_count` and the allocator's refusal). The sets examined are those of
core/eviction: the pods holding one allowed block, best first (lowest highest priority, fewest
disruption-budget violations, fewest pods, least work lost). A set may be moved when:

- every pod in it is of lower priority than the pending pod, or of equal priority and placed
  again elsewhere by this plan (`place_again`: the allocator on each node as it stands, whole
  request, contiguity included, each placement counted for the next);
- none of them is a pod that is never moved (`Mover.never`: a bare pod, one that opts out, an
  UltraServer or MPI job's worker, a DaemonSet's pod);
- no disruption budget is broken (a pod whose budget allows no disruption is never moved);
- there are at most `max_victims` of them.

Lower-priority pods are placed again too where there is room (their destinations are held for
their replacements as well), but they may go without one, as preemption lets them. A refused
node comes with the reason of its best set, which `why` and the dry run show.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    Policy,
    allocate,
    check_request,
    free_devices,
)
from neuron_scheduler.core.eviction import (
    Eviction,
    Key,
    Occupant,
    Violations,
    eviction_options,
    no_budgets,
)
from neuron_scheduler.core.ids import format_ids
from neuron_scheduler.core.resources import NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology

DEFAULT_MAX_VICTIMS = 16  # KAI-Scheduler's --max-consolidation-preemptees


@dataclass(frozen=True, slots=True)
class Mover:
    """A pod on the node, as consolidation weighs it."""

    occupant: Occupant
    request: NeuronRequest
    name: str  # namespace/name, for reasons
    never: str = ""  # why it is never moved ("a bare pod", ...); "" when it may be


@dataclass(frozen=True, slots=True)
class Room:
    """A node a moved pod may go to, as the pod's replacement would find it before the plan."""

    node: str
    topology: Topology
    state: NodeState


@dataclass(frozen=True, slots=True)
class Destination:
    pod: str  # the moved pod's uid (its replacement gets this place)
    node: str
    placement: Placement


@dataclass(frozen=True, slots=True)
class Move:
    """A plan for one node: evict `victims`, and the pending pod gets `block`."""

    node: str
    victims: tuple[str, ...]  # uids, highest priority first
    block: Placement
    destinations: tuple[Destination, ...]  # for the victims that have one
    key: Key


@dataclass(frozen=True, slots=True)
class NoMove:
    """Why no set of pods on the node may be moved for the pending pod."""

    node: str
    reason: str


# (moved pod's uid, its request) -> the nodes it may go to (those its own spec admits).
Rooms = Callable[[str, NeuronRequest], Iterable[Room]]


def fits_by_count(topology: Topology, state: NodeState, request: NeuronRequest) -> bool:
    """The node allows the request's count and has that many devices (or cores) free, in one
    block or not."""
    if check_request(topology, request) is not None:
        return False
    if request.unit is Unit.DEVICE:
        return free_devices(topology, state) >= request.count
    free = topology.total_cores - state.used_cores.bit_count() - state.unattributed_cores
    return free >= request.count


def plan_move(
    node: str,
    topology: Topology,
    base: NodeState,
    request: NeuronRequest,
    priority: int,
    movers: Mapping[str, Mover],
    rooms: Rooms,
    violations: Violations = no_budgets,
    max_victims: int = DEFAULT_MAX_VICTIMS,
    policy: Policy = Policy.BEST_FIT,
) -> Move | NoMove:
    """The best set of pods on `node` to move for a pending pod of `priority`, or why none may
    be moved. `base` is the node as the pending pod sees it (pods already leaving taken out);
    `movers` are the pods still there."""
    occupants = {uid: m.occupant for uid, m in movers.items()}
    # Sets of any pod the pending pod does not yield to, so a refusal can say which rule stops
    # the best of them (a budget, an opt-out), not only that nothing was found.
    within = {uid: o for uid, o in occupants.items() if o.priority <= priority}
    options = eviction_options(topology, base, request, within, occupants, violations, policy)
    if not options:
        return NoMove(node, "every allowed block holds a pod of higher priority, or a held block")
    first_reason = ""
    for option in options:
        reason = _rule_out(option, movers, max_victims)
        if reason is None:
            destinations, stranded = place_again(
                node, topology, base, option, movers, priority, rooms, policy
            )
            if not stranded:
                return Move(node, option.victims, option.block, destinations, option.key)
            names = ", ".join(movers[uid].name for uid in stranded)
            reason = f"{names} of equal priority cannot be placed again elsewhere now"
        first_reason = first_reason or f"devices {_ids(option.block.devices)}: {reason}"
    return NoMove(node, first_reason)


def _rule_out(option: Eviction, movers: Mapping[str, Mover], max_victims: int) -> str | None:
    never = [movers[uid] for uid in option.victims if movers[uid].never]
    if never:
        return "; ".join(f"{m.name} is {m.never}" for m in never[:3])
    if option.key[1]:  # disruption-budget violations
        return (
            "the PodDisruptionBudget of "
            + _names(movers, option.victims)
            + (" allows no disruption")
        )
    if len(option.victims) > max_victims:
        return f"it would move {len(option.victims)} pods (at most {max_victims})"
    return None


def place_again(
    node: str,
    topology: Topology,
    base: NodeState,
    option: Eviction,
    movers: Mapping[str, Mover],
    priority: int,
    rooms: Rooms,
    policy: Policy = Policy.BEST_FIT,
) -> tuple[tuple[Destination, ...], tuple[str, ...]]:
    """Where each victim's replacement can go now: the largest first, each on the node the
    allocator scores best for it (ties: the first the rooms give), none on the block freed for
    the pending pod, each placement counted for the next. (destinations, the victims of equal
    priority that found none: the plan may not go ahead with those.)"""
    victims = [movers[uid] for uid in option.victims]
    after = NodeState(
        base.used_cores & ~_cores(victims),
        max(base.unattributed_cores - sum(v.occupant.unknown_cores for v in victims), 0),
    )
    taken: dict[str, int] = {node: option.block.core_mask}
    destinations: list[Destination] = []
    stranded: list[str] = []
    order = sorted(option.victims, key=lambda uid: (-_size(topology, movers[uid].request), uid))
    for uid in order:
        mover = movers[uid]
        best: tuple[int, Room, Placement] | None = None
        for room in rooms(uid, mover.request):
            state = after if room.node == node else room.state
            seen = NodeState(state.used_cores | taken.get(room.node, 0), state.unattributed_cores)
            decision = allocate(room.topology, seen, mover.request, policy)
            if isinstance(decision, Placement) and (best is None or decision.score > best[0]):
                best = (decision.score, room, decision)
        if best is None:
            if mover.occupant.priority >= priority:
                stranded.append(uid)
            continue
        _, room, placement = best
        taken[room.node] = taken.get(room.node, 0) | placement.core_mask
        destinations.append(Destination(uid, room.node, placement))
    return tuple(destinations), tuple(stranded)


def _cores(victims: list[Mover]) -> int:
    mask = 0
    for victim in victims:
        mask |= victim.occupant.cores
    return mask


def _size(topology: Topology, request: NeuronRequest) -> int:
    return request.count * (topology.cores_per_device if request.unit is Unit.DEVICE else 1)


def _names(movers: Mapping[str, Mover], uids: Iterable[str]) -> str:
    names = [movers[uid].name for uid in uids]
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _ids(ids: tuple[int, ...]) -> str:
    return format_ids(list(ids))
