"""Capacity requests: a node from the cluster's autoscaler for a pod stranded by fragmentation that
consolidation cannot or may not help (docs/autoscaling.md). The leader's loop.

Autoscalers count devices: a pod stranded by fragmentation fits an existing node by count, so they
add no node for it. When it has waited `pending_seconds` (unschedulable, stranded: no node it may
go to has a block for it, some has its count free), has no plan, and consolidation found no move
for it (or is not on), the leader creates a placeholder pod (core/capacity) that the autoscaler
understands: a whole node of the smallest instance type that can hold the pod's block and that
the pod's nodeSelector, required affinity and tolerations admit (copied onto the placeholder),
among those allowed (`instance_types`, by default the types of the nodes the pod may go to now),
at the placeholder PriorityClass (-10, the lowest that still triggers a scale-up), with a
scheduler name nobody serves and a PodScheduled=False/Unschedulable condition written on it (what
autoscalers look for), in the extender's namespace.

When a node of that type where the pod fits registers (Karpenter's Node loses its
`karpenter.sh/unregistered` taint), in this order:
1. the pod's block there is held for it: a plan of kind capacity on the pod (core/planrecord,
   the annotation consolidation's plans use), so every replica and a restarted one hold it, and
   filter refuses it to every other pod of equal or lower priority;
2. the placeholder is deleted, so the autoscaler sees no pod still waiting for that node and adds
   no second one;
3. the pod is nominated to the node (Karpenter ignores a pending pod with a nomination); the
   waker and kube-scheduler's own event bind it there.
A crash between any two steps leaves a placeholder that the next leader deletes (its pod has a
hold), or a hold that ends with its time.

Bounded: at most `max_in_flight` placeholders at once, one per pod; a placeholder waits
`timeout` seconds, then it goes, the pod gets a warning event, and it is not asked for again for
as long. The leader deletes its placeholders whose pod is gone, bound, fits now, has a plan, or
that it cannot read, and all of them when the mode is off: on start and when it becomes leader
too. Placeholders are told apart by a label whose value is this extender's `owner`, in its
namespace; they never count as pods in any view (extender/state/placeholders).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from neuron_scheduler.core.allocation import Placement, Policy
from neuron_scheduler.core.capacity import (
    PAUSE_IMAGE,
    PLACEHOLDER_LABEL,
    PLACEHOLDER_SCHEDULER,
    PRIORITY_CLASS,
    RECORD_ANNOTATION,
    Asked,
    encode,
    smallest_type,
    whole_node,
)
from neuron_scheduler.core.catalog import INSTANCE_TYPE_LABEL, Catalog
from neuron_scheduler.core.ids import format_ids
from neuron_scheduler.core.logtext import NAME_LIMIT, loggable
from neuron_scheduler.core.planrecord import PLAN_ANNOTATION, PlanKind, PlanRecord
from neuron_scheduler.core.planrecord import encode as encode_plan
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.extender.loops.consolidating import Concluded, Consolidator, Mode
from neuron_scheduler.extender.loops.movers import Admits, Stranded, anywhere, stranded
from neuron_scheduler.extender.loops.stepping import run_steps
from neuron_scheduler.extender.loops.waking import AnnotationWriter
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.extender.state.movability import gang_of
from neuron_scheduler.extender.state.pending import PendingPods
from neuron_scheduler.extender.state.placeholders import Placeholder, Placeholders
from neuron_scheduler.extender.state.plans import Active, Plans
from neuron_scheduler.kube.errors import READ_ERRORS, Conflict, Forbidden, NotFound, error_text
from neuron_scheduler.kube.events import Report
from neuron_scheduler.kube.nodefit import admits_label, why_not
from neuron_scheduler.kube.objects import Node, ObjectRef, Pod
from neuron_scheduler.kube.reading import epoch, servable_request, unschedulable

log = logging.getLogger("neuron_scheduler.extender.requesting")

STEP_SECONDS = 2.0  # between looks (a node an autoscaler adds is ready within seconds on Karpenter)
HOLD_SECONDS = 300.0  # the block on the node added is held this long at most for its pod
MAX_CONTAINERS = 16  # containers of the pod whose cpu and memory requests the placeholder copies
MAX_TOLERATIONS = 64
# Pending pods judged (is it stranded? which type?) per step, those judged longest ago first (never
# judged first of all), then highest priority and oldest first, and how long one judged not
# stranded (it fits, or no node has its count) waits before it is judged again: each judgement
# reads every node, so 10,000 pending pods must not all be judged every 2 s on the event loop. A
# pod that becomes stranded meanwhile waits this much longer. Longest ago first: pods that stay
# pending ranked above a stranded one (more than are judged in JUDGE_AGAIN_SECONDS, or ones no
# instance type holds) must not take every judgement from it.
JUDGED_PER_STEP = 8
JUDGE_AGAIN_SECONDS = 30.0


class CapacityMode(StrEnum):
    OFF = "off"
    ON = "on"


@dataclass(frozen=True, slots=True)
class CapacityLimits:
    """The bounds (chart: scheduler.capacityRequests; values.yaml says why these defaults)."""

    mode: CapacityMode = CapacityMode.OFF
    pending_seconds: float = 120.0
    max_in_flight: int = 2
    timeout: float = 600.0
    instance_types: tuple[str, ...] = ()  # () : the types of the nodes the pod may go to
    namespace: str = "kube-system"  # where placeholders live (the extender's own)
    owner: str = "k8s-neuron-scheduler"  # the placeholders' label value: this extender's
    priority_class: str = PRIORITY_CLASS
    image: str = PAUSE_IMAGE


DEFAULT_CAPACITY = CapacityLimits()


class RequesterAPI(AnnotationWriter, Protocol):
    """What capacity requests need of KubeAPI beyond the waker's annotation patch."""

    async def create_pod(self, namespace: str, body: dict[str, Any]) -> Pod: ...

    async def delete_pod(self, namespace: str, name: str, uid: str) -> None: ...

    async def patch_pod_condition(
        self, namespace: str, name: str, uid: str, condition: dict[str, str]
    ) -> None: ...

    async def patch_nominated_node(
        self, namespace: str, name: str, uid: str, node: str
    ) -> None: ...


