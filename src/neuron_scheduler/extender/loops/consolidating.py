"""Consolidation: pods that fit by count but find no free block get one, by moving pods that can
go elsewhere (docs/consolidation.md).

When it acts: a pending pod of a scheduler we serve that kube-scheduler found unschedulable, for
longer than `pending_seconds`, only because of fragmentation (extender/loops/movers.stranded),
not nominated by kube-scheduler's own preemption, and with no node asked of the autoscaler for it
(extender/loops/requesting: that node comes anyway). Pods of gang jobs are left to their job.

What it moves, and where: extender/loops/movers.plan_for (core/consolidation's rules).

How, in this order, so that a crash at any point leaves nothing held for ever and nothing
evicted twice:
1. the eviction budget is spent on its Lease (extender/loops/evictionbudget);
2. the plan is written on the pending pod (`PLAN_ANNOTATION`, core/planrecord): the node, the
   block freed for it, the moved pods and the place held for each one's replacement, until when.
   From here the ledger holds them (`Ledger.hold`): the block as a nominated pod's block (and
   its NeuronBlockHeld event), each place for the pods of the moved pod's controller with the
   same request. Every replica, and a restarted one, rebuilds them from the pod watch;
3. the pod's status.nominatedNodeName is set to the node, so kube-scheduler tries it first and
   holds the pod's resources there by count. kube-scheduler v1.36 clears a nomination it did not
   make after any failed attempt whose preemption finds no victims (the plan's hold stands);
4. the pods are evicted one by one through the Eviction API, so disruption budgets are honoured.
   A refusal (429) cancels the plan: its holds go and the waiting pods are woken.

A plan ends when its pod is bound and each moved pod's replacement is (`done`), when its time
is up (`expired`), when it is cancelled, or when its pod goes. Its holds go at once on every
replica; the leader then removes the annotation (and a nomination it set). A restarted leader
evicts what a plan had not evicted yet (pods already evicted are gone or terminating, so none is
evicted twice), within the plan's time.

Bounded: at most `max_plans` in flight, one per node, a node waits `node_cooldown` between plans,
at most `evictions_per_hour` evictions; only the leader writes. `mode`: off (nothing), dry-run (an
event on the pending pod, "would evict a/b, c/d from node X to free devices 4-7", and a log line;
nothing written or held), on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.consolidation import DEFAULT_MAX_VICTIMS, Move
from neuron_scheduler.core.ids import format_ids
from neuron_scheduler.core.logtext import NAME_LIMIT, loggable
from neuron_scheduler.core.planrecord import (
    PLAN_ANNOTATION,
    PlanKind,
    PlanRecord,
    Replacement,
    encode,
)
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.extender.loops.evictionbudget import BudgetUnavailable, EvictionBudget
from neuron_scheduler.extender.loops.movers import plan_for, stranded
from neuron_scheduler.extender.loops.stepping import run_steps
from neuron_scheduler.extender.loops.waking import AnnotationWriter
from neuron_scheduler.extender.state.budgets import DisruptionBudgets
from neuron_scheduler.extender.state.ledger import (
    Ledger,
)
from neuron_scheduler.extender.state.movability import Facts, Movability, gang_of
from neuron_scheduler.extender.state.pending import PendingPods
from neuron_scheduler.extender.state.plans import Active, Plans
from neuron_scheduler.extender.state.plugins import NodeFilter, PodsOnly
from neuron_scheduler.kube.errors import (
    READ_ERRORS,
    Conflict,
    Forbidden,
    NotFound,
    TooManyRequests,
    error_text,
)
from neuron_scheduler.kube.events import Report
from neuron_scheduler.kube.objects import ObjectRef, Pod
from neuron_scheduler.kube.reading import epoch, servable_request, unschedulable

log = logging.getLogger("neuron_scheduler.extender.consolidating")

STEP_SECONDS = 5.0  # between looks for stranded pods (sooner when a plan changes)
CANDIDATES_PER_STEP = 8  # pending pods planned for per step, highest priority and oldest first
# A pod planned for without a plan started (none found, dry-run, no budget) is planned for again
# after this long: what it waits for changes with pods coming and going, not every step.
RETRY_SECONDS = 30.0


class Mode(StrEnum):
    OFF = "off"
    DRY_RUN = "dry-run"
    ON = "on"


class Concluded(StrEnum):
    """Why consolidation started no plan for a stranded pod (capacity requests read it)."""

    NO_MOVE = "no_move"  # no set of pods may move, on any node it may go to
    NO_NODE = "no_node"  # every node it may go to has a plan in flight, or cools down
    DRY_RUN = "dry_run"  # a plan exists, but the mode only says what it would do
    PLANS_IN_FLIGHT = "plans_in_flight"
    EVICTIONS_PER_HOUR = "evictions_per_hour"


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds (chart: scheduler.consolidation; values.yaml says why these defaults)."""

    mode: Mode = Mode.DRY_RUN
    pending_seconds: float = 30.0
    max_plans: int = 2
    node_cooldown: float = 120.0
    evictions_per_hour: int = 30
    plan_seconds: float = 300.0
    max_victims: int = DEFAULT_MAX_VICTIMS


