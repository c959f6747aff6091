"""preempt: which lower-priority pods to evict on a node so the preemptor gets an allowed block.
No I/O.

kube-scheduler's own dry run picks victims by counting resources, so on a torus it may evict four
1-device pods from four different rows for a 4-device pod that needs one whole row, and still not
fit. For each candidate node it sends, this answers core/eviction's choice: the pods of one
allowed block, lower priority only, best by highest victim priority, disruption-budget
violations, count and work lost; kube-scheduler's victims stand when they free a block and no set
is better. A node where no set of lower-priority pods helps is dropped from the answer.

Only devices are weighed here. kube-scheduler's victims that hold no Neuron device were chosen for
its other resources (CPU, memory, ports) and stay in the answer; where the preemptor's devices
already fit, devices are not what is short and kube-scheduler's answer stands unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from neuron_scheduler.core.allocation import Placement, Policy, allocate, check_request
from neuron_scheduler.core.eviction import plan_eviction
from neuron_scheduler.core.ids import format_ids
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.quantity import QuantityError
from neuron_scheduler.core.resources import NeuronRequest, RequestError
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.budgets import DisruptionBudgets
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.extender.verbs.wire import (
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
        planned: Callable[[str], bool] = lambda uid: False,
    ) -> None:
        """`planned(uid)`: the pod has a consolidation plan in flight, which frees its block:
        no node is answered for it, so kube-scheduler evicts nothing more for it."""
        self.ledger = ledger
        self.budgets = budgets
        self.metrics = metrics
        self.policy = policy
        self.planned = planned

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
            log.info("preemption for %s: %s; no node helps", loggable(pod.key), loggable(error))
            self.metrics.preempt_nodes.labels("dropped").inc(len(candidates))
            return ExtenderPreemptionResult({})
        if self.planned(pod.metadata.uid):
            log.info(
                "preemption for %s: a consolidation plan frees its block; no node evicted for",
                loggable(pod.key),
            )
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
            loggable(pod.key),
            loggable(node),
            ", ".join(loggable(self.ledger.pod_key(uid)) for uid in plan.victims),
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
        on_node = self.ledger.pods_holding(node)
        base, occupants = self.ledger.eviction_view(Claimant.of(pod, request), node)
        # kube-scheduler's victims that hold no Neuron device are there for its other resources
        # (CPU, memory, ports): they stay in every answer, after ours.
        others = tuple(uid for uid in given if uid not in on_node)
        fits = allocate(topology, base, request, self.policy)
        if isinstance(fits, Placement):
            # Devices are not what is short here: kube-scheduler's choice stands as it is.
            return Plan(tuple(given), None, fits, kept=True) if given else None

        def violations(victims: Sequence[str]) -> int:
            return self.budgets.violations(
                [
                    (self.ledger.pod_key(uid).partition("/")[0], on_node[uid].labels)
                    for uid in victims
                ]
            )

        eviction = plan_eviction(
            topology,
            base,
            request,
            pod.spec.priority or 0,
            occupants,
            [uid for uid in given if uid in on_node],
            violations,
            self.policy,
        )
        if eviction is None:
            return None
        return Plan(eviction.victims + others, eviction.key[1], eviction.block, kept=eviction.kept)
