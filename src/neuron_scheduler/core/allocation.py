"""The allocator: which devices and cores a Neuron request gets on one node, or why it cannot.

Shared by the extender (filter, prioritize, bind), the simulator and the tests. Pure: the node's
state goes in, a decision comes out; callers apply it.

Node state is the set of cores in use (a device is busy for device requests as soon as any of its
cores is in use; a device request takes all of its cores), plus a count of cores held by pods whose
ids we do not know (placed without us): those must stay free somewhere, so a placement must leave at
least that many cores free.

What a node can still give (`free_devices`, `largest_free_block`) is defined here once, as what
`allocate` would give, and read by the extender's metrics and `status`. Refusal reasons name the
unit of every count they give (devices or cores).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import NamedTuple

from neuron_scheduler.core.demand import DemandWeights
from neuron_scheduler.core.ids import (
    cores_of_devices,
    devices_touched,
    format_ids,
    ids_mask,
    mask_ids,
)
from neuron_scheduler.core.resources import NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology, TopologyKind, free_runs


class Policy(StrEnum):
    BEST_FIT = "best-fit"
    FIRST_FIT = "first-fit"


@dataclass(frozen=True, slots=True)
class NodeState:
    used_cores: int = 0  # mask of global core ids in use
    unattributed_cores: int = 0  # cores held by pods whose ids we do not know

    def with_used(self, cores: int) -> NodeState:
        return NodeState(self.used_cores | cores, self.unattributed_cores)

    def without(self, cores: int) -> NodeState:
        return NodeState(self.used_cores & ~cores, self.unattributed_cores)


# Decisions are immutable values shared through caches. NamedTuples rather than frozen
# dataclasses: building one was a tenth of a whole decision's time.
class Placement(NamedTuple):
    devices: tuple[int, ...]  # in topology order (a wrapped ring run starts at its first device)
    cores: tuple[int, ...]  # global core ids, in the order of `devices`
    # 0-10, the node score: without demand, how tightly the request fills the free block it
    # was cut from; with it, how little it wastes (capped for small device pods, below).
    score: int

    @property
    def core_mask(self) -> int:
        return ids_mask(self.cores)


class Refusal(NamedTuple):
    reason: str
    # True when no amount of freeing on this node would help (bad count, more than the node has):
    # kube-scheduler must not preempt pods for it.
    unresolvable: bool = False


Decision = Placement | Refusal


def torus_count_warning(instance_type: str, count: int) -> str:
    # Exact upstream text: users grep their events for it.
    return (
        f"Instance type {instance_type} does not support requests for device: {count}. "
        "Please request a different number of devices."
    )


def allocate(
    topology: Topology,
    state: NodeState,
    request: NeuronRequest,
    policy: Policy = Policy.BEST_FIT,
    demand: DemandWeights = (),
) -> Decision:
    """Decide a placement. Deterministic: same inputs, same answer.

    `demand`: how often the cluster asks for each request shape lately (core.demand). With it,
    best-fit takes the placement that leaves the least free capacity unusable for those shapes,
    and scores nodes by that; without it, the placement that keeps the largest blocks whole.
    """
    decision = _decide(
        topology, state.used_cores, state.unattributed_cores, request.unit, request.count, policy
    )
    if not isinstance(decision, Placement) or not decides_by_demand(topology, policy, demand):
        return decision
    return _decide_by_demand(
        topology, state.used_cores, request.unit, request.count, demand, decision
    )


def decides_by_demand(topology: Topology, policy: Policy, demand: DemandWeights) -> bool:
    """Whether a placement allocate() finds is weighed by demand (and scored by it)."""
    return (
        bool(demand)
        and policy is not Policy.FIRST_FIT
        # Any set of a switch is connected: no choice wastes more than another.
        and topology.kind is not TopologyKind.SWITCH
    )


def check_request(topology: Topology, request: NeuronRequest) -> Refusal | None:
    """Refusal when the request can never fit this node, whatever is running on it."""
    return _static_refusal(topology, request.unit, request.count)


def counted(count: int, unit: Unit) -> str:
    """`1 device`, `3 cores`: every count in a reason carries its unit."""
    return f"{count} {unit.value}{'' if count == 1 else 's'}"


def _static_refusal(topology: Topology, unit: Unit, count: int) -> Refusal | None:
    if count < 1:
        return Refusal(f"requests {counted(count, unit)}; at least 1 is needed", True)
    if unit is Unit.DEVICE:
        allowed = topology.allowed_device_counts
        if allowed is not None and count not in allowed:
            return Refusal(torus_count_warning(topology.instance_type, count), True)
        if count > topology.devices:
            has = counted(topology.devices, Unit.DEVICE)
            return Refusal(
                f"requests {counted(count, unit)}; {topology.instance_type} has {has}", True
            )
    elif count > topology.total_cores:
        return Refusal(
            f"requests {counted(count, unit)}; {topology.instance_type} has "
            f"{counted(topology.total_cores, Unit.CORE)} "
            f"({counted(topology.devices, Unit.DEVICE)} x "
            f"{counted(topology.cores_per_device, Unit.CORE)})",
            True,
        )
    return None


# The decision is a pure function of a few small values, and a fleet has many nodes of the same
# type in the same state, so caching it is both safe and effective.
@lru_cache(maxsize=1 << 16)
def _decide(
    topology: Topology, used: int, unattributed: int, unit: Unit, count: int, policy: Policy
) -> Decision:
    refusal = _static_refusal(topology, unit, count)
    if refusal is not None:
        return refusal
    if unit is Unit.DEVICE:
        available = _free_devices(topology, used, unattributed)
    else:
        available = max(topology.total_cores - used.bit_count() - unattributed, 0)
    if available < count:
        held = ""
        if unattributed:
            held = f" ({counted(unattributed, Unit.CORE)} held with ids unknown)"
        return Refusal(f"needs {counted(count, unit)}; only {counted(available, unit)} free{held}")
    if unit is Unit.DEVICE:
        return _place_devices(topology, used, count, policy)
    return _place_cores(topology, used, count, policy)


def busy_devices(topology: Topology, used_cores: int) -> int:
    """Mask of devices with at least one core in use."""
    return devices_touched(used_cores, topology.cores_per_device, topology.devices)


def free_devices(topology: Topology, state: NodeState) -> int:
    """How many devices device requests could still be given on the node, in any shape: the
    devices with no core in use, less those the cores held with ids unknown must take once the
    free cores of partly used devices are full (the allocator counts those cores, not where they
    are). A device request of more is refused as `only N devices free`."""
    return _free_devices(topology, state.used_cores, state.unattributed_cores)


def _free_devices(topology: Topology, used: int, unattributed: int) -> int:
    idle = topology.devices - busy_devices(topology, used).bit_count()
    spare = topology.total_cores - used.bit_count() - unattributed
    return max(min(idle, spare // topology.cores_per_device), 0)


def largest_free_block(topology: Topology, state: NodeState) -> int:
    """The most devices one device request could get on the node now: the largest allowed size
    that `allocate` would place (0 when none)."""
    most = free_devices(topology, state)
    busy = busy_devices(topology, state.used_cores)
    if topology.kind is TopologyKind.TORUS:
        for size in _capacity_sizes(topology):
            if size <= most and any(not mask & busy for mask in topology.device_sets(size)):
                return size
        return 0
    # Chains, rings and switches allow every size up to their longest free run.
    return min(largest_free_run(topology, busy), most)


@lru_cache(maxsize=256)
def _capacity_sizes(topology: Topology) -> tuple[int, ...]:
    """Request sizes whose future satisfiability best-fit protects, largest first."""
    allowed = topology.allowed_device_counts
    if allowed is not None:
        return tuple(sorted(allowed, reverse=True))
    return tuple(range(topology.devices, 0, -1))


@lru_cache(maxsize=1 << 16)
def _future_capacity(topology: Topology, busy: int) -> tuple[int, ...]:
    """What a node with these busy devices can still serve; larger compares as better.

    Comparing these tuples is the best-fit rule: a placement that keeps a larger request
    satisfiable wins; among equals, the one that keeps more of them.
    - ring/chain: free run lengths, longest first (a run of L serves every request up to L);
    - torus: for each allowed size, largest first, how many allowed sets are wholly free;
    - switch: any set is connected, so only the number of free devices matters.
    """
    kind = topology.kind
    if kind is TopologyKind.SWITCH:
        return (topology.devices - busy.bit_count(),)
    if kind is TopologyKind.TORUS:
        free = topology.devices - busy.bit_count()
        return tuple(
            free if size == 1 else [mask & busy for mask in topology.device_sets(size)].count(0)
            for size in _capacity_sizes(topology)
        )
    return tuple(sorted((length for _, length in free_runs(topology, busy)), reverse=True))


def _block_size(topology: Topology, busy: int, chosen: int) -> int:
    """Devices in the largest wholly free block that contains `chosen` (before placement)."""
    kind = topology.kind
    if kind is TopologyKind.SWITCH:
        return topology.devices - busy.bit_count()
    if kind is TopologyKind.TORUS:
        for size in _capacity_sizes(topology):
            for mask in topology.device_sets(size):
                if mask & chosen == chosen and not mask & busy:
                    return size
        return chosen.bit_count()
    first = (chosen & -chosen).bit_length() - 1
    for start, length in free_runs(topology, busy):
        if (first - start) % topology.devices < length:
            return length
    return chosen.bit_count()


MAX_SCORE = 10  # an extender's scores are 0-10 (kube-scheduler's MaxExtenderPriority)


@lru_cache(maxsize=4096)
def fit_score(requested: int, block: int) -> int:
    """0-10; 10 when the request fills its free block exactly, so big free blocks stay free."""
    return max(1, min(MAX_SCORE, round(MAX_SCORE * requested / max(block, 1))))


def fullness_score(topology: Topology, used_cores: int) -> int:
    """0-10: how full a node is (its cores in use, as a share of its cores), as
    NodeResourcesFit's MostAllocated scores a node by what its pods request: kube-scheduler's
    tie-break toward fuller nodes, for placements it cannot count (DRA claims)."""
    return round(MAX_SCORE * used_cores.bit_count() / topology.total_cores)


def _ordered(topology: Topology, mask: int) -> tuple[int, ...]:
    """Device ids of a set in topology order: a ring run that wraps starts at its first device."""
    ids = mask_ids(mask)
    if topology.kind is TopologyKind.RING and len(ids) < topology.devices:
        for i in range(len(ids)):
            if ids[i - 1] != (ids[i] - 1) % topology.devices:
                return tuple(ids[i:] + ids[:i])
    return tuple(ids)


def _place_devices(topology: Topology, used: int, count: int, policy: Policy) -> Decision:
    busy = busy_devices(topology, used)
    if topology.kind is TopologyKind.SWITCH:
        free = [d for d in range(topology.devices) if not busy >> d & 1]
        candidates = [sum(1 << d for d in free[:count])] if len(free) >= count else []
    else:
        candidates = [mask for mask in topology.device_sets(count) if not mask & busy]
    if not candidates:
        return Refusal(_no_device_set_reason(topology, busy, count))
    if policy is Policy.FIRST_FIT or len(candidates) == 1:
        chosen = candidates[0]
    else:
        # max() keeps the first of equals, so ties go to the lowest start: deterministic.
        chosen = max(candidates, key=lambda mask: _future_capacity(topology, busy | mask))
    devices = _ordered(topology, chosen)
    return Placement(
        devices,
        cores_of_devices(devices, topology.cores_per_device),
        fit_score(count, _block_size(topology, busy, chosen)),
    )


@lru_cache(maxsize=1 << 16)
def largest_free_core_run(total: int, used: int) -> int:
    return max((length for _, length in _free_core_runs(total, used)), default=0)


def _free_core_runs(total: int, used: int) -> list[tuple[int, int]]:
    """Maximal runs of free core ids as (start, length); core ids never wrap around."""
    runs: list[tuple[int, int]] = []
    free = ~used & ((1 << total) - 1)
    while free:  # one step per run
        start = (free & -free).bit_length() - 1
        rest = free >> start
        length = (rest ^ (rest + 1)).bit_length() - 1  # the run of ones at the bottom of `rest`
        runs.append((start, length))
        free &= ~(((1 << length) - 1) << start)
    return runs


class _CoreWindows:
    """The static half of a core decision for one topology and count: which window starts
    (a window is `count` consecutive core ids) touch an allowed span of devices, and what each
    touches. Bit s of a mask stands for the window starting at core s."""

    __slots__ = ("allowed", "by_span", "shape")

    def __init__(self, topology: Topology, count: int) -> None:
        per_device = topology.cores_per_device
        self.allowed = 0
        self.shape: list[tuple[int, int]] = []  # by start: (touched devices, span)
        by_span: dict[int, int] = {}
        for start in range(topology.total_cores - count + 1):
            first_device = start // per_device
            span = (start + count - 1) // per_device - first_device + 1
            touched = ((1 << span) - 1) << first_device
            self.shape.append((touched, span))
            if _span_allowed(topology, touched):
                self.allowed |= 1 << start
                by_span[span] = by_span.get(span, 0) | 1 << start
        # (span, allowed starts of that span), smallest span first.
        self.by_span = sorted(by_span.items())


@lru_cache(maxsize=1024)
def _core_windows(topology: Topology, count: int) -> _CoreWindows:
    return _CoreWindows(topology, count)


def _window_starts(cores: int, count: int) -> int:
    """Mask of the starts s for which cores s .. s+count-1 are all in `cores`."""
    starts, width = cores, 1
    while width * 2 <= count:  # doubling: bit s set iff cores s .. s+width-1 are all set
        starts &= starts >> width
        width *= 2
    if width < count:
        starts &= starts >> (count - width)
    return starts


def _window_cover(starts: int, count: int) -> int:
    """Mask of the cores in the windows of `count` cores starting at `starts` (the inverse of
    `_window_starts`, by doubling too: no loop over the starts)."""
    cover, width = starts, 1
    while width * 2 <= count:  # bit c set iff some start lies in c-width+1 .. c
        cover |= cover << width
        width *= 2
    if width < count:
        cover |= cover << (count - width)
    return cover


def _run_around(used: int, start: int, total: int) -> tuple[int, int]:
    """The maximal free run of cores around free core `start`, as [run_start, run_end): from
    just above the highest used core below it to just below the lowest used core above it."""
    above = used >> start
    return (
        (used & ((1 << start) - 1)).bit_length(),
        start + (above & -above).bit_length() - 1 if above else total,
    )


def _place_cores(topology: Topology, used: int, count: int, policy: Policy) -> Decision:
    total = topology.total_cores
    windows = _core_windows(topology, count)
    free_starts = _window_starts(~used & ((1 << total) - 1), count) & windows.allowed
    if not free_starts:
        return Refusal(_no_core_run_reason(topology, used, count))
    busy = busy_devices(topology, used)
    # A placement inside devices that are already partly used breaks no free device, so it keeps
    # the most future capacity (touching a free device always lowers it): when there is one,
    # only those compete, on the other keys.
    inside_busy = free_starts & _window_starts(topology.core_mask_of_devices(busy), count)
    candidates = free_starts if policy is Policy.FIRST_FIT else inside_busy or free_starts
    shape = windows.shape
    if policy is Policy.FIRST_FIT:
        start = (candidates & -candidates).bit_length() - 1
        run_start, run_end = _run_around(used, start, total)
        return _core_placement(topology, start, count, shape[start][0], run_end - run_start)
    # Smaller spans first (span is a key, so among equals the order is still by start). A window
    # whose devices contain a smaller candidate's devices loses to it: it breaks at least as much
    # capacity and spans more. `smaller`: (span, first devices of that span's candidates).
    smaller: list[tuple[int, int]] = []
    contenders: list[tuple[int, int, int]] = []  # (start, touched, span), by span then start
    for span, span_starts in windows.by_span:
        group = candidates & span_starts
        firsts = 0
        while group:
            lowest = group & -group
            group ^= lowest
            start = lowest.bit_length() - 1
            touched = shape[start][0]
            first = touched & -touched
            firsts |= first
            for other_span, other_firsts in smaller:
                if other_firsts & ((first << (span - other_span + 1)) - first):
                    break
            else:
                contenders.append((start, touched, span))
        if firsts:
            smaller.append((span, firsts))
    if not inside_busy and len(contenders) > 1:
        # Capacity decides first (inside partly used devices it is the same for all): keep the
        # windows that leave the most, then compare the rest of the key on those alone.
        capacities: dict[int, tuple[int, ...]] = {}  # by touched devices: windows share them
        for _, touched, _ in contenders:
            if touched not in capacities:
                capacities[touched] = _future_capacity(topology, busy | touched)
        most = max(capacities.values())
        contenders = [c for c in contenders if capacities[c[1]] == most]
    best: tuple[tuple[int, int, bool], int, int, int] | None = None  # key, start, touched, run
    for start, touched, span in contenders:
        run_start, run_end = _run_around(used, start, total)
        run_length = run_end - run_start
        key = (
            -span,
            -run_length,  # best fit: the smallest free run that holds the request
            start == run_start or start == run_end - count,  # keep the rest of the run whole
        )
        # Strictly greater, by ascending start: ties keep the lowest start (deterministic).
        if best is None or key > best[0]:
            best = (key, start, touched, run_length)
    assert best is not None  # candidates was not empty
    _, start, touched, run_length = best
    return _core_placement(topology, start, count, touched, run_length)


@lru_cache(maxsize=1 << 14)
def _span_allowed(topology: Topology, touched: int) -> bool:
    return topology.span_allowed(touched)


def _core_placement(
    topology: Topology, start: int, count: int, touched: int, run_length: int
) -> Placement:
    return Placement(
        tuple(mask_ids(touched)), tuple(range(start, start + count)), fit_score(count, run_length)
    )


def largest_free_run(topology: Topology, busy: int) -> int:
    """The most devices a single request could still get on this node."""
    kind = topology.kind
    if kind is TopologyKind.SWITCH:
        return topology.devices - busy.bit_count()
    if kind is TopologyKind.TORUS:
        for size in _capacity_sizes(topology):
            if any(not mask & busy for mask in topology.device_sets(size)):
                return size
        return 0
    return min(
        max((length for _, length in free_runs(topology, busy)), default=0), topology.devices
    )


@lru_cache(maxsize=256)
def _torus_shape_text(topology: Topology, count: int) -> str:
    sets = ", ".join(format_ids(mask_ids(m)) for m in topology.device_sets(count))
    shape = "one whole row" if count == 4 else f"one aligned group of {count}"
    return f"{shape} ({sets})"


def _no_device_set_reason(topology: Topology, busy: int, count: int) -> str:
    free = [d for d in range(topology.devices) if not busy >> d & 1]
    free_text = f"(free devices: {format_ids(free)})"
    if topology.kind is TopologyKind.TORUS and 1 < count < topology.devices:
        shape = _torus_shape_text(topology, count)
        return f"needs {count} devices as {shape}; none is wholly free {free_text}"
    largest = counted(largest_free_run(topology, busy), Unit.DEVICE)
    return f"needs {count} contiguous devices; largest free contiguous run is {largest} {free_text}"


def _no_core_run_reason(topology: Topology, used: int, count: int) -> str:
    runs = _free_core_runs(topology.total_cores, used)
    longest = max((length for _, length in runs), default=0)
    free = mask_ids(~used & ((1 << topology.total_cores) - 1))
    where = " within one allowed device group" if topology.kind is TopologyKind.TORUS else ""
    return (
        f"needs {count} contiguous cores{where}; largest free contiguous core run is "
        f"{counted(longest, Unit.CORE)} (free cores: {format_ids(free)})"
    )


@lru_cache(maxsize=1024)
def allowed_blocks(topology: Topology, unit: Unit, count: int) -> tuple[int, ...]:
    """Every core mask a request could be given on an empty node: the allowed device sets (as
    their cores), or every window of `count` contiguous cores on an allowed span of devices.
    What preemption chooses among. A switch allows any device set: those are not enumerated
    (empty here; see `preempting`)."""
    if _static_refusal(topology, unit, count) is not None:
        return ()
    if unit is Unit.DEVICE:
        return tuple(topology.core_mask_of_devices(mask) for mask in topology.device_sets(count))
    window = (1 << count) - 1
    starts = _core_windows(topology, count).allowed
    return tuple(window << start for start in mask_ids(starts))


def is_valid_device_set(topology: Topology, devices: tuple[int, ...] | list[int]) -> bool:
    """Whether a set of devices obeys the topology's rule (for checking ids chosen elsewhere)."""
    mask = 0
    for d in devices:
        if d < 0 or d >= topology.devices:
            return False
        mask |= 1 << d
    if mask.bit_count() != len(devices) or not devices:
        return False
    if topology.kind is TopologyKind.SWITCH:
        return True
    return mask in topology.device_sets(len(devices))