DEFAULT_LIMITS = Limits()


class ConsolidationAPI(AnnotationWriter, Protocol):
    """What consolidation needs of KubeAPI beyond the waker's annotation patch."""

    async def patch_nominated_node(
        self, namespace: str, name: str, uid: str, node: str
    ) -> None: ...

    async def evict(self, namespace: str, name: str, uid: str) -> None: ...


class ConsolidationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.plans = Counter(
            "neuron_scheduler_consolidation_plans",
            "Consolidation plans by outcome: started, would (dry-run), done (the pod bound on "
            "the freed block, replacements bound), bound_elsewhere, expired, cancelled (an "
            "eviction refused), gone (the pod deleted)",
            ["outcome"],
            registry=registry,
        )
        self.evictions = Counter(
            "neuron_scheduler_consolidation_evictions",
            "Evictions by result: evicted, refused (429: a disruption budget), gone, failed",
            ["result"],
            registry=registry,
        )
        self.in_vain = Counter(
            "neuron_scheduler_consolidation_evicted_in_vain",
            "Pods evicted for plans that ended without their pod bound on the freed block",
            registry=registry,
        )
        self.blocked = Counter(
            "neuron_scheduler_consolidation_blocked",
            "Stranded pods consolidation did not act for, by why: no_move (no set of pods may "
            "move), plans_in_flight, evictions_per_hour, budget_unavailable",
            ["reason"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "neuron_scheduler_consolidation_plans_in_flight",
            "Consolidation plans whose holds stand",
            registry=registry,
        )
        self.left = Gauge(
            "neuron_scheduler_consolidation_evictions_left",
            "Evictions consolidation may still make in the current hour",
            registry=registry,
        )


class Consolidator(PodsOnly):
    def __init__(
        self,
        ledger: Ledger,
        movability: Movability,
        plans: Plans,
        budgets: DisruptionBudgets,
        api: ConsolidationAPI,
        budget: EvictionBudget,
        pending: PendingPods,
        registry: CollectorRegistry,
        *,
        limits: Limits = DEFAULT_LIMITS,
        report: Report | None = None,
        policy: Policy = Policy.BEST_FIT,
        is_leader: Callable[[], bool] = lambda: True,
        wall_clock: Callable[[], float] = time.time,
        filters: Sequence[NodeFilter] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`filters`: the node filters filter runs after the device check (the UltraServer
        rule): a plan neither frees a block where its pod would be refused nor places a
        replacement there."""
        self.ledger = ledger
        self.movability = movability
        self.plans = plans
        plans.on_end = self._ended
        self.budgets = budgets
        self.api = api
        self.budget = budget
        self.pending = pending  # pending pods of our schedulers (the view bind reads too)
        self.limits = limits
        self.report = report
        self.policy = policy
        self.is_leader = is_leader
        self.wall_clock = wall_clock
        self.filters = tuple(filters)
        self.clock = clock
        self.metrics = ConsolidationMetrics(registry)
        self.metrics.in_flight.set_function(lambda: len(self.in_flight()))
        self.metrics.left.set_function(lambda: self.budget.left())
        self._said: dict[str, str] = {}  # pod uid -> the last dry-run or refusal logged
        self._next_look: dict[str, float] = {}  # pod uid -> when to plan for it again
        self._concluded: dict[str, Concluded] = {}  # pod uid -> why it got no plan, last look
        # Told when a capacity request's hold ends (extender/loops/requesting): such holds are
        # plans of kind CAPACITY that move nothing.
        self.on_capacity_end: Callable[[Active, str], None] | None = None
        # Whether a node is asked of the autoscaler for this pod (extender/loops/requesting): it
        # is coming whatever happens here, so nothing is evicted for that pod meanwhile.
        self.node_asked: Callable[[str], bool] = lambda uid: False
        self._signal = asyncio.Event()

    # --- the pod watch: what it remembers of a pending pod goes with it (fed after `pending`) --

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        known = {pod.metadata.uid for pod in pods}
        for uid in [*self._said, *self._next_look, *self._concluded]:
            if uid not in known:
                self.remove_pod(uid)

    def apply_pod(self, pod: Pod) -> None:
        if self.pending.get(pod.metadata.uid) is None:  # bound, finished or deleted
            self.remove_pod(pod.metadata.uid)

    def remove_pod(self, uid: str) -> None:
        self._said.pop(uid, None)
        self._next_look.pop(uid, None)
        self._concluded.pop(uid, None)

    def _ended(self, active: Active, outcome: str) -> None:
        if active.record.kind is PlanKind.CAPACITY:
            if self.on_capacity_end is not None:
                self.on_capacity_end(active, outcome)
            self._signal.set()  # the leader tidies up
            return
        self.metrics.plans.labels(outcome).inc()
        if active.evicted and active.bound != active.record.node:
            self.metrics.in_vain.inc(active.evicted)
        log.info(
            "consolidation plan for %s on %s ended: %s",
            loggable(active.key, NAME_LIMIT),
            loggable(active.record.node, NAME_LIMIT),
            outcome.replace("_", " "),
        )
        self._signal.set()  # the leader tidies up

    def in_flight(self) -> list[Active]:
        """Every plan whose holds stand: consolidation's and capacity requests' (one a node)."""
        return self.plans.in_flight()

    def moving(self) -> list[Active]:
        """Consolidation's own plans in flight (`max_plans` counts these)."""
        return [a for a in self.plans.in_flight() if a.record.kind is PlanKind.CONSOLIDATION]

    # --- the loop (leader only) ----------------------------------------------------------------

    async def run(self) -> None:
        await run_steps(self.step, self._signal, STEP_SECONDS, "consolidation", log)

    async def step(self) -> None:
        self.plans.expire()
        if not self.is_leader():
            self.budget.loaded = False  # read afresh on becoming leader
            return
        await self._tidy()
        for active in self.in_flight():
            if not active.nominated:  # a plan read back after a restart, or a capacity hold
                if self._any_evicted(active):
                    active.nominated = True  # done before its evictions: not again (below)
                else:
                    await self._nominate(active)
        if self.limits.mode is Mode.OFF:
            return
        if self.limits.mode is Mode.ON:
            for active in self.moving():
                if not active.reported:  # read back after a restart
                    self._report_evicted(active)
            if not self.budget.loaded:
                try:
                    await self.budget.load()
                except BudgetUnavailable:
                    return
            for active in self.moving():
                if not active.busy and self._to_evict(active):
                    await self._evict(active)
        await self._find()

    async def _nominate(self, active: Active) -> None:
        """Sets the pod's status.nominatedNodeName to the plan's node, once per plan in this
        process: after a restart between the plan's annotation and its nomination, the next
        leader does it. (kube-scheduler clears a nomination it did not make after a failed try:
        the plan's hold stands regardless, so it is not set again and again.)"""
        active.nominated = True
        pending = self.pending.get(active.uid)
        if pending is None or pending.status.nominatedNodeName == active.record.node:
            return
        with contextlib.suppress(*READ_ERRORS):
            await self.api.patch_nominated_node(
                active.namespace, active.name, active.uid, active.record.node
            )

    def _any_evicted(self, active: Active) -> bool:
        """Whether one of the plan's moved pods is leaving or gone: its leader nominated the pod
        before evicting, so a plan read back this late is not nominated again. kube-scheduler
        counts a nominated pod's request on the node for pods of equal or lower priority, and
        clears a nomination only after a failed try of the pod that an update of it requeues
        (one our filter refused); once the moved pods' replacements hold their places the pod
        fails by count, so a nomination set now would stand until the moved pods were gone and,
        meanwhile, refuse by count the replacements still pending (a restart while they were in
        flight left one pending for as long as its moved pod terminated)."""
        return len(self._to_evict(active)) < len(active.record.victims)

    def _report_evicted(self, active: Active) -> None:
        """The NeuronConsolidationEvicted event of every moved pod already leaving, for a plan
        read back after a restart: the leader before may have been killed between an eviction
        and its event. Each event has a name fixed by the moved pod's uid, so one the earlier
        leader did send is not sent twice (the API server refuses the second)."""
        active.reported = True
        for victim in active.record.victims:
            facts = self.movability.pods.get(victim.uid)
            holding = self.ledger.holding(victim.uid)
            there = facts is not None and facts.bound == active.record.node
            if there and (holding is None or not holding.terminating):
                continue  # still there: evicted from here on, with its event
            self._evicted_event(active, victim)

    async def _tidy(self) -> None:
        """Removes the annotation of each plan that ended (and the nomination it set)."""
        for active in [a for a in self.plans.plans.values() if a.ended]:
            pending = self.pending.get(active.uid)
            try:
                await self.api.patch_annotations(
                    active.namespace, active.name, active.uid, {PLAN_ANNOTATION: None}
                )
                if pending is not None and pending.status.nominatedNodeName == active.record.node:
                    await self.api.patch_nominated_node(
                        active.namespace, active.name, active.uid, ""
                    )
            except (NotFound, Conflict):
                self.plans.plans.pop(active.uid, None)  # gone, or another pod now
            except READ_ERRORS as error:
                log.warning(
                    "cannot remove the ended consolidation plan from pod %s: %s; it holds "
                    "nothing, and is removed on the next try",
                    loggable(active.key, NAME_LIMIT),
                    loggable(error_text(error)),
                )
                return

    # --- finding stranded pods -----------------------------------------------------------------

    def _candidates(self) -> list[tuple[Pod, NeuronRequest]]:
        now = self.wall_clock()
        found = []
        for uid, pod in self.pending.items():
            if uid in self.plans.plans or uid in self.plans.unreadable:
                continue
            if self._next_look.get(uid, 0.0) > now:
                continue
            if pod.status.nominatedNodeName:  # kube-scheduler's own preemption is under way
                continue
            if self.node_asked(uid):
                continue
            if gang_of(pod):
                continue  # a gang's worker: the job moves whole or not at all
            if not unschedulable(pod):
                continue
            if now - epoch(pod.metadata.creationTimestamp or "") < self.limits.pending_seconds:
                continue
            request = servable_request(pod)
            if request is not None:
                found.append((pod, request))
        found.sort(key=lambda p: (-(p[0].spec.priority or 0), p[0].metadata.creationTimestamp))
        return found[:CANDIDATES_PER_STEP]

    def _admits(self, pod: Pod, node: str) -> bool:
        now = self.clock()
        return all(f.admits(pod, node, now) for f in self.filters)

    async def _find(self) -> None:
        mode = self.limits.mode
        for pod, request in self._candidates():
            # Stranded first: a pod short of devices is no business of consolidation's, and is
            # not counted as blocked by anything here.
            where = stranded(self.ledger, pod, request, self.policy, self._admits)
            if where is None:
                continue
            in_flight = self.in_flight()
            if mode is Mode.ON and len(self.moving()) >= self.limits.max_plans:
                self.metrics.blocked.labels("plans_in_flight").inc()
                self._conclude(pod, Concluded.PLANS_IN_FLIGHT)
                return
            taken = {a.record.node for a in in_flight}
            nodes = [
                n
                for n in where.nodes
                if n not in taken and (mode is not Mode.ON or not self.budget.cooling(n))
            ]
            if not nodes:
                self._conclude(pod, Concluded.NO_NODE)
                continue
            busy = {v.uid for a in in_flight for v in a.record.victims}
            self._next_look[pod.metadata.uid] = self.wall_clock() + RETRY_SECONDS
            planned = plan_for(
                self.ledger,
                self.movability,
                self.budgets,
                pod,
                request,
                nodes,
                self.policy,
                self.limits.max_victims,
                busy,
                self._admits,
            )
            if planned.move is None:
                self.metrics.blocked.labels("no_move").inc()
                self._conclude(pod, Concluded.NO_MOVE)
                reasons = "; ".join(f"{r.node}: {r.reason}" for r in planned.refusals[:3])
                self._say(
                    pod,
                    "NeuronConsolidationBlocked",
                    f"no pods may be moved to free a block for it: {reasons}",
                )
                continue
            record = self._record(pod, planned.move)
            if mode is Mode.DRY_RUN:
                self._conclude(pod, Concluded.DRY_RUN)
                if self._say(pod, "NeuronConsolidation", f"would evict {record.summary}"):
                    self.metrics.plans.labels("would").inc()
                continue
            if len(record.victims) > self.budget.left():
                self.metrics.blocked.labels("evictions_per_hour").inc()
                self._conclude(pod, Concluded.EVICTIONS_PER_HOUR)
                self._say(
                    pod,
                    "NeuronConsolidationBlocked",
                    f"would evict {record.summary}, but only {self.budget.left()} evictions are "
                    "left this hour",
                )
                continue
            self._next_look.pop(pod.metadata.uid, None)
            await self._start(pod, record)

    def _conclude(self, pod: Pod, concluded: Concluded) -> None:
        self._concluded[pod.metadata.uid] = concluded

    def concluded(self, uid: str) -> Concluded | None:
        """What consolidation last concluded for a stranded pod it did not start a plan for
        (None: it has not looked at it yet, or it started one). Capacity requests ask a node
        only for pods it cannot help (extender/loops/requesting)."""
        return self._concluded.get(uid)

    def _record(self, pod: Pod, move: Move) -> PlanRecord:
        now = self.wall_clock()
        destinations = {d.pod: d for d in move.destinations}
        victims = []
        for uid in move.victims:
            facts = self.movability.pods[uid]
            place = destinations.get(uid)
            victims.append(
                Replacement(
                    uid,
                    facts.key,
                    facts.owner,
                    facts.request,
                    place.node if place else "",
                    tuple(place.placement.cores) if place else (),
                    facts.priority,
                )
            )
        return PlanRecord(
            move.node,
            tuple(move.block.devices),
            tuple(move.block.cores),
            now,
            now + self.limits.plan_seconds,
            tuple(victims),
        )

    def _say(self, pod: Pod, reason: str, message: str) -> bool:
        """An event on the pending pod and a log line, once per message (the recorder thins
        repeats too)."""
        uid = pod.metadata.uid
        if self._said.get(uid) == message:
            return False
        self._said[uid] = message
        log.info("consolidation for %s: %s", loggable(pod.key, NAME_LIMIT), loggable(message))
        if self.report is not None:
            self.report(ObjectRef.of_pod(pod), reason, message, False)
        return True

    # --- acting --------------------------------------------------------------------------------

    async def _start(self, pod: Pod, record: PlanRecord) -> None:
        meta = pod.metadata
        try:
            await self.budget.spend(record.node, len(record.victims))
        except BudgetUnavailable as error:
            self.metrics.blocked.labels("budget_unavailable").inc()
            log.info(
                "consolidation for %s waits: the eviction budget is unavailable (%s)",
                loggable(pod.key, NAME_LIMIT),
                loggable(str(error)),
            )
            return
        try:
            await self.api.patch_annotations(
                meta.namespace, meta.name, meta.uid, {PLAN_ANNOTATION: encode(record)}
            )
        except READ_ERRORS as error:
            log.warning(
                "cannot write the consolidation plan on pod %s: %s; nothing evicted",
                loggable(pod.key, NAME_LIMIT),
                loggable(error_text(error)),
            )
            return
        # Held from here on, before the watch shows the annotation.
        active = self.plans.adopt(pod, encode(record))
        if active is None:
            return
        self.metrics.plans.labels("started").inc()
        log.info(
            "consolidation for %s: evicting %s (plan until %s)",
            loggable(pod.key, NAME_LIMIT),
            loggable(record.summary),
            datetime.fromtimestamp(record.until).isoformat(timespec="seconds"),
        )
        if self.report is not None:
            self.report(
                ObjectRef.of_pod(pod),
                "NeuronConsolidation",
                f"evicting {record.summary} for this pod; the block is held for it until it is "
                "bound",
                False,
            )
        active.reported = True  # its evictions are reported as they are made
        await self._nominate(active)
        await self._evict(active)

    def _to_evict(self, active: Active) -> list[Replacement]:
        """The plan's pods that are still on its node and not leaving."""
        left = []
        for victim in active.record.victims:
            if victim.uid in active.asked:  # the watch may not show it leaving yet
                continue
            facts = self.movability.pods.get(victim.uid)
            holding = self.ledger.holding(victim.uid)
            if facts is None or facts.bound != active.record.node:
                continue
            if holding is not None and holding.terminating:
                continue
            left.append(victim)
        return left

    async def _evict(self, active: Active) -> None:
        active.busy = True
        try:
            for victim in self._to_evict(active):
                if active.ended:
                    return
                facts = self.movability.pods.get(victim.uid)
                if facts is None:
                    continue  # gone while an earlier eviction was awaited
                why = self._may_not_move(active, victim, facts)
                if why:
                    self._cancel(active, f"{victim.pod} may not be moved: {why}")
                    return
                if not await self._evict_one(active, victim):
                    return
        finally:
            active.busy = False

    def _may_not_move(self, active: Active, victim: Replacement, facts: Facts) -> str:
        """Why the plan may no longer evict this pod of its node, or "". Asked again at each
        eviction: a pod may have opted out since the plan was written, and a plan read back from
        a pod's annotation is only as trustworthy as whoever could write it (the chart's
        admission policy lets only the extender; docs/security.md): it evicts only what a plan
        of the extender's own could."""
        if facts.never:
            return facts.never
        if facts.priority > active.priority:
            return f"its priority {facts.priority} is above {active.key}'s {active.priority}"
        if facts.owner != victim.owner:
            return "its controller is not the one the plan names"
        return ""

    def _cancel(self, active: Active, message: str) -> None:
        message = f"{message}; the plan is cancelled and its holds let go"
        log.info("consolidation for %s: %s", loggable(active.key), loggable(message))
        if self.report is not None:
            ref = ObjectRef("Pod", active.namespace, active.name, active.uid)
            self.report(ref, "NeuronConsolidationCancelled", message, True)
        self.plans.end(active, "cancelled")

    async def _evict_one(self, active: Active, victim: Replacement) -> bool:
        """False when the plan stops here (cancelled, or an error to retry on the next step)."""
        namespace, _, name = victim.pod.partition("/")
        try:
            await self.api.evict(namespace, name, victim.uid)
            active.asked.add(victim.uid)
        except (NotFound, Conflict):
            self.metrics.evictions.labels("gone").inc()
            return True
        except TooManyRequests as error:
            self.metrics.evictions.labels("refused").inc()
            self._cancel(active, f"the eviction of {victim.pod} was refused ({error_text(error)})")
            return False
        except READ_ERRORS as error:
            self.metrics.evictions.labels("failed").inc()
            kind = (
                "forbidden: the extender's ClusterRole needs create on pods/eviction"
                if (isinstance(error, Forbidden))
                else error_text(error)
            )
            log.warning(
                "consolidation for %s: cannot evict %s: %s; tried again on the next step",
                loggable(active.key),
                loggable(victim.pod),
                loggable(kind),
            )
            return False
        active.evicted += 1
        self.metrics.evictions.labels("evicted").inc()
        log.info(
            "consolidation for %s: evicted %s from %s%s",
            loggable(active.key),
            loggable(victim.pod),
            loggable(active.record.node),
            _place(victim),
        )
        self._evicted_event(active, victim)
        return True

    def _evicted_event(self, active: Active, victim: Replacement) -> None:
        if self.report is None:
            return
        namespace, _, name = victim.pod.partition("/")
        self.report(
            ObjectRef("Pod", namespace, name, victim.uid),
            "NeuronConsolidationEvicted",
            f"evicted to free devices {format_ids(list(active.record.devices))} of "
            f"{active.record.node} for {active.key}{_place(victim)}",
            False,
            evicted_event_name(victim.uid),
        )


def evicted_event_name(uid: str) -> str:
    """The NeuronConsolidationEvicted event's own name: one per moved pod, ever."""
    return f"{uid}.neuron-consolidation-evicted"


def _place(victim: Replacement) -> str:
    if not victim.node:
        return ""
    return (
        f"; its replacement's place is held on {victim.node} (cores "
        f"{format_ids(list(victim.cores))})"
    )
