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

Training jobs (issue 40): a job's member is never a victim of a node's answer (kube-scheduler
evicts on one node only, and a job goes whole or not at all), so such nodes are dropped. For a
preemptor that is itself a member of a training job, its whole job is the preemptor
(jobs/preemption.py): the verb only records that kube-scheduler asked, and the
reservation loop works out whether evicting whole jobs of lower priority gives it units for all
its members and carries that out (its claim first, then the evictions, all done by the
extender, on every node at once); kube-scheduler is answered no Neuron node, so it evicts
nothing there itself. When nothing would, nobody is evicted. (Without the claim CRD nothing can
carry that out: members go pod by pod on nodes without UltraServer labels, and are answered
there as any pod is.) The ask is recorded only for a
pending member the watch knows, as the watch shows it (the request's body is only what the
caller says), and never for one whose `preemptionPolicy` is `Never`: what the extender then
deletes is decided from the cluster's own objects.

Under Kueue (issue 48, docs/kueue.md) one priority story holds: Kueue's preemption acts for its
workloads (whole workloads, by WorkloadPriorityClass and quota), so for a pod of a workload Kueue
manages (kube.kueue.kueue_managed) no node is answered and nothing is asked for its job: the
extender never preempts for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
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
from neuron_scheduler.jobs.members import Member, MembershipError, member_of
from neuron_scheduler.jobs.placement import Occupancy, job_text
from neuron_scheduler.jobs.units import NodeConfigError, pod_node_config
from neuron_scheduler.kube.kueue import kueue_managed
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import neuron_request

log = logging.getLogger("neuron_scheduler.extender")
INVALID = (Member(("", ""), "invalid", None), 0)  # a member whose size or node config is bad
MAX_SAID = 10_000
NEVER = "Never"  # preemptionPolicy


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
        occupancy: Occupancy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`planned(uid)`: the pod has a consolidation plan in flight, which frees its block:
        no node is answered for it, so kube-scheduler evicts nothing more for it. `occupancy`:
        the UltraServer units, training jobs' members and claims (preemption asks the
        reservation loop through it, by `clock`)."""
        self.ledger = ledger
        self.budgets = budgets
        self.metrics = metrics
        self.policy = policy
        self.planned = planned
        self.occupancy = occupancy if occupancy is not None else Occupancy()
        self.clock = clock
        # Why a pod's ask is not recorded, as last logged (kube-scheduler asks again and again).
        self._said: dict[str, str] = {}

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
        if request is not None and kueue_managed(pod):
            # Under Kueue, Kueue's preemption acts (whole workloads, by its priorities and
            # quotas): kube-scheduler evicts nothing for a pod of a workload it admitted, on any
            # node (docs/kueue.md).
            self._say(pod, "it is a pod of a Kueue workload: Kueue's preemption acts for it", False)
            self.metrics.preempt_nodes.labels("dropped").inc(len(candidates))
            return ExtenderPreemptionResult({})
        if self.planned(pod.metadata.uid):
            log.info(
                "preemption for %s: a consolidation plan frees its block; no node evicted for",
                loggable(pod.key),
            )
            self.metrics.preempt_nodes.labels("dropped").inc(len(candidates))
            return ExtenderPreemptionResult({})
        member = self._member(pod) if request is not None else None  # (members ask devices)
        ruled = self.occupancy.rules
        if member is not None and any(ruled(node) for node in candidates):
            self._for_job(pod)
        answer: dict[str, MetaVictims] = {}
        for node, (given, violations) in candidates.items():
            if member is not None and ruled(node):
                self.metrics.preempt_nodes.labels("dropped").inc()
                continue  # its whole job preempts (`_for_job`), never a node at a time
            if request is None:  # not ours to judge: kube-scheduler's choice stands
                victims: MetaVictims | None = MetaVictims([MetaPod(u) for u in given], violations)
            else:
                victims = self._answer(pod, request, node, given, violations)
            if victims is not None and not self._spares_jobs(pod, node, victims, request):
                self.metrics.preempt_nodes.labels("dropped").inc()
                victims = None
            if victims is not None:
                answer[node] = victims
            # A node takes milliseconds and kube-scheduler may send hundreds: filter and bind
            # are answered in between.
            await asyncio.sleep(0)
        return ExtenderPreemptionResult(answer)

    def _member(self, pod: Pod) -> tuple[Member, int] | None:
        """The pod's job membership and node config, when it is a member (one that gives a bad
        size or config is refused every Neuron node by filter: treated as a member, so no
        node of them is answered)."""
        try:
            member = member_of(pod)
            return (member, pod_node_config(pod)) if member is not None else None
        except (MembershipError, NodeConfigError):
            return INVALID

    def _for_job(self, asked: Pod) -> None:
        """Preemption for the member's whole job: records that kube-scheduler asked, for the
        reservation loop, which works out in its next step whether whole jobs of lower priority
        give it units for all its members, and carries it out. Only for a pending member the
        watch knows, read as the watch shows it; never for one that must not preempt."""
        meta = asked.metadata
        waiting = self.occupancy.pending.get(meta.uid)
        if waiting is None or (waiting.pod.metadata.namespace, waiting.pod.metadata.name) != (
            meta.namespace,
            meta.name,
        ):
            self._say(asked, "not a pending member of a training job the extender's watch knows")
            return
        pod, job = waiting.pod, waiting.member.job
        if pod.spec.preemptionPolicy == NEVER:
            self._say(asked, "its preemptionPolicy is Never")
            return
        member = self._member(pod)
        if member is None or not member[1] or self.occupancy.complete(job):
            return  # a bad size or config; or it holds its units: it waits for them to free
        self._said.pop(meta.uid, None)
        first = job not in self.occupancy.preemption_asks
        self.occupancy.preemption_asks[job] = self.clock()
        self.metrics.job_preemptions.labels("asked").inc()
        if first:
            log.info(
                "preemption for %s: asked for its job %s, whole (the extender works it out and "
                "carries it out; kube-scheduler evicts nothing for it)",
                loggable(pod.key),
                loggable(job_text(job)),
            )
        if self.occupancy.on_change is not None:
            self.occupancy.on_change()  # the reservation loop steps now

    def _say(self, pod: Pod, why: str, job: bool = True) -> None:
        """Logs why no preemption is asked for the pod (for its job), once per reason."""
        uid = pod.metadata.uid
        if self._said.get(uid) == why:
            return
        if len(self._said) >= MAX_SAID:
            del self._said[next(iter(self._said))]
        self._said[uid] = why
        what = "not asked for its job" if job else "no node evicted for"
        log.info("preemption for %s: %s: %s", loggable(pod.key), what, why)

    def _spares_jobs(
        self, pod: Pod, node: str, victims: MetaVictims, request: NeuronRequest | None
    ) -> bool:
        """Whether the answer on a node evicts no member of a training job (kube-scheduler
        evicts on this node only: a job would lose some members, not go whole) and, for a pod
        asking for devices, does not send it to a node claimed for a job (filter refuses it
        there)."""
        workers = self.occupancy.workers
        caught = [v.UID for v in victims.Pods if v.UID in workers]
        if caught:
            log.info(
                "preemption for %s on %s: it would evict %s, a member of job %s, alone (a "
                "job is evicted whole or not at all); node dropped",
                loggable(pod.key),
                loggable(node),
                loggable(self.ledger.pod_key(caught[0])),
                loggable(job_text(workers[caught[0]].job)),
            )
            return False
        if request is None:
            return True
        return node not in self.occupancy.claims and node not in self.occupancy.rejected

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