def is_valid_core_set(topology: Topology, cores: tuple[int, ...] | list[int]) -> bool:
    """Whether core ids are contiguous and touch an allowed span of devices."""
    ordered = sorted(cores)
    if not ordered or ordered[0] < 0 or ordered[-1] >= topology.total_cores:
        return False
    if ordered != list(range(ordered[0], ordered[0] + len(ordered))):
        return False
    touched = 0
    for core in ordered:
        touched |= 1 << (core // topology.cores_per_device)
    return topology.span_allowed(touched)


# --- placement weighed by demand ---------------------------------------------------------------
#
# A node's free capacity is unusable for a request shape when no allowed placement of that shape
# can use it: every free device of a node that cannot serve the shape at all, the free devices
# outside every wholly free allowed set of its size, the free cores outside every free allowed
# window of its count. Weighted by how often each shape is asked for, that is how fragmented the
# node is for this cluster's work (the fragmentation measure of "Beware of Fragmentation", Weng et
# al., USENIX ATC '23, with connectivity in place of GPU shares). A placement's waste is how much
# it raises that measure beyond the capacity it takes itself: zero when it only uses capacity no
# shape could use or cuts into no block any shape needs. Best-fit by demand picks the placement
# with the least waste on each node, and nodes score by it, so kube-scheduler picks the node
# where the pod wastes least.

# Device requests of up to this many devices (a Trn torus's smallest group above one) score no
# higher than best-fit scores them. Larger ones score by demand alone.
SMALL_DEVICE_COUNT = 4


@lru_cache(maxsize=1 << 16)
def _decide_by_demand(
    topology: Topology,
    used: int,
    unit: Unit,
    count: int,
    demand: DemandWeights,
    fallback: Placement,
) -> Placement:
    before = _unusable(topology, used, demand)
    # The best-fit pick stands unless another placement wastes strictly less: among equals the
    # larger blocks stay whole.
    best_mask = fallback.core_mask
    best_after = _unusable(topology, used | best_mask, demand)
    plan = _demand_plan(topology, demand)
    busy = busy_devices(topology, used)
    for mask, touched in _candidates(topology, used, unit, count):
        # (not through _unusable's cache: the states after each placement are mostly new)
        after = _unusable_by(plan, topology, used | mask, busy | touched)
        if after < best_after:
            best_mask, best_after = mask, after
    score = _demand_score(topology, demand, best_mask, best_after - before)
    if unit is Unit.DEVICE and count <= SMALL_DEVICE_COUNT:
        # Best-fit's score (how tightly the node's best block fits) is a ceiling for small device
        # pods: demand alone sees no loss when a 4-device pod takes a whole ring of 12 that still
        # fits the 8 asked for, yet under churn those pods hole the rings and halves that 8-device
        # pods need. For core pods the ceiling was measured worse (BENCHMARKS.md, "Placement
        # quality"): it sends them to the tightest core run of any node, so nodes drain less.
        score = min(score, fallback.score)
    if best_mask == fallback.core_mask:
        return fallback._replace(score=score)
    cores = tuple(mask_ids(best_mask))
    if unit is Unit.DEVICE:
        devices = _ordered(
            topology, devices_touched(best_mask, topology.cores_per_device, topology.devices)
        )
        return Placement(devices, cores_of_devices(devices, topology.cores_per_device), score)
    per_device = topology.cores_per_device
    return Placement(tuple(sorted({core // per_device for core in cores})), cores, score)


def placement_score(
    topology: Topology,
    state: NodeState,
    unit: Unit,
    taken: int,
    policy: Policy = Policy.BEST_FIT,
    demand: DemandWeights = (),
) -> int:
    """0-10: the node score `allocate` gives a placement, for one chosen elsewhere (the
    scheduler's DRA allocator picks the device; the extender scores its node). `taken`: the
    placement's cores (a device request's: all of its devices' cores).

    Without demand, how tightly the request fills the free block it is cut from; with it, how
    little it wastes, capped for small device requests by the fit (allocate caps by the fit of
    its own best-fit pick, which may be another placement of the same request)."""
    used = state.used_cores
    count = taken.bit_count()
    if unit is Unit.DEVICE:
        chosen = devices_touched(taken, topology.cores_per_device, topology.devices)
        count = chosen.bit_count()
        fit = fit_score(count, _block_size(topology, busy_devices(topology, used), chosen))
    else:
        start = (taken & -taken).bit_length() - 1
        run_start, run_end = _run_around(used, start, topology.total_cores)
        fit = fit_score(count, run_end - run_start)
    if not decides_by_demand(topology, policy, demand):
        return fit
    score = demand_score(topology, used, taken, demand)
    if unit is Unit.DEVICE and count <= SMALL_DEVICE_COUNT:
        score = min(score, fit)
    return score


def demand_score(topology: Topology, used: int, taken: int, demand: DemandWeights) -> int:
    """The node score by demand alone, without best-fit's ceiling for small device pods (the
    rule before the ceiling; bench/quality_variants.py compares the two)."""
    raised = _unusable(topology, used | taken, demand) - _unusable(topology, used, demand)
    return _demand_score(topology, demand, taken, raised)


def _demand_score(topology: Topology, demand: DemandWeights, taken: int, raised: int) -> int:
    """0-10 from how much a placement wastes, in devices: how much the weighted unusable
    capacity rose (`raised`) plus what it took (it fell by what was taken of it). So taking
    capacity nothing asked-for could use costs nothing, cutting blocks costs what they were
    worth, and taking good capacity costs its size: a pod of ten devices or more scores 0
    everywhere and kube-scheduler's packing (MostAllocated) picks its node. Counting only
    what a large pod breaks was measured worse (BENCHMARKS.md, "Placement quality")."""
    total = sum(weight for _, _, weight in demand)
    waste = (raised + taken.bit_count() * total) / (total * topology.cores_per_device)
    return 10 - min(10, round(max(waste, 0.0)))


def _candidates(topology: Topology, used: int, unit: Unit, count: int) -> list[tuple[int, int]]:
    """Every placement the request could get now: (its cores, the devices it touches), masks."""
    if unit is Unit.DEVICE:
        busy = busy_devices(topology, used)
        return [
            (topology.core_mask_of_devices(mask), mask)
            for mask in topology.device_sets(count)
            if not mask & busy
        ]
    total = topology.total_cores
    windows = _core_windows(topology, count)
    starts = _window_starts(~used & ((1 << total) - 1), count) & windows.allowed
    window, shape = (1 << count) - 1, windows.shape
    return [(window << start, shape[start][0]) for start in mask_ids(starts)]


# A decision by demand weighs every placement the request could get (tens on a large node) by
# what each leaves unusable for every shape asked for, and a node's state after a bind is new to
# these caches: so one entry holds all shapes' sum for a state, and what the shapes share (the
# free cores, the busy devices) is worked out once (issue 50: it was most of a decision's time).
@lru_cache(maxsize=1 << 16)
def _unusable(topology: Topology, used: int, demand: DemandWeights) -> int:
    """Free cores unusable for the shapes asked for, weighted by how often each is asked."""
    return _unusable_by(_demand_plan(topology, demand), topology, used, -1)


# How `_unusable` weighs one shape on one topology, worked out once: (weight, whether the
# shape can never be placed there, its device count (0 for a core shape), its allowed window
# starts, and the shifts that find its free windows and, the other way, the cores they cover).
_ShapePlan = tuple[int, bool, int, int, tuple[int, ...]]


@lru_cache(maxsize=1024)
def _demand_plan(topology: Topology, demand: DemandWeights) -> tuple[_ShapePlan, ...]:
    plan: list[_ShapePlan] = []
    for unit, count, weight in demand:
        never = _never_placed(topology, unit, count)
        if unit is Unit.DEVICE or never:
            plan.append((weight, never, count if unit is Unit.DEVICE else 0, 0, ()))
            continue
        allowed = _core_windows(topology, count).allowed
        plan.append((weight, False, 0, allowed, _window_shifts(count)))
    return tuple(plan)


def _window_shifts(count: int) -> tuple[int, ...]:
    """The doubling steps of `_window_starts` and `_window_cover` for `count`."""
    shifts, width = [], 1
    while width * 2 <= count:
        shifts.append(width)
        width *= 2
    if width < count:
        shifts.append(count - width)
    return tuple(shifts)


def _unusable_by(plan: tuple[_ShapePlan, ...], topology: Topology, used: int, busy: int) -> int:
    """`_unusable` from the shapes' plan, `busy` the devices `used` touches (-1: not known yet).
    A decision by demand asks it for every placement it weighs (issue 50: tens a decision, most
    of what deciding a node's new state costs)."""
    free = ~used & ((1 << topology.total_cores) - 1)
    weighted = 0
    for weight, never, devices, allowed, shifts in plan:
        if never:
            weighted += weight * free.bit_count()
        elif devices:
            if busy < 0:
                busy = busy_devices(topology, used)
            usable = _device_set_cores(topology, busy, devices)
            weighted += weight * (free & ~usable).bit_count()
        else:
            starts = free
            for shift in shifts:
                starts &= starts >> shift
            cover = starts & allowed
            for shift in shifts:
                cover |= cover << shift
            weighted += weight * (free & ~cover).bit_count()
    return weighted


def _unusable_cores(topology: Topology, free: int, busy: int, unit: Unit, count: int) -> int:
    """The free cores a request of this shape could never be given on the node as it is, given
    its free cores and its busy devices. One shape at a time, plainly: `_unusable_by` works the
    same out for every shape from a plan, and the property tests hold it to this."""
    if _never_placed(topology, unit, count):
        return free
    if unit is Unit.DEVICE:
        # Free cores of partly used devices serve no device request.
        return free & ~_device_set_cores(topology, busy, count)
    starts = _window_starts(free, count) & _core_windows(topology, count).allowed
    return free & ~_window_cover(starts, count)


@lru_cache(maxsize=1024)
def _never_placed(topology: Topology, unit: Unit, count: int) -> bool:
    return _static_refusal(topology, unit, count) is not None


@lru_cache(maxsize=1 << 14)
def _device_set_cores(topology: Topology, busy: int, count: int) -> int:
    """The cores of every allowed set of `count` devices with none of them busy (a node has few
    busy-device masks: they key this well)."""
    usable = 0
    for mask in topology.device_sets(count):
        if not mask & busy:
            usable |= mask
    return topology.core_mask_of_devices(usable)
