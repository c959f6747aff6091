"""An in-memory fleet run through the extender's placement code and a model of kube-scheduler.

Pure: a fleet and an event stream go in, a result comes out. Reading files and drawing pictures
live in `scenario` and `report`; the standard fleets and streams in `workloads`.

Each pod goes through what a cluster does (sim/kubescheduler.py): kube-scheduler's resource
counts, the extender's filter (the allocator), the profile's scores plus the extender's, a random
pick among equals. A pod that fits nowhere may preempt (sim/preemption.py) and otherwise waits; it
is tried again, highest priority and then oldest first, whenever a pod leaves the node that could
take it. A placed pod runs for its duration, then leaves.

Fleets of 100 nodes or more: kube-scheduler stops at `numFeasibleNodesToFind` nodes; here nodes
alike are judged together, so the cut-off is applied to feasible nodes in the order of a
fullness index rather than kube-scheduler's rotating node order.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from neuron_scheduler.core.allocation import (
    Decision,
    NodeState,
    Placement,
    Policy,
    Refusal,
    allocate,
    busy_devices,
    check_request,
    fullness_score,
    is_valid_core_set,
    is_valid_device_set,
    largest_free_run,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import Demand, DemandWeights
from neuron_scheduler.core.resources import NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.sim.kubescheduler import (
    CHART,
    CPU,
    EXTENDER_SCALE,
    MEMORY,
    NodeResources,
    Profile,
    extender_score,
    feasible_nodes_to_find,
    in_tree_score,
)
from neuron_scheduler.sim.preemption import (
    Preemption,
    Resident,
    count_victims,
    pick_key,
    verb_victims,
)

# A node as the testbed's fake nodes advertise it (tests/builders.py).
DEFAULT_MILLI_CPU = 192_000
DEFAULT_MEMORY = 768 * 1024**3
# Pods of 8 devices or more: the ones fragmentation makes wait.
LARGE_DEVICES = 8

# The last argument: what the cluster asks for lately (core.demand), as the extender would know it.
Allocator = Callable[[Topology, NodeState, NeuronRequest, Policy, DemandWeights], Decision]
# Everything that decides a pod's fate on a node: its cores in use, its pods' requests by
# resource, its pod count, its allocatable.
NodeKey = tuple[NodeState, tuple[tuple[str, int], ...], int, NodeResources]


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    instance_type: str
    neuroncore_capacity: int | None = None  # overrides cores per device (Trn2 LNC=1 vs 2)


@dataclass(frozen=True, slots=True)
class PodEvent:
    time: float
    pod: str
    request: NeuronRequest | None  # None: the pod leaves (or, still pending, gives up)
    priority: int = 0  # PriorityClass value: may preempt pods of lower priority
    duration: float | None = None  # how long it runs once placed; None: until told to leave
    owned: bool = False  # a controller recreates it when evicted (consolidation may move it)


@dataclass(slots=True)
class SimNode:
    spec: NodeSpec
    topology: Topology
    resources: NodeResources
    state: NodeState = field(default_factory=NodeState)
    pods: dict[str, Placement] = field(default_factory=dict)
    requested: dict[str, int] = field(default_factory=dict)  # by resource name, as counted
    key: NodeKey | None = None  # its place in the simulation's index

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(slots=True)
class Sample:
    time: float
    device_utilization: float
    core_utilization: float
    pending: int


@dataclass(slots=True)
class SimResult:
    policy: Policy
    nodes: list[SimNode]
    label: str = ""  # what ran, for tables and file names
    profile: str = CHART.name
    arrivals: int = 0
    placed: int = 0
    departed: int = 0
    pending: dict[str, str] = field(default_factory=dict)  # pod -> last reason, at the end
    never_placed: int = 0  # pods that gave up (or the run ended) without ever being placed
    samples: list[Sample] = field(default_factory=list)
    preemption: Preemption = Preemption.VERB
    preempted: int = 0  # pods placed by evicting others
    evictions: int = 0  # pods evicted
    evictions_for_nothing: int = 0  # evicted, and the preemptor still did not fit there
    unblocked: int = 0  # pods placed by consolidation (sim/consolidation.py)
    moved: int = 0  # pods consolidation evicted (and placed again where it could)
    moved_for_nothing: int = 0  # moved, and the pod they were moved for still did not fit
    large_waits: list[float] = field(default_factory=list)  # placed large pods' waits
    large_pending_waits: list[float] = field(default_factory=list)  # still waiting at the end
    # Devices in use when a pod was first refused although some node had that many free.
    utilization_at_first_fragmentation: float | None = None
    fragmentation_refusals: int = 0
    # Placements the topology does not allow: 0 for every topology allocator (the property tests
    # say so too); the no-topology bound makes them on purpose.
    invalid_placements: int = 0
    # An autoscaler (sim/autoscaling.py): nodes it added, by why, and the seconds they were up.
    nodes_added: int = 0
    capacity_requests: int = 0  # of them, asked for stranded pods by a capacity request
    added_node_seconds: float = 0.0
    capacity_timeouts: int = 0

    @property
    def device_utilization(self) -> float:
        return _utilization(self.nodes)[0]

    @property
    def core_utilization(self) -> float:
        return _utilization(self.nodes)[1]

    @property
    def mean_device_utilization(self) -> float:
        return sum(s.device_utilization for s in self.samples) / max(len(self.samples), 1)

    @property
    def fragmentation(self) -> float:
        """Share of free devices that a request could not get in one set with the others on its
        node: 0 when every node's free devices form one block."""
        free_total = stranded = 0
        for node in self.nodes:
            busy = busy_devices(node.topology, node.state.used_cores)
            free = node.topology.devices - busy.bit_count()
            free_total += free
            stranded += free - largest_free_run(node.topology, busy)
        return stranded / free_total if free_total else 0.0

    def large_wait_mean(self) -> float:
        """Mean wait of large pods, counting those still waiting at the end by how long they
        had waited (leaving them out would reward never placing them)."""
        waits = self.large_waits + self.large_pending_waits
        return sum(waits) / len(waits) if waits else 0.0

    def large_wait_p95(self) -> float:
        waits = sorted(self.large_waits + self.large_pending_waits)
        return waits[min(len(waits) - 1, int(0.95 * len(waits)))] if waits else 0.0

    def pending_reasons(self) -> Counter[str]:
        return Counter(self.pending.values())