class Outcome(StrEnum):
    REQUESTED = "requested"  # a placeholder was created
    FULFILLED = "fulfilled"  # a node came: the pod's block there is held, the placeholder gone
    TIMED_OUT = "timed_out"  # no node came in time: the placeholder is gone
    WITHDRAWN = "withdrawn"  # the pod went, was bound, fits now or got a plan
    FAILED = "failed"  # the placeholder could not be created


class CapacityMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "neuron_scheduler_capacity_requests",
            "Capacity requests by outcome: requested (a placeholder created), fulfilled (a node "
            "came and the pod's block on it is held), timed_out, withdrawn (the pod went, was "
            "bound, fits now or got a plan), failed (the placeholder could not be created)",
            ["outcome"],
            registry=registry,
        )
        self.blocked = Counter(
            "neuron_scheduler_capacity_requests_blocked",
            "Stranded pods no node was asked for, by why: max_in_flight, no_instance_type (no "
            "allowed instance type the pod may go to holds its block)",
            ["reason"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "neuron_scheduler_capacity_requests_in_flight",
            "Placeholders of this extender waiting for a node",
            registry=registry,
        )
        self.seconds = Histogram(
            "neuron_scheduler_capacity_request_seconds",
            "From a placeholder's creation to a node holding its pod's block",
            buckets=(5, 10, 20, 30, 60, 120, 180, 300, 600, 900, 1800),
            registry=registry,
        )
        self.holds = Counter(
            "neuron_scheduler_capacity_holds",
            "Holds of a block on an added node by how they ended: done (the pod bound there), "
            "bound_elsewhere, expired, cancelled, gone",
            ["outcome"],
            registry=registry,
        )


@dataclass(slots=True)
class _Memory:
    """What the leader remembers of a pending pod (forgotten when it leaves `pending`)."""

    said: str = ""  # the last message logged and sent as an event
    retry_after: float = 0.0  # wall clock: not asked for again before (after a time-out)
    judge_after: float = 0.0  # wall clock: judged not stranded; not judged again before
    judged: float = 0.0  # wall clock: last judged (0: never)


def candidate_types(ledger: Ledger, where: Stranded) -> set[str]:
    """The instance types of the nodes a stranded pod may go to: what the cluster already runs
    for it (when no allow-list is given)."""
    return {
        entry.topology.instance_type
        for name in where.nodes
        if (entry := ledger.nodes.get(name)) is not None
    }


def asked_type(
    catalog: Catalog,
    pod: Pod,
    request: NeuronRequest,
    candidates: Sequence[str] | set[str],
    policy: Policy = Policy.BEST_FIT,
) -> Topology | None:
    """The instance type a capacity request asks for: the smallest of the candidates whose
    empty node holds the pod's block and that the pod's own rules admit."""
    admitted = [t for t in candidates if admits_label(pod, INSTANCE_TYPE_LABEL, t)]
    return smallest_type(catalog, request, admitted, policy)


class CapacityRequester:
    def __init__(
        self,
        ledger: Ledger,
        catalog: Catalog,
        placeholders: Placeholders,
        plans: Plans,
        pending: PendingPods,
        consolidator: Consolidator,
        api: RequesterAPI,
        registry: CollectorRegistry,
        *,
        limits: CapacityLimits = DEFAULT_CAPACITY,
        report: Report | None = None,
        policy: Policy = Policy.BEST_FIT,
        admits: Admits = anywhere,
        is_leader: Callable[[], bool] = lambda: True,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`admits`: the extender's node filters (the training-job rule), as consolidation asks
        them."""
        self.ledger = ledger
        self.catalog = catalog
        self.placeholders = placeholders
        self.plans = plans
        self.pending = pending
        self.consolidator = consolidator
        consolidator.on_capacity_end = self._hold_ended
        consolidator.node_asked = self._node_asked
        self.api = api
        self.limits = limits
        self.report = report
        self.policy = policy
        self.admits = admits
        self.is_leader = is_leader
        self.wall_clock = wall_clock
        self.metrics = CapacityMetrics(registry)
        self.metrics.in_flight.set_function(lambda: len(self.mine()))
        self._memory: dict[str, _Memory] = {}  # pending pod uid -> what is remembered of it
        self._gone: set[str] = set()  # placeholders deleted by this process, until the watch says
        self._signal = asyncio.Event()

    def mine(self) -> list[Placeholder]:
        """This extender's placeholders (its namespace, its owner name) not deleted yet."""
        return [
            p
            for p in self.placeholders.pods.values()
            if p.namespace == self.limits.namespace
            and p.owner == self.limits.owner
            and p.uid not in self._gone
        ]

    def _node_asked(self, uid: str) -> bool:
        """A placeholder of ours waits for a node for this pod."""
        return any(p.asked is not None and p.asked.uid == uid for p in self.mine())

    def changed(self) -> None:
        """Something it waits for may have happened (a node came)."""
        self._signal.set()

    # --- a ClusterView, for its wake-ups only: while a placeholder waits, a node that changes
    # (Karpenter's Node loses its unregistered taint) or the pod bound must end it at once: a
    # placeholder that outlives the bind no longer fits the new node, and the autoscaler would
    # add another.

    def _waiting(self) -> bool:
        return any(p.asked is not None for p in self.mine())

    def replace_nodes(self, nodes: Iterable[Node]) -> None:
        if self._waiting():
            self._signal.set()

    def apply_node(self, node: Node) -> None:
        if self._waiting():
            self._signal.set()

    def remove_node(self, name: str) -> None:
        pass

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        pass

    def apply_pod(self, pod: Pod) -> None:
        if pod.spec.nodeName and self._node_asked(pod.metadata.uid):
            self._signal.set()

    def remove_pod(self, uid: str) -> None:
        pass

    # --- the loop (leader only) ----------------------------------------------------------------

    async def run(self) -> None:
        await run_steps(self.step, self._signal, STEP_SECONDS, "capacity request", log)

    async def step(self) -> None:
        self._forget()
        if not self.is_leader():
            return
        for placeholder in self.mine():
            await self._settle(placeholder)
        if self.limits.mode is CapacityMode.OFF:
            return
        await self._ask()

    def _forget(self) -> None:
        for uid in [u for u in self._memory if self.pending.get(u) is None]:
            del self._memory[uid]
        self._gone &= set(self.placeholders.pods)

    # --- what becomes of a placeholder ---------------------------------------------------------

    async def _settle(self, placeholder: Placeholder) -> None:
        """Deletes the placeholder when it is no longer needed; holds the pod's block on a node
        that came for it."""
        asked = placeholder.asked
        if asked is None:
            await self._delete(placeholder, f"its record cannot be read ({placeholder.problem})")
            return
        if self.limits.mode is CapacityMode.OFF:
            await self._delete(placeholder, "capacity requests are off", Outcome.WITHDRAWN)
            return
        pod = self.pending.get(asked.uid)
        if pod is None:
            await self._gone_or_bound(placeholder, asked)
            return
        if self.plans.planned(asked.uid):
            # A plan holds its block (ours, written before a crash, or consolidation's).
            await self._delete(placeholder, "its pod has a block held", Outcome.WITHDRAWN)
            return
        request = servable_request(pod)
        if request is None:
            await self._delete(placeholder, "its pod asks for no Neuron devices", Outcome.WITHDRAWN)
            return
        node, block = self._where_it_fits(pod, request, asked.instance_type)
        if node and block is not None:
            await self._fulfil(placeholder, asked, pod, request, node, block)
            return
        if node:
            await self._delete(placeholder, f"its pod fits on node {node} now", Outcome.WITHDRAWN)
            return
        if self.wall_clock() >= asked.until:
            await self._time_out(placeholder, asked, pod)
            return
        if not placeholder.unschedulable:  # its write failed: autoscalers ignore it without
            await self._write_condition(
                placeholder.namespace, placeholder.name, placeholder.uid, asked
            )

    def _where_it_fits(
        self, pod: Pod, request: NeuronRequest, instance_type: str
    ) -> tuple[str, Placement | None]:
        """A node the pod fits on now: one of the type asked for, with its best block, else any
        other ("", None when none)."""
        claimant = Claimant.of(pod, request)
        verdicts = self.ledger.fill_verdicts(self.ledger.nodes, request, self.policy, claimant)
        best: tuple[int, str, Placement] | None = None
        other = ""
        for name in sorted(verdicts.fitting()):
            facts = self.ledger.facts.get(name)
            if facts is not None and why_not(pod, facts) is not None:
                continue
            if not self.admits(pod, name):
                continue
            entry = self.ledger.nodes[name]
            if entry.topology.instance_type != instance_type:
                other = other or name
                continue
            decision = verdicts.decisions[name]
            assert isinstance(decision, Placement)
            if best is None or decision.score > best[0]:
                best = (decision.score, name, decision)
        if best is not None:
            return best[1], best[2]
        return other, None

    async def _fulfil(
        self,
        placeholder: Placeholder,
        asked: Asked,
        pod: Pod,
        request: NeuronRequest,
        node: str,
        block: Placement,
    ) -> None:
        now = self.wall_clock()
        record = PlanRecord(
            node,
            tuple(block.devices),
            tuple(block.cores),
            now,
            now + HOLD_SECONDS,
            (),
            PlanKind.CAPACITY,
        )
        text = encode_plan(record)
        meta = pod.metadata
        try:
            await self.api.patch_annotations(
                meta.namespace, meta.name, meta.uid, {PLAN_ANNOTATION: text}
            )
        except READ_ERRORS as error:
            log.warning(
                "node %s came for %s, but its block cannot be held (%s); tried again",
                loggable(node),
                loggable(pod.key, NAME_LIMIT),
                loggable(error_text(error)),
            )
            return
        active = self.plans.adopt(pod, text)  # held from here on, before the watch shows it
        self.metrics.requests.labels(Outcome.FULFILLED).inc()
        self.metrics.seconds.observe(max(now - asked.asked, 0.0))
        devices = format_ids(list(block.devices))
        self._tell(
            pod,
            "NeuronCapacityArrived",
            f"node {node} ({asked.instance_type}) came at the capacity request of "
            f"{now - asked.asked:.0f}s ago; devices {devices} there are held for this pod until "
            "it is bound",
        )
        await self._delete(placeholder, f"node {node} came for its pod")
        if active is not None:
            active.nominated = True
            with contextlib.suppress(*READ_ERRORS):
                await self.api.patch_nominated_node(meta.namespace, meta.name, meta.uid, node)

    async def _gone_or_bound(self, placeholder: Placeholder, asked: Asked) -> None:
        """Its pod is no longer pending: bound (kube-scheduler may bind it on the node that came
        before a step here held its block there), or gone."""
        holding = self.ledger.holding(asked.uid)
        entry = self.ledger.nodes.get(holding.node) if holding is not None else None
        if holding is None or entry is None or entry.topology.instance_type != asked.instance_type:
            await self._delete(placeholder, "its pod is bound elsewhere or gone", Outcome.WITHDRAWN)
            return
        now = self.wall_clock()
        self.metrics.requests.labels(Outcome.FULFILLED).inc()
        self.metrics.seconds.observe(max(now - asked.asked, 0.0))
        namespace, _, name = asked.pod.partition("/")
        if self.report is not None:
            self.report(
                ObjectRef("Pod", namespace, name, asked.uid),
                "NeuronCapacityArrived",
                f"node {holding.node} ({asked.instance_type}) came at the capacity request of "
                f"{now - asked.asked:.0f}s ago, and the pod is bound there",
                False,
            )
        await self._delete(placeholder, f"its pod is bound on node {holding.node}, which came")

    async def _time_out(self, placeholder: Placeholder, asked: Asked, pod: Pod) -> None:
        waited = asked.until - asked.asked
        self.metrics.requests.labels(Outcome.TIMED_OUT).inc()
        memory = self._memory.setdefault(pod.metadata.uid, _Memory())
        memory.retry_after = self.wall_clock() + self.limits.timeout
        message = (
            f"no node of {asked.instance_type} where it fits came within {waited:.0f}s of the "
            f"capacity request (placeholder {placeholder.key}); the placeholder is removed and "
            f"a node is asked for again after {self.limits.timeout:.0f}s. Check that a node "
            f"pool of the autoscaler may add {asked.instance_type} (docs/autoscaling.md)"
        )
        self._tell(pod, "NeuronCapacityRequestTimedOut", message, warning=True)
        await self._delete(placeholder, "no node came in time")

    async def _delete(
        self, placeholder: Placeholder, why: str, outcome: Outcome | None = None
    ) -> None:
        try:
            await self.api.delete_pod(placeholder.namespace, placeholder.name, placeholder.uid)
        except (NotFound, Conflict):
            pass  # gone already
        except READ_ERRORS as error:
            log.warning(
                "cannot delete placeholder %s (%s): %s; tried again",
                loggable(placeholder.key, NAME_LIMIT),
                why,
                loggable(error_text(error)),
            )
            return
        self._gone.add(placeholder.uid)
        if outcome is not None:
            self.metrics.requests.labels(outcome).inc()
        log.info("placeholder %s deleted: %s", loggable(placeholder.key, NAME_LIMIT), why)

    def _hold_ended(self, active: Active, outcome: str) -> None:
        self.metrics.holds.labels(outcome).inc()
        log.info(
            "the block held on %s for %s ended: %s",
            loggable(active.record.node, NAME_LIMIT),
            loggable(active.key, NAME_LIMIT),
            outcome.replace("_", " "),
        )

    # --- asking ----------------------------------------------------------------------------------

    def _candidates(self) -> list[tuple[Pod, NeuronRequest]]:
        now = self.wall_clock()
        asked = {p.asked.uid for p in self.mine() if p.asked is not None}
        found = []
        for uid, pod in self.pending.items():
            if uid in asked or self.plans.planned(uid) or uid in self.plans.unreadable:
                continue
            memory = self._memory.get(uid, _Memory())
            if memory.retry_after > now or memory.judge_after > now:
                continue
            if gang_of(pod) or not unschedulable(pod):
                continue  # a training job's member: its job moves (and asks) whole, not done
            if now - epoch(pod.metadata.creationTimestamp or "") < self.limits.pending_seconds:
                continue
            if not self._consolidation_cannot_help(uid):
                continue
            request = servable_request(pod)
            if request is not None:
                found.append((pod, request))
        found.sort(
            key=lambda p: (
                self._memory.get(p[0].metadata.uid, _Memory()).judged,
                -(p[0].spec.priority or 0),
                p[0].metadata.creationTimestamp,
            )
        )
        return found

    def _consolidation_cannot_help(self, uid: str) -> bool:
        """Consolidation is not on, or it looked at the pod and found no plan it may carry out:
        no move, no node free of plans and cooldowns, or no evictions left this hour."""
        if self.consolidator.limits.mode is not Mode.ON:
            return True
        return self.consolidator.concluded(uid) in (
            Concluded.NO_MOVE,
            Concluded.NO_NODE,
            Concluded.EVICTIONS_PER_HOUR,
        )

    async def _ask(self) -> None:
        for pod, request in self._candidates()[:JUDGED_PER_STEP]:
            memory = self._memory.setdefault(pod.metadata.uid, _Memory())
            where = stranded(self.ledger, pod, request, self.policy, self.admits)
            if where is None:
                # It fits somewhere, or no node has its count (the autoscaler's own case).
                memory.judged = self.wall_clock()
                memory.judge_after = memory.judged + JUDGE_AGAIN_SECONDS
                continue
            if len(self.mine()) >= self.limits.max_in_flight:
                self.metrics.blocked.labels("max_in_flight").inc()
                return  # not judged: the first in line when a request ends
            memory.judged = self.wall_clock()
            types = self.limits.instance_types or candidate_types(self.ledger, where)
            topology = asked_type(self.catalog, pod, request, types, self.policy)
            if topology is None:
                self.metrics.blocked.labels("no_instance_type").inc()
                allowed = ", ".join(sorted(types)) or "none"
                self._tell(
                    pod,
                    "NeuronCapacityRequestImpossible",
                    f"no instance type it may go to holds a block of {request.describe()} "
                    f"(allowed: {allowed}); no node is asked for",
                    warning=True,
                )
                continue
            await self._create(pod, request, topology, where)

    async def _create(
        self, pod: Pod, request: NeuronRequest, topology: Topology, where: Stranded
    ) -> None:
        now = self.wall_clock()
        asked = Asked(
            pod.key,
            pod.metadata.uid,
            topology.instance_type,
            NeuronRequest(request.resource, request.count),
            now,
            now + self.limits.timeout,
        )
        body = placeholder_body(pod, asked, topology, self.limits)
        namespace = self.limits.namespace
        try:
            created = await self.api.create_pod(namespace, body)
        except READ_ERRORS as error:
            self.metrics.requests.labels(Outcome.FAILED).inc()
            hint = (
                ": the extender's Role needs create on pods in its namespace "
                "(scheduler.capacityRequests.mode=on renders it)"
                if isinstance(error, Forbidden)
                else ""
            )
            self._tell(
                pod,
                "NeuronCapacityRequestFailed",
                f"cannot ask for a node of {topology.instance_type}: {error_text(error)}{hint}",
                warning=True,
            )
            return
        meta = created.metadata
        # Seen as in flight before the watch shows it.
        self.placeholders.apply_pod(created)
        await self._write_condition(namespace, meta.name, meta.uid, asked)
        self.metrics.requests.labels(Outcome.REQUESTED).inc()
        by_count = ", ".join(where.by_count[:3]) + (" ..." if len(where.by_count) > 3 else "")
        self._tell(
            pod,
            "NeuronCapacityRequested",
            f"asked the cluster's autoscaler for a node of {topology.instance_type} "
            f"(placeholder {namespace}/{meta.name}, {whole_node(topology, request)} "
            f"{request.resource}): no node it may go to has a block of {request.describe()} "
            f"(free by count on {by_count}), and consolidation cannot move pods for it; "
            f"waits up to {self.limits.timeout:.0f}s",
        )

    async def _write_condition(self, namespace: str, name: str, uid: str, asked: Asked) -> None:
        """What autoscalers look for; nothing else ever writes a placeholder's status, so a
        failed write is tried again on the next step."""
        try:
            await self.api.patch_pod_condition(namespace, name, uid, unschedulable_condition(asked))
        except READ_ERRORS as error:
            log.warning(
                "cannot write the Unschedulable condition of placeholder %s/%s (autoscalers ignore "
                "it without): %s; tried again",
                loggable(namespace, NAME_LIMIT),
                loggable(name, NAME_LIMIT),
                loggable(error_text(error)),
            )
            return
        placeholder = self.placeholders.pods.get(uid)
        if placeholder is not None:  # not written again before the watch shows it
            self.placeholders.pods[uid] = dataclasses.replace(placeholder, unschedulable=True)

    def _tell(self, pod: Pod, reason: str, message: str, warning: bool = False) -> None:
        """An event on the pending pod and a log line, once per message."""
        memory = self._memory.setdefault(pod.metadata.uid, _Memory())
        if memory.said == message:
            return
        memory.said = message
        log.info("capacity for %s: %s", loggable(pod.key, NAME_LIMIT), loggable(message))
        if self.report is not None:
            self.report(ObjectRef.of_pod(pod), reason, message, warning)


def unschedulable_condition(asked: Asked) -> dict[str, str]:
    now = datetime.fromtimestamp(asked.asked, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": f"neuron-scheduler asks for a node of {asked.instance_type} for {asked.pod}",
        "lastTransitionTime": now,
    }


def placeholder_body(
    pod: Pod, asked: Asked, topology: Topology, limits: CapacityLimits
) -> dict[str, Any]:
    """The placeholder for `pod`: a whole node of `topology`'s type, on every rule of the pod's
    own about nodes, asking for the pod's cpu and memory too (container by container, as the
    pod does, so the node also holds them)."""
    spec = pod.spec
    selector = {**spec.nodeSelector, INSTANCE_TYPE_LABEL: topology.instance_type}
    whole = str(whole_node(topology, asked.request))
    containers = []
    for index, container in enumerate(spec.containers[:MAX_CONTAINERS]):
        asks = container.resources.requests
        requests: dict[str, str] = {k: str(asks[k]) for k in ("cpu", "memory") if k in asks}
        bounds: dict[str, str] = {}
        if index == 0:  # (an extended resource's request and limit must be equal)
            requests[asked.request.resource] = bounds[asked.request.resource] = whole
        containers.append(
            {
                "name": f"c{index}",
                "image": limits.image,
                "resources": {"requests": requests, "limits": bounds},
            }
        )
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "capacity-request-",
            "namespace": limits.namespace,
            "labels": {PLACEHOLDER_LABEL: limits.owner},
            "annotations": {RECORD_ANNOTATION: encode(asked)},
        },
        "spec": {
            "schedulerName": PLACEHOLDER_SCHEDULER,
            "priorityClassName": limits.priority_class,
            "nodeSelector": selector,
            "tolerations": msgspec.to_builtins(spec.tolerations[:MAX_TOLERATIONS]),
            "containers": containers,
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
        },
    }
    affinity = spec.affinity.nodeAffinity if spec.affinity else None
    required = affinity.requiredDuringSchedulingIgnoredDuringExecution if affinity else None
    if required is not None:
        body["spec"]["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": msgspec.to_builtins(required)
            }
        }
    return body
