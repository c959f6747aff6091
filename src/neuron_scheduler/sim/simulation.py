"""An in-memory fleet run through the same filter, score and allocate code as the extender.

Pure: a fleet and an event stream go in, a result comes out. Reading files and drawing pictures
live in `scenario` and `report`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    Policy,
    Refusal,
    allocate,
    busy_devices,
    largest_free_core_run,
    largest_free_run,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE, NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.sim.preemption import (
    Preemption,
    Resident,
    count_victims,
    pick_key,
    verb_victims,
)


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    instance_type: str
    neuroncore_capacity: int | None = None  # overrides cores per device (Trn2 LNC=1 vs 2)


@dataclass(frozen=True, slots=True)
class PodEvent:
    time: float
    pod: str
    request: NeuronRequest | None  # None: the pod leaves
    priority: int = 0  # PriorityClass value: may preempt pods of lower priority


@dataclass(slots=True)
class SimNode:
    spec: NodeSpec
    topology: Topology
    state: NodeState = field(default_factory=NodeState)
    pods: dict[str, Placement] = field(default_factory=dict)

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
    arrivals: int = 0
    placed: int = 0
    departed: int = 0
    pending: dict[str, str] = field(default_factory=dict)  # pod -> last reason, at the end
    never_placed: int = 0  # pods that left (or the run ended) without ever being placed
    samples: list[Sample] = field(default_factory=list)
    preemption: Preemption = Preemption.VERB
    preempted: int = 0  # pods placed by evicting others
    evictions: int = 0  # pods evicted
    evictions_for_nothing: int = 0  # evicted, and the preemptor still did not fit there

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


def default_fleet() -> list[NodeSpec]:
    """A small mixed fleet whose every node still fits in one picture."""
    mix = [
        ("inf1.6xlarge", 2),
        ("inf1.24xlarge", 1),
        ("inf2.24xlarge", 2),
        ("inf2.48xlarge", 3),
        ("trn1.32xlarge", 3),
        ("trn2.48xlarge", 2),
    ]
    return [
        NodeSpec(f"{instance_type.replace('.', '-')}-{i}", instance_type)
        for instance_type, count in mix
        for i in range(count)
    ]


@dataclass(frozen=True, slots=True)
class PodMix:
    resource: str
    sizes: tuple[int, ...]
    weight: float
    priority: int = 0


DEFAULT_MIX = (
    PodMix(NEURONCORE, (1, 2, 2, 4, 8, 9, 16), 5.0),
    PodMix(NEURON, (1, 1, 2, 3, 4, 4, 8, 12, 16), 4.0),
    PodMix(NEURONDEVICE, (1, 2), 1.0),
)


def generate_workload(
    pods: int = 600,
    seed: int = 7,
    mean_interarrival: float = 1.0,
    mean_lifetime: float = 90.0,
    mix: tuple[PodMix, ...] = DEFAULT_MIX,
) -> list[PodEvent]:
    """A seeded stream of pod arrivals and departures (Poisson arrivals, exponential lifetimes)."""
    rng = random.Random(seed)
    weights = [m.weight for m in mix]
    events: list[PodEvent] = []
    now = 0.0
    for i in range(pods):
        now += rng.expovariate(1.0 / mean_interarrival)
        kind = rng.choices(mix, weights)[0]
        name = f"pod-{i:05d}"
        request = NeuronRequest(kind.resource, rng.choice(kind.sizes))
        events.append(PodEvent(now, name, request, kind.priority))
        events.append(PodEvent(now + rng.expovariate(1.0 / mean_lifetime), name, None))
    # Pods still running when the last one arrives stay, so the run ends on a busy fleet: that
    # end state is what the pictures show.
    events = [e for e in events if e.request is not None or e.time <= now]
    events.sort(key=lambda e: (e.time, e.request is not None, e.pod))
    return events


def feasible_nodes_to_find(nodes: int) -> int:
    """kube-scheduler's percentageOfNodesToScore default: stop filtering after this many fits."""
    if nodes < 100:
        return nodes
    percentage = max(5, 50 - nodes // 125)
    return max(100, nodes * percentage // 100)


GroupKey = tuple[Topology, int, int]  # topology, largest free device block, largest free core run


class Simulation:
    """Places pods one at a time like kube-scheduler with the extender: filter, score, bind."""

    SAMPLES = 400

    def __init__(
        self,
        fleet: list[NodeSpec],
        catalog: Catalog,
        policy: Policy,
        preemption: Preemption = Preemption.VERB,
    ) -> None:
        self.policy = policy
        self.preemption = preemption
        self.nodes: list[SimNode] = []
        for spec in fleet:
            resolved = catalog.resolve(spec.instance_type, None, spec.neuroncore_capacity)
            self.nodes.append(SimNode(spec, resolved.topology))
        # Nodes grouped by state (one decision serves every node in the same state), and states
        # grouped by their largest free blocks, so a request skips nodes too full for it without
        # asking the allocator: on a full fleet that is nearly every node.
        self._index: dict[GroupKey, dict[NodeState, dict[str, SimNode]]] = {}
        for node in self.nodes:
            self._add(node)
        self._to_find = feasible_nodes_to_find(len(self.nodes))
        self._where: dict[str, SimNode] = {}
        self._waiting: dict[str, NeuronRequest] = {}
        self._residents: dict[str, Resident] = {}
        self._priorities: dict[str, int] = {}
        self._now = 0.0

    def run(
        self, events: list[PodEvent], progress: Callable[[int], None] | None = None
    ) -> SimResult:
        result = SimResult(self.policy, self.nodes, preemption=self.preemption)
        every = max(1, len(events) // self.SAMPLES)
        reasons: dict[str, str] = {}
        for index, event in enumerate(events):
            self._now = event.time
            if event.request is not None:
                result.arrivals += 1
                self._priorities[event.pod] = event.priority
                reason = self._try_place(event.pod, event.request)
                if reason is not None and self._preempt(event.pod, event.request, result):
                    reason = None
                    result.preempted += 1
                if reason is None:
                    result.placed += 1
                else:
                    reasons[event.pod] = reason
                    self._waiting[event.pod] = event.request
            elif event.pod in self._where:
                node = self._release(event.pod)
                result.departed += 1
                # Waiting pods fit nowhere before; only this node changed, so only it can take
                # them now. Oldest first, like kube-scheduler's queue.
                for pod, request in list(self._waiting.items()):
                    if self._place_on(node, pod, request):
                        del self._waiting[pod]
                        reasons.pop(pod, None)
                        result.placed += 1
            elif self._waiting.pop(event.pod, None) is not None:
                result.never_placed += 1  # gave up while pending
            if event.request is None:
                self._priorities.pop(event.pod, None)
            if index % every == 0 or index == len(events) - 1:
                devices, cores = _utilization(self.nodes)
                result.samples.append(Sample(event.time, devices, cores, len(self._waiting)))
                if progress is not None:
                    progress(index + 1)
        result.pending = {pod: reasons[pod] for pod in self._waiting}
        result.never_placed += len(self._waiting)
        return result

    def _try_place(self, pod: str, request: NeuronRequest) -> str | None:
        """Place the pod on the best node; the reason it fits nowhere otherwise."""
        best: tuple[int, Placement, dict[str, SimNode]] | None = None
        found = 0
        by_cores = request.unit is Unit.CORE
        for (topology, block, run), states in self._index.items():
            if (run if by_cores else block) < request.count:
                continue
            for state, members in states.items():
                decision = allocate(topology, state, request, self.policy)
                if isinstance(decision, Refusal):
                    continue
                if best is None or decision.score > best[0]:
                    best = (decision.score, decision, members)
                found += len(members)
                if found >= self._to_find or decision.score == 10:
                    break
            if best is not None and (found >= self._to_find or best[0] == 10):
                break
        if best is None:
            return self._reason(request)
        _, placement, members = best
        self._bind(next(iter(members.values())), pod, placement, request)
        return None

    def _place_on(self, node: SimNode, pod: str, request: NeuronRequest) -> bool:
        decision = allocate(node.topology, node.state, request, self.policy)
        if isinstance(decision, Refusal):
            return False
        self._bind(node, pod, decision, request)
        return True

    def _preempt(self, pod: str, request: NeuronRequest, result: SimResult) -> bool:
        """kube-scheduler's PostFilter: evict lower-priority pods on one node and place the pod
        there. Without the verb the victims may free no allowed block: the pod then stays
        pending, their deletion makes kube-scheduler try again, and it may evict on another
        node; each round removes pods, so the rounds are bounded by the fleet."""
        priority = self._priorities.get(pod, 0)
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
                self._priorities.pop(victim, None)
            result.evictions += len(victims)
            if self._place_on(node, pod, request):
                return True
            result.evictions_for_nothing += len(victims)
        return False

    def _reason(self, request: NeuronRequest) -> str:
        refusals: Counter[str] = Counter()
        for (topology, _, _), states in self._index.items():
            for state, members in states.items():
                decision = allocate(topology, state, request, self.policy)
                if isinstance(decision, Refusal):
                    refusals[decision.reason] += len(members)
        return _summarize(refusals, len(self.nodes))

    def _bind(self, node: SimNode, pod: str, placement: Placement, request: NeuronRequest) -> None:
        self._remove(node)
        node.state = node.state.with_used(placement.core_mask)
        self._add(node)
        node.pods[pod] = placement
        self._where[pod] = node
        priority = self._priorities.get(pod, 0)
        self._residents[pod] = Resident(request, priority, self._now, placement.core_mask)

    def _release(self, pod: str) -> SimNode:
        node = self._where.pop(pod)
        placement = node.pods.pop(pod)
        del self._residents[pod]
        self._remove(node)
        node.state = node.state.without(placement.core_mask)
        self._add(node)
        return node

    def _key(self, node: SimNode) -> GroupKey:
        topology, used = node.topology, node.state.used_cores
        return (
            topology,
            largest_free_run(topology, busy_devices(topology, used)),
            largest_free_core_run(topology.total_cores, used),
        )

    def _add(self, node: SimNode) -> None:
        states = self._index.setdefault(self._key(node), {})
        states.setdefault(node.state, {})[node.name] = node

    def _remove(self, node: SimNode) -> None:
        key = self._key(node)
        states = self._index[key]
        members = states[node.state]
        del members[node.name]
        if not members:
            del states[node.state]
            if not states:
                del self._index[key]


def _summarize(refusals: Counter[str], nodes: int) -> str:
    """kube-scheduler's style: `0/14 nodes are available: 3 <reason>, 11 <reason>.`"""
    common = refusals.most_common()
    parts = [f"{count} {reason}" for reason, count in common[:3]]
    if len(common) > 3:
        parts.append(f"{sum(count for _, count in common[3:])} with other reasons")
    text = f"0/{nodes} nodes are available: " + "; ".join(parts)
    return text if text.endswith(".") else text + "."