def _utilization(nodes: Iterable[SimNode]) -> tuple[float, float]:
    devices = busy = cores = used = 0
    for node in nodes:
        devices += node.topology.devices
        busy += busy_devices(node.topology, node.state.used_cores).bit_count()
        cores += node.topology.total_cores
        used += node.state.used_cores.bit_count()
    return (busy / devices if devices else 0.0, used / cores if cores else 0.0)


def topology_allocator(
    topology: Topology,
    state: NodeState,
    request: NeuronRequest,
    policy: Policy,
    demand: DemandWeights,
) -> Decision:
    return allocate(topology, state, request, policy, demand)


def count_allocator(
    topology: Topology,
    state: NodeState,
    request: NeuronRequest,
    policy: Policy,
    demand: DemandWeights,
) -> Decision:
    """The no-topology bound: any free devices or cores, connected or not (counts only; the
    counts a topology never allows are still refused)."""
    del policy, demand
    refusal = check_request(topology, request)
    if refusal is not None:
        return refusal
    per_device = topology.cores_per_device
    used = state.used_cores
    if request.unit is Unit.DEVICE:
        busy = busy_devices(topology, used)
        free = [d for d in range(topology.devices) if not busy >> d & 1]
        if len(free) < request.count:
            return Refusal(f"needs {request.count} devices; only {len(free)} free")
        devices = tuple(free[: request.count])
        cores = tuple(c for d in devices for c in range(d * per_device, (d + 1) * per_device))
        return Placement(devices, cores, 10)
    # Cores on devices already in use first: leaves whole devices whole, as a bound should.
    busy = busy_devices(topology, used)
    free_cores = [c for c in range(topology.total_cores) if not used >> c & 1]
    free_cores.sort(key=lambda c: (not busy >> (c // per_device) & 1, c))
    if len(free_cores) < request.count:
        return Refusal(f"needs {request.count} cores; only {len(free_cores)} free")
    chosen = tuple(sorted(free_cores[: request.count]))
    devices = tuple(sorted({c // per_device for c in chosen}))
    return Placement(devices, chosen, 10)


GroupKey = tuple[Topology, int, int]  # topology, free devices, free cores
# A node group that fits a pod: the extender's score, the placement, the group's nodes.
Feasible = tuple[int, Placement, dict[str, SimNode]]


@dataclass(slots=True)
class Waiting:
    """A pending pod, as kube-scheduler's queue holds it."""

    request: NeuronRequest
    priority: int
    arrived: float
    duration: float | None
    reason: str


class Simulation:
    """Places pods one at a time like kube-scheduler with the extender: filter, score, bind."""

    SAMPLES = 400

    def __init__(
        self,
        fleet: list[NodeSpec],
        catalog: Catalog,
        policy: Policy = Policy.BEST_FIT,
        preemption: Preemption = Preemption.VERB,
        profile: Profile = CHART,
        allocator: Allocator = topology_allocator,
        seed: int = 0,
    ) -> None:
        self.policy = policy
        self.preemption = preemption
        self.profile = profile
        self.allocator = allocator
        self._rng = random.Random(seed)
        # Every arrival is recorded, as the extender records every pod it sees appear.
        self.demand = Demand()
        self.catalog = catalog
        self.nodes: list[SimNode] = [self._make_node(spec) for spec in fleet]
        # Nodes grouped by everything that decides a pod's fate on them (one decision and one
        # score serve every node of a group), and groups by free devices and cores, so a request
        # skips nodes too full for it without asking the allocator.
        self._index: dict[GroupKey, dict[NodeKey, dict[str, SimNode]]] = {}
        for node in self.nodes:
            self._add(node)
        self._to_find = feasible_nodes_to_find(
            len(self.nodes), profile.percentage_of_nodes_to_score
        )
        self._where: dict[str, SimNode] = {}
        self._waiting: dict[str, Waiting] = {}
        self._residents: dict[str, Resident] = {}
        self._durations: dict[str, float | None] = {}
        self._departures: list[tuple[float, int, str]] = []
        self._sequence = 0
        self._now = 0.0
        self._invalid = 0

    def _make_node(self, spec: NodeSpec) -> SimNode:
        resolved = self.catalog.resolve(spec.instance_type, None, spec.neuroncore_capacity)
        topology = resolved.topology
        resources = NodeResources(
            (
                (CPU, DEFAULT_MILLI_CPU),
                (MEMORY, DEFAULT_MEMORY),
                ("aws.amazon.com/neuron", topology.devices),
                ("aws.amazon.com/neurondevice", topology.devices),
                ("aws.amazon.com/neuroncore", topology.total_cores),
            )
        )
        return SimNode(spec, topology, resources)

    # --- the run ------------------------------------------------------------------------------

    def run(
        self, events: list[PodEvent], progress: Callable[[int], None] | None = None
    ) -> SimResult:
        result = SimResult(
            self.policy, self.nodes, profile=self.profile.name, preemption=self.preemption
        )
        ordered = sorted(events, key=lambda e: (e.time, e.request is not None, e.pod))
        every = max(1, len(ordered) // self.SAMPLES)
        leaving: list[str] = []  # pods deleted together: released before any pod is retried
        for index, event in enumerate(ordered):
            self._leave_until(event.time, result)
            self._now = event.time
            if event.request is not None:
                self._arrive(event, result)
            elif event.pod in self._where:
                leaving.append(event.pod)
            elif self._waiting.pop(event.pod, None) is not None:
                result.never_placed += 1  # gave up while pending
            last = index == len(ordered) - 1
            if leaving and (last or ordered[index + 1].time != event.time):
                self._leave_together(leaving, result)
                leaving = []
            if index % every == 0 or last:
                devices, cores = _utilization(self.nodes)
                result.samples.append(Sample(event.time, devices, cores, len(self._waiting)))
                if progress is not None:
                    progress(index + 1)
        # The run ends at the last event, on a busy fleet: that end state is what the pictures
        # show. Pods still waiting count as never placed.
        result.invalid_placements = self._invalid
        result.pending = {pod: w.reason for pod, w in self._waiting.items()}
        result.never_placed += len(self._waiting)
        for waiting in self._waiting.values():
            if _is_large(waiting.request):
                result.large_pending_waits.append(self._now - waiting.arrived)
        return result

    def _arrive(self, event: PodEvent, result: SimResult) -> None:
        assert event.request is not None
        result.arrivals += 1
        self.demand.record(event.request.unit, event.request.count)
        waiting = Waiting(event.request, event.priority, event.time, event.duration, "")
        self._waiting[event.pod] = waiting
        reason = self._try_place(event.pod, waiting)
        if reason is not None and self._preempt(event.pod, waiting, result):
            reason = None
            result.preempted += 1
        if reason is None:
            self._placed(event.pod, waiting, result)
            return
        waiting.reason = reason
        if self._free_somewhere(event.request):
            result.fragmentation_refusals += 1
            if result.utilization_at_first_fragmentation is None:
                result.utilization_at_first_fragmentation = _utilization(self.nodes)[0]

    def _placed(self, pod: str, waiting: Waiting, result: SimResult) -> None:
        del self._waiting[pod]
        result.placed += 1
        if _is_large(waiting.request):
            result.large_waits.append(self._now - waiting.arrived)
        if waiting.duration is not None:
            self._sequence += 1
            heapq.heappush(self._departures, (self._now + waiting.duration, self._sequence, pod))

    def _leave_until(self, time: float, result: SimResult) -> None:
        while self._departures and self._departures[0][0] <= time:
            when, _, pod = heapq.heappop(self._departures)
            if pod in self._where:  # not evicted meanwhile
                self._now = when
                self._leave(pod, result)

    def _leave(self, pod: str, result: SimResult) -> None:
        node = self._release(pod)
        result.departed += 1
        # Waiting pods fit nowhere before; only this node changed, so only it can take them
        # now. In kube-scheduler's queue order: highest priority, then oldest.
        refused: set[NeuronRequest] = set()  # alike requests fail alike until the node changes
        for name in sorted(self._waiting, key=lambda p: self._queue_order(p)):
            waiting = self._waiting[name]
            if waiting.request in refused:
                continue
            if self._place_on(node, name, waiting.request):
                self._placed(name, waiting, result)
                refused.clear()
            else:
                refused.add(waiting.request)

    def _leave_together(self, pods: list[str], result: SimResult) -> None:
        """Pods deleted at one instant (kube-scheduler sees one change): release them all, then
        retry every waiting pod in queue order against the whole fleet."""
        if len(pods) == 1:
            self._leave(pods[0], result)
            return
        for pod in pods:
            self._release(pod)
            result.departed += 1
        for name in sorted(self._waiting, key=lambda p: self._queue_order(p)):
            waiting = self._waiting[name]
            reason = self._try_place(name, waiting)
            if reason is None:
                self._placed(name, waiting, result)
            else:
                waiting.reason = reason

    def _queue_order(self, pod: str) -> tuple[int, float]:
        waiting = self._waiting[pod]
        return (-waiting.priority, waiting.arrived)

    # --- one pod --------------------------------------------------------------------------------

    def _try_place(self, pod: str, waiting: Waiting) -> str | None:
        """Place the pod where kube-scheduler would; the reason it fits nowhere otherwise."""
        request = waiting.request
        by_cores = request.unit is Unit.CORE
        pod_request = {request.resource: request.count}
        feasible: list[Feasible] = []
        found = 0
        for (topology, free_devices, free_cores), groups in self._index.items():
            if (free_cores if by_cores else free_devices) < request.count:
                continue
            for key, members in groups.items():
                state, requested, pods, resources = key
                if not _counts_fit(resources, requested, pods, request):
                    continue
                decision = self.allocator(
                    topology, state, request, self.policy, self.demand.weights
                )
                if isinstance(decision, Refusal):
                    continue
                feasible.append((decision.score, decision, members))
                found += len(members)
            if found >= self._to_find:
                break
        if not feasible:
            return self._reason(request)
        if found == 1:
            _, placement, members = feasible[0]
            self._bind(next(iter(members.values())), pod, placement, request)
            return None
        best_total: int | None = None
        best: list[tuple[Placement, dict[str, SimNode]]] = []
        for score, placement, members in self._shortlist(feasible, request):
            node = next(iter(members.values()))
            state, requested, pods, resources = _key(node)
            total = in_tree_score(
                self.profile, resources, dict(requested), pods, pod_request
            ) + extender_score(self.profile, score)
            if self.profile.packing_weight:
                full = fullness_score(node.topology, state.used_cores | placement.core_mask)
                total += full * self.profile.packing_weight * EXTENDER_SCALE
            if best_total is None or total > best_total:
                best_total, best = total, [(placement, members)]
            elif total == best_total:
                best.append((placement, members))
        node, placement = self._break_tie(best, waiting)
        self._bind(node, pod, placement, request)
        return None

    def _shortlist(self, feasible: list[Feasible], request: NeuronRequest) -> list[Feasible]:
        """The nodes kube-scheduler scores, of those that fit: all of them. A hook for
        contenders that rule some out first (bench/quality_variants.py's reservation)."""
        del request
        return feasible

    def _break_tie(
        self, tied: list[tuple[Placement, dict[str, SimNode]]], waiting: Waiting
    ) -> tuple[SimNode, Placement]:
        """The node among equals: kube-scheduler picks uniformly at random."""
        del waiting
        pick = self._rng.randrange(sum(len(members) for _, members in tied))
        for placement, members in tied:
            if pick < len(members):
                return list(members.values())[pick], placement
            pick -= len(members)
        raise AssertionError("unreachable: the pick is within the tied nodes")

    def _place_on(self, node: SimNode, pod: str, request: NeuronRequest) -> bool:
        state, requested, pods, resources = _key(node)
        if not _counts_fit(resources, requested, pods, request):
            return False
        decision = self.allocator(node.topology, state, request, self.policy, self.demand.weights)
        if isinstance(decision, Refusal):
            return False
        self._bind(node, pod, decision, request)
        return True

    def _free_somewhere(self, request: NeuronRequest) -> bool:
        """Some node has the request's count free (ignoring contiguity), and allows the count."""
        by_cores = request.unit is Unit.CORE
        for (topology, free_devices, free_cores), _ in self._index.items():
            if (free_cores if by_cores else free_devices) >= request.count and (
                check_request(topology, request) is None
            ):
                return True
        return False

    def _preempt(self, pod: str, waiting: Waiting, result: SimResult) -> bool:
        """kube-scheduler's PostFilter: evict lower-priority pods on one node and place the pod
        there. Without the verb the victims may free no allowed block: the pod then stays
        pending, their deletion makes kube-scheduler try again, and it may evict on another
        node; each round removes pods, so the rounds are bounded by the fleet."""
        request, priority = waiting.request, waiting.priority
        for _ in range(len(self.nodes)):
            best: tuple[tuple[int, int, int, float], SimNode, list[str]] | None = None
            for node in self.nodes:
                residents = {n: self._residents[n] for n in node.pods}
                victims = count_victims(node.topology, residents, request, priority)
                if victims and self.preemption is Preemption.VERB:
                    answer = verb_victims(
                        node.topology,
                        node.state,
                        residents,
                        request,
                        priority,
                        victims,
                        self.policy,
                    )
                    victims = answer or []
                if not victims:
                    continue
                key = pick_key([residents[n] for n in victims])
                if best is None or key < best[0]:
                    best = (key, node, victims)
            if best is None:
                return False
            _, node, victims = best
            for victim in victims:
                self._release(victim)
            result.evictions += len(victims)
            if self._place_on(node, pod, request):
                return True
            result.evictions_for_nothing += len(victims)
        return False

    def _reason(self, request: NeuronRequest) -> str:
        refusals: Counter[str] = Counter()
        for (topology, _, _), groups in self._index.items():
            for key, members in groups.items():
                state, requested, pods, resources = key
                if not _counts_fit(resources, requested, pods, request):
                    reason = f"Insufficient {request.resource}"
                else:
                    decision = self.allocator(
                        topology, state, request, self.policy, self.demand.weights
                    )
                    if not isinstance(decision, Refusal):
                        continue  # fit, but beyond the cut-off
                    reason = decision.reason
                refusals[reason] += len(members)
        return _summarize(refusals, len(self.nodes))

    # --- bookkeeping ----------------------------------------------------------------------------

    def _bind(self, node: SimNode, pod: str, placement: Placement, request: NeuronRequest) -> None:
        if not _allowed(node.topology, placement, request):
            self._invalid += 1
        self._remove(node)
        node.state = node.state.with_used(placement.core_mask)
        node.requested[request.resource] = node.requested.get(request.resource, 0) + request.count
        node.pods[pod] = placement
        self._add(node)
        self._where[pod] = node
        priority = self._waiting[pod].priority if pod in self._waiting else 0
        self._residents[pod] = Resident(request, priority, self._now, placement.core_mask)

    def _release(self, pod: str) -> SimNode:
        node = self._where.pop(pod)
        resident = self._residents.pop(pod)
        self._remove(node)
        placement = node.pods.pop(pod)
        node.state = node.state.without(placement.core_mask)
        resource = resident.request.resource
        node.requested[resource] -= resident.request.count
        if not node.requested[resource]:
            del node.requested[resource]
        self._add(node)
        return node

    def _group(self, node: SimNode) -> GroupKey:
        topology, used = node.topology, node.state.used_cores
        busy = busy_devices(topology, used)
        return (
            topology,
            topology.devices - busy.bit_count(),
            topology.total_cores - used.bit_count(),
        )

    def _add(self, node: SimNode) -> None:
        node.key = _node_key(node)
        groups = self._index.setdefault(self._group(node), {})
        groups.setdefault(node.key, {})[node.name] = node

    def _remove(self, node: SimNode) -> None:
        group = self._group(node)
        groups = self._index[group]
        node_key = _key(node)
        members = groups[node_key]
        del members[node.name]
        if not members:
            del groups[node_key]
            if not groups:
                del self._index[group]


def _key(node: SimNode) -> NodeKey:
    assert node.key is not None  # every node is indexed from the start
    return node.key


def _node_key(node: SimNode) -> NodeKey:
    requested = tuple(sorted(node.requested.items()))
    pods = len(node.pods)
    return (node.state, requested, pods, node.resources)


def _counts_fit(
    resources: NodeResources,
    requested: tuple[tuple[str, int], ...],
    pods: int,
    request: NeuronRequest,
) -> bool:
    """kube-scheduler's NodeResourcesFit filter for this request (each resource by name)."""
    if pods + 1 > resources.pods:
        return False
    already = dict(requested).get(request.resource, 0)
    return already + request.count <= resources.get(request.resource)


def _allowed(topology: Topology, placement: Placement, request: NeuronRequest) -> bool:
    if is_valid_device_set(topology, placement.devices):
        return True
    return request.unit is Unit.CORE and is_valid_core_set(topology, placement.cores)


def _is_large(request: NeuronRequest) -> bool:
    return request.unit is Unit.DEVICE and request.count >= LARGE_DEVICES


def _summarize(refusals: Counter[str], nodes: int) -> str:
    """kube-scheduler's style: `0/14 nodes are available: 3 <reason>, 11 <reason>.`"""
    common = refusals.most_common()
    parts = [f"{count} {reason}" for reason, count in common[:3]]
    if len(common) > 3:
        parts.append(f"{sum(count for _, count in common[3:])} with other reasons")
    text = f"0/{nodes} nodes are available: " + "; ".join(parts)
    return text if text.endswith(".") else text + "."


__all__ = [
    "Allocator",
    "Feasible",
    "NodeSpec",
    "PodEvent",
    "Sample",
    "SimNode",
    "SimResult",
    "Simulation",
    "Waiting",
    "count_allocator",
    "topology_allocator",
]
