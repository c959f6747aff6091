"""An autoscaler in the simulator: nodes added and removed, with or without consolidation and
capacity requests (docs/autoscaling.md). Pure.

The autoscaler is one that counts devices, as Karpenter and cluster-autoscaler do:
- a pod that no node has the count free for (short of devices) gets a node of the smallest type
  of the fleet whose empty node holds it, `provision_seconds` later (its own scale-up);
- a pod stranded by fragmentation (its count free on some node, its block on none) gets none from
  it. With capacity requests (extender/loops/requesting), one is asked for once the pod has
  waited `pending_seconds` and consolidation (when on) has no plan it may carry out, at most
  `max_in_flight` at once; the node arrives `provision_seconds` later and the pod is placed on it
  (its block held);
- a node it added that stays empty `empty_seconds` is removed (consolidation WhenEmpty; the pods
  it holds are never moved: the do-not-disrupt mark keeps the count-based consolidation off the
  nodes whose pods have no block elsewhere, docs/autoscaling.md);
- it adds at most `max_added` nodes (a node pool's limit); a pod waiting for that room is looked
  at again every `RETRY_SECONDS`.
Consolidation (sim/consolidation.py) runs at its defaults when on.

Counted: nodes added (and how many at capacity requests), the seconds added nodes were up
(node-hours spent), and, as for every run, large-pod waits.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from neuron_scheduler.core.allocation import Placement, allocate
from neuron_scheduler.core.capacity import smallest_type
from neuron_scheduler.core.consolidation import fits_by_count
from neuron_scheduler.sim.consolidation import (
    ConsolidatingSimulation,
    ConsolidationLimits,
)
from neuron_scheduler.sim.simulation import (
    NodeSpec,
    PodEvent,
    SimNode,
    SimResult,
    Simulation,
    Waiting,
)

RETRY_SECONDS = 30.0
MAX_LOOKS = 40  # times one waiting pod is looked at


@dataclass(frozen=True, slots=True)
class AutoscalerLimits:
    consolidation: bool = False
    capacity_requests: bool = False
    provision_seconds: float = 90.0  # from asking to a node pods can use
    pending_seconds: float = 120.0  # capacity requests: how long a stranded pod waits first
    max_in_flight: int = 2  # capacity requests at once
    empty_seconds: float = 30.0  # an added node empty this long is removed
    max_added: int = 8  # nodes added at once (a node pool's limit)


def autoscaled(
    limits: AutoscalerLimits, consolidation: ConsolidationLimits | None = None
) -> type[Simulation]:
    """A Simulation with this autoscaler (a Contender's `simulation`)."""
    return type(
        "AutoscaledSimulation",
        (AutoscaledSimulation,),
        {"autoscaler": limits, "limits": consolidation or ConsolidationLimits()},
    )


class AutoscaledSimulation(ConsolidatingSimulation):
    autoscaler: ClassVar[AutoscalerLimits] = AutoscalerLimits()

    def run(
        self, events: list[PodEvent], progress: Callable[[int], None] | None = None
    ) -> SimResult:
        self._timers: list[tuple[float, int, str, str]] = []  # (when, seq, kind, what)
        self._timer_seq = 0
        self._added: dict[str, float] = {}  # added node -> when it arrived
        self._coming: dict[str, str] = {}  # pod -> the instance type on its way for it
        self._requests_in_flight = 0
        self._autoscaler_looks: dict[str, int] = {}
        self._result: SimResult | None = None
        self._fleet_types = {n.topology.instance_type for n in self.nodes}
        result = super().run(events, progress)
        for arrived in self._added.values():
            result.added_node_seconds += max(self._now - arrived, 0.0)
        return result

    # --- hooks into the simulation ---------------------------------------------------------------

    def _arrive(self, event: PodEvent, result: SimResult) -> None:
        self._result = result
        super()._arrive(event, result)
        if event.pod in self._waiting:
            self._timer(event.time, "look", event.pod)  # the autoscaler sees it at once

    def _consider(self, pod: str, result: SimResult) -> None:
        if self.autoscaler.consolidation:
            super()._consider(pod, result)

    def _release(self, pod: str) -> SimNode:
        node = super()._release(pod)
        if node.name in self._added and not node.pods:
            self._timer(self._now + self.autoscaler.empty_seconds, "empty", node.name)
        return node

    def _leave_until(self, time: float, result: SimResult) -> None:
        """Everything due by `time` in time order: departures and consolidation's looks (the
        base classes), and the autoscaler's timers, which departures may add (a node emptied)."""
        self._result = result
        while True:
            timer = self._timers[0][0] if self._timers else math.inf
            other = min(
                self._departures[0][0] if self._departures else math.inf,
                self._checks[0][0] if self._checks else math.inf,
            )
            if min(timer, other) > time:
                return
            if other < timer:
                super()._leave_until(other, result)
                continue
            when, _, kind, what = heapq.heappop(self._timers)
            self._now = max(self._now, when)
            if kind == "look":
                self._look(what, result)
            elif kind == "empty":
                self._empty(what, result)
            else:
                self._node_arrives(kind, what, result)

    # --- the autoscaler --------------------------------------------------------------------------

    def _timer(self, when: float, kind: str, what: str) -> None:
        self._timer_seq += 1
        heapq.heappush(self._timers, (when, self._timer_seq, kind, what))

    def _look(self, pod: str, result: SimResult) -> None:
        waiting = self._waiting.get(pod)
        if waiting is None or pod in self._coming:
            return
        limits = self.autoscaler
        request = waiting.request
        by_count = False
        for node in self.nodes:
            if isinstance(allocate(node.topology, node.state, request, self.policy), Placement):
                return  # it fits now: kube-scheduler's next try places it
            by_count = by_count or fits_by_count(node.topology, node.state, request)
        waited = self._now - waiting.arrived
        if not by_count:
            self._ask(pod, waiting, capacity=False)
        elif limits.capacity_requests and waited >= limits.pending_seconds:
            consolidation_helps = limits.consolidation and (
                (move := self._plan(request, waiting.priority)) is not None
                and self._affordable(move)
            )
            if not consolidation_helps and self._requests_in_flight < limits.max_in_flight:
                self._ask(pod, waiting, capacity=True)
        if pod not in self._coming:
            looks = self._autoscaler_looks.get(pod, 0)
            if looks < MAX_LOOKS:
                self._autoscaler_looks[pod] = looks + 1
                wait = RETRY_SECONDS
                if by_count and limits.capacity_requests and waited < limits.pending_seconds:
                    wait = limits.pending_seconds - waited
                self._timer(self._now + wait, "look", pod)

    def _ask(self, pod: str, waiting: Waiting, capacity: bool) -> None:
        if len(self._added) + len(self._coming) >= self.autoscaler.max_added:
            return
        topology = smallest_type(self.catalog, waiting.request, self._fleet_types, self.policy)
        if topology is None:
            return
        self._coming[pod] = topology.instance_type
        if capacity:
            self._requests_in_flight += 1
        kind = "capacity" if capacity else "scale-up"
        self._timer(self._now + self.autoscaler.provision_seconds, kind, pod)

    def _node_arrives(self, kind: str, pod: str, result: SimResult) -> None:
        instance_type = self._coming.pop(pod)
        if kind == "capacity":
            self._requests_in_flight -= 1
            result.capacity_requests += 1
        result.nodes_added += 1
        name = f"added-{result.nodes_added}"
        node = self._make_node(NodeSpec(name, instance_type))
        self.nodes.append(node)
        self._add(node)
        self._added[name] = self._now
        # The pod it came for first (its block is held for it), then the queue, in order.
        order = sorted(self._waiting, key=lambda p: (p != pod, self._queue_order(p)))
        for name_waiting in order:
            waiting = self._waiting[name_waiting]
            if self._place_on(node, name_waiting, waiting.request):
                self._placed(name_waiting, waiting, result)
        if not node.pods:
            self._timer(self._now + self.autoscaler.empty_seconds, "empty", name)

    def _empty(self, name: str, result: SimResult) -> None:
        arrived = self._added.get(name)
        node = next((n for n in self.nodes if n.name == name), None)
        if arrived is None or node is None or node.pods:
            return
        self._remove(node)
        self.nodes.remove(node)
        del self._added[name]
        result.added_node_seconds += self._now - arrived
