"""preempt: which lower-priority pods to evict on a node so the preemptor gets an allowed block.
No I/O.

kube-scheduler's own dry run picks victims by counting resources, so on a torus it may evict four
1-device pods from four different rows for a 4-device pod that needs one whole row, and still not
fit. For each candidate node it sends, this answers the set of pods whose removal frees an allowed
block (a contiguous run on a ring or chain, a whole row or half on a torus, a core window on
allowed devices), chosen only among pods of lower priority than the preemptor and, among the sets
that work, the best by: lowest priority of the highest victim, then fewest disruption-budget
violations, then fewest pods, then least work lost (the youngest pods). kube-scheduler's own victims
are kept when they already free an allowed block and no other set is better by that order (ties go
to kube-scheduler). A node where no set of lower-priority pods helps is dropped from the answer.

Only devices are weighed here. kube-scheduler's victims that hold no Neuron device were chosen for
its other resources (CPU, memory, ports) and stay in the answer; where the preemptor's devices
already fit, devices are not what is short and kube-scheduler's answer stands unchanged.

Every set examined is "the pods in one allowed block" (the fewest pods that free that block), and
the key only grows as pods are added, so the best block's pods are the best set overall; pods whose
ids are unknown (placed by another scheduler) are added by count only when the block alone does not
make room. The answer is checked with the allocator itself before it is given.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime
from itertools import combinations

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    Policy,
    allocate,
    allowed_blocks,
    check_request,
)
from neuron_scheduler.core.ids import format_ids, mask_ids
from neuron_scheduler.core.quantity import QuantityError
from neuron_scheduler.core.resources import NeuronRequest, RequestError, Unit
from neuron_scheduler.core.topology import Topology, TopologyKind
from neuron_scheduler.extender.budgets import DisruptionBudgets
from neuron_scheduler.extender.ledger import Claimant, Holding, Ledger
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.wire import (
    BadRequest,
    ExtenderPreemptionArgs,
    ExtenderPreemptionResult,
    MetaPod,
    MetaVictims,
    candidate_victims,
)
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import neuron_request

log = logging.getLogger("neuron_scheduler.extender")

# Switches allow any set of devices: combinations of devices are tried only up to this many.
MAX_SWITCH_COMBINATIONS = 5000

Key = tuple[int, int, int, float]  # highest victim priority, PDB violations, pods, work lost


@dataclass(frozen=True, slots=True)
class Plan:
    victims: tuple[str, ...]  # pod uids, highest priority first (kube-scheduler reads Pods[0])
    pdb_violations: int | None  # None: kube-scheduler's own count stands
    block: Placement  # where the preemptor goes once they are gone
    kept: bool  # kube-scheduler's own victims


class Preemptor:
    def __init__(
        self,
        ledger: Ledger,
        budgets: DisruptionBudgets,
        metrics: Metrics,
        policy: Policy = Policy.BEST_FIT,
    ) -> None:
        self.ledger = ledger
        self.budgets = budgets
        self.metrics = metrics
        self.policy = policy

    async def preempt(self, args: ExtenderPreemptionArgs) -> ExtenderPreemptionResult:
        if args.Pod is None:
            raise BadRequest("preempt request has no Pod")
        pod = args.Pod
        candidates = candidate_victims(args)
        self.metrics.preemptions.inc()
        try:
            request = neuron_request(pod)
        except QuantityError as error:
            raise BadRequest(str(error)) from error
        except RequestError as error:
            log.info("preemption for %s: %s; no node helps", pod.key, error)
            self.metrics.preempt_nodes.labels("dropped").inc(len(candidates))
            return ExtenderPreemptionResult({})
        answer: dict[str, MetaVictims] = {}
        for node, (given, violations) in candidates.items():
            if request is None:  # not ours to judge: kube-scheduler's choice stands
                answer[node] = MetaVictims([MetaPod(uid) for uid in given], violations)
                continue
            victims = self._answer(pod, request, node, given, violations)
            if victims is not None:
                answer[node] = victims
            # A node takes milliseconds and kube-scheduler may send hundreds: filter and bind
            # are answered in between.
            await asyncio.sleep(0)
        return ExtenderPreemptionResult(answer)

    def _answer(
        self, pod: Pod, request: NeuronRequest, node: str, given: list[str], violations: int
    ) -> MetaVictims | None:
        plan = self.plan(pod, request, node, given)
        if plan is None:
            self.metrics.preempt_nodes.labels("dropped").inc()
            return None
        self.metrics.preempt_nodes.labels("kept" if plan.kept else "replaced").inc()
        self.metrics.preempt_victims.inc(len(plan.victims))
        log.info(
            "preemption for %s on %s: evict %s to free devices %s (%s)",
            pod.key,
            node,
            ", ".join(self.ledger.pod_key(uid) for uid in plan.victims),
            format_ids(list(plan.block.devices)),
            "kube-scheduler's victims" if plan.kept else "a contiguous block",
        )
        if plan.pdb_violations is not None:
            violations = plan.pdb_violations
        return MetaVictims([MetaPod(uid) for uid in plan.victims], violations)

    def plan(self, pod: Pod, request: NeuronRequest, node: str, given: list[str]) -> Plan | None:
        """The victims on `node` for `pod`, or None when no set of lower-priority pods helps."""
        entry = self.ledger.nodes.get(node)
        if entry is None or check_request(entry.topology, request) is not None:
            return None
        topology = entry.topology
        priority = pod.spec.priority or 0
        on_node = self.ledger.pods_holding(node)
        # Already leaving: neither victims nor obstacles (kube-scheduler skips them as victims).
        staying = {uid: h for uid, h in on_node.items() if not h.terminating}
        base = self._state_without(node, topology, pod, set(on_node) - set(staying))
        lower = {uid: h for uid, h in staying.items() if h.priority < priority}
        # kube-scheduler's victims that hold no Neuron device are there for its other resources
        # (CPU, memory, ports): they stay in every answer, after ours.
        others = tuple(uid for uid in given if uid not in on_node)
        fits = allocate(topology, base, request, self.policy)
        if isinstance(fits, Placement):
            # Devices are not what is short here: kube-scheduler's choice stands as it is.
            return Plan(tuple(given), None, fits, kept=True) if given else None
        best: tuple[Key, tuple[str, ...], Placement] | None = None
        mine = [uid for uid in given if uid in on_node]
        if mine and set(mine) <= set(lower):
            block = self._frees(topology, base, request, [lower[u] for u in mine])
            if block is not None:
                best = (self._key(mine, lower), tuple(mine), block)
        kept = best
        for blockers in self._block_victims(topology, request, staying, priority, base):
            chosen = self._with_unknown(topology, base, request, blockers, lower)
            if chosen is None:
                continue
            victims, block = chosen
            key = self._key(victims, lower)
            if best is None or key < best[0]:
                best = (key, victims, block)
        if best is None:
            return None
        _, victims, block = best
        ordered = self._ordered(list(victims), lower)
        return Plan(ordered + others, self._violations(ordered, lower), block, kept=best is kept)

    def _state_without(self, node: str, topology: Topology, pod: Pod, gone: set[str]) -> NodeState:
        """The node's state as the preemptor would find it: terminating pods gone, its own held
        block (if nominated here) and the blocks held for lower-priority pods not counted
        (kube-scheduler clears those nominations on the node it picks)."""
        state = self.ledger.state_for(Claimant.of(pod), node)
        used, unknown = state.used_cores, state.unattributed_cores
        for uid, holding in self.ledger.pods_holding(node).items():
            if uid in gone:
                if holding.ours:
                    used &= ~holding.cores
                else:
                    unknown -= holding.unknown_count * self._size(topology, holding)
        return NodeState(used, max(unknown, 0))

    @staticmethod
    def _size(topology: Topology, holding: Holding) -> int:
        return topology.cores_per_device if holding.unknown_unit is Unit.DEVICE else 1

    def _frees(
        self,
        topology: Topology,
        base: NodeState,
        request: NeuronRequest,
        victims: list[Holding],
    ) -> Placement | None:
        used, unknown = base.used_cores, base.unattributed_cores
        for holding in victims:
            if holding.ours:
                used &= ~holding.cores
            else:
                unknown -= holding.unknown_count * self._size(topology, holding)
        decision = allocate(topology, NodeState(used, max(unknown, 0)), request, self.policy)
        return decision if isinstance(decision, Placement) else None

    def _block_victims(
        self,
        topology: Topology,
        request: NeuronRequest,
        staying: dict[str, Holding],
        priority: int,
        base: NodeState,
    ) -> list[frozenset[str]]:
        """For each allowed block, the pods holding any of its cores; blocks held by a pod of
        equal or higher priority (or by a nominated pod's hold) are skipped."""
        owner: dict[int, str] = {}
        for uid, holding in staying.items():
            if holding.ours:
                for core in mask_ids(holding.cores):
                    owner[core] = uid
        known = 0
        for uid in owner.values():
            known |= staying[uid].cores
        foreign = base.used_cores & ~known  # reservations and held blocks: not evictable
        blocks = list(allowed_blocks(topology, request.unit, request.count))
        if not blocks and topology.kind is TopologyKind.SWITCH:
            blocks = self._switch_blocks(topology, request, owner, staying)
        sets: set[frozenset[str]] = set()
        for block in blocks:
            if block & foreign:
                continue
            blockers = frozenset(owner[c] for c in mask_ids(block) if c in owner)
            if all(staying[uid].priority < priority for uid in blockers):
                sets.add(blockers)
        return sorted(sets, key=lambda s: (len(s), sorted(s)))

    def _switch_blocks(
        self,
        topology: Topology,
        request: NeuronRequest,
        owner: dict[int, str],
        staying: dict[str, Holding],
    ) -> list[int]:
        """Any devices connect on a switch: blocks of the cheapest devices, a bounded number."""
        per_device = topology.cores_per_device
        size = request.count if request.unit is Unit.DEVICE else -(-request.count // per_device)

        def cost(device: int) -> tuple[int, int]:
            cores = range(device * per_device, (device + 1) * per_device)
            holders = {owner[c] for c in cores if c in owner}
            return (max((staying[u].priority for u in holders), default=-(2**31)), len(holders))

        devices = sorted(range(topology.devices), key=cost)
        blocks = []
        for chosen in combinations(devices[: min(len(devices), size + 4)], size):
            blocks.append(topology.core_mask_of_devices(sum(1 << d for d in chosen)))
            if len(blocks) >= MAX_SWITCH_COMBINATIONS:
                break
        return blocks

    def _with_unknown(
        self,
        topology: Topology,
        base: NodeState,
        request: NeuronRequest,
        blockers: frozenset[str],
        lower: dict[str, Holding],
    ) -> tuple[tuple[str, ...], Placement] | None:
        """The block's pods, plus lower-priority pods of unknown ids (by count: the cheapest
        first) when the block alone leaves too few cores beside them."""
        victims = list(blockers)
        block = self._frees(topology, base, request, [lower[u] for u in victims])
        if block is not None:
            return tuple(victims), block
        unknown = [uid for uid, h in lower.items() if not h.ours and uid not in blockers]
        unknown.sort(key=lambda uid: self._key((uid,), lower))
        for uid in unknown:
            victims.append(uid)
            block = self._frees(topology, base, request, [lower[u] for u in victims])
            if block is not None:
                return tuple(victims), block
        return None

    def _key(self, victims: tuple[str, ...] | list[str], lower: dict[str, Holding]) -> Key:
        holdings = [lower[uid] for uid in victims]
        return (
            max((h.priority for h in holdings), default=-(2**31)),
            self._violations(victims, lower),
            len(holdings),
            _work_lost(holdings),
        )

    def _violations(self, victims: tuple[str, ...] | list[str], lower: dict[str, Holding]) -> int:
        return self.budgets.violations(
            [(self.ledger.pod_key(uid).partition("/")[0], lower[uid].labels) for uid in victims]
        )

    @staticmethod
    def _ordered(victims: list[str], lower: dict[str, Holding]) -> tuple[str, ...]:
        """Highest priority first, then the longest running: kube-scheduler's own order."""
        return tuple(sorted(victims, key=lambda uid: (-lower[uid].priority, lower[uid].started)))


def _work_lost(holdings: list[Holding]) -> float:
    """How long the victims have run, summed (older pods lose more); timestamps are RFC 3339
    and sort as time, so the sum of their negated order stands in for ages."""
    return -sum(_epoch(h.started) for h in holdings)


def _epoch(timestamp: str) -> float:
    if not timestamp:
        return 0.0
    try:
        return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0
