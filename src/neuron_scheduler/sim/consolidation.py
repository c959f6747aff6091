"""Consolidation in the simulator: the extender's (extender/loops/consolidating) on a model of the
cluster. Pure.

A pod still waiting `pending_seconds` after it arrived, that fits by count on some node but has
no block anywhere, gets a plan from the same planner the extender uses (core/consolidation): on
one node (any that allows its size, not only those with its count free), the fewest pods that
free a block for it, each pod of equal priority placed again
right now (owned by a controller: `PodEvent.owned`), never a bare pod. The plan is carried out at
once: the moved pods leave, the pod takes the block, each moved pod's replacement takes the place
held for it (the same pod in the model: its lifetime goes on), a lower-priority pod with no place
waits again. A pod no plan helps is looked at again every `retry_seconds`, up to `MAX_LOOKS`
times.

Bounds as the extender's: `evictions_per_hour` over any hour, `node_cooldown` between two plans on
one node, `max_victims` per plan. Not modelled: termination (pods leave at once), the plan's
holds (nothing can take the freed block in between), kube-scheduler placing a replacement
elsewhere than its held place.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

from neuron_scheduler.core.allocation import Placement, allocate
from neuron_scheduler.core.consolidation import (
    DEFAULT_MAX_VICTIMS,
    Move,
    Mover,
    Room,
    fits_by_count,
    plan_move,
)
from neuron_scheduler.core.eviction import Occupant
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.sim.preemption import Resident
from neuron_scheduler.sim.simulation import PodEvent, SimResult, Simulation, Waiting

HOUR = 3600.0
MAX_LOOKS = 20  # times one waiting pod is planned for


@dataclass(frozen=True, slots=True)
class ConsolidationLimits:
    pending_seconds: float = 30.0
    retry_seconds: float = 30.0
    max_victims: int = DEFAULT_MAX_VICTIMS
    evictions_per_hour: int = 30
    node_cooldown: float = 120.0


def consolidating(limits: ConsolidationLimits) -> type[Simulation]:
    """A Simulation that consolidates within these limits (a Contender's `simulation`)."""
    return type(
        "ConsolidatingSimulation",
        (ConsolidatingSimulation,),
        {"limits": limits},
    )


class ConsolidatingSimulation(Simulation):
    limits: ClassVar[ConsolidationLimits] = ConsolidationLimits()

    def run(
        self, events: list[PodEvent], progress: Callable[[int], None] | None = None
    ) -> SimResult:
        self._owned: set[str] = set()
        self._looks: dict[str, int] = {}
        self._checks: list[tuple[float, int, str]] = []
        self._check_seq = 0
        self._evictions: deque[float] = deque()
        self._cooling: dict[str, float] = {}
        self._ends: dict[str, float | None] = {}
        self._requeued: set[str] = set()
        return super().run(events, progress)

    # --- hooks into the base simulation ----------------------------------------------------------

    def _arrive(self, event: PodEvent, result: SimResult) -> None:
        if event.owned:
            self._owned.add(event.pod)
        super()._arrive(event, result)
        if event.pod in self._waiting:
            self._check_at(event.time + self.limits.pending_seconds, event.pod)

    def _placed(self, pod: str, waiting: Waiting, result: SimResult) -> None:
        self._ends[pod] = None if waiting.duration is None else self._now + waiting.duration
        super()._placed(pod, waiting, result)
        if pod in self._requeued:  # a moved pod placed again: no new placement
            self._requeued.discard(pod)
            result.placed -= 1

    def _leave_until(self, time: float, result: SimResult) -> None:
        while self._checks and self._checks[0][0] <= time:
            when, _, pod = heapq.heappop(self._checks)
            super()._leave_until(when, result)
            self._now = max(self._now, when)
            if pod in self._waiting:
                self._consider(pod, result)
        super()._leave_until(time, result)

    # --- consolidation ---------------------------------------------------------------------------

    def _check_at(self, when: float, pod: str) -> None:
        looks = self._looks.get(pod, 0)
        if looks >= MAX_LOOKS:
            return
        self._looks[pod] = looks + 1
        self._check_seq += 1
        heapq.heappush(self._checks, (when, self._check_seq, pod))

    def _consider(self, pod: str, result: SimResult) -> None:
        waiting = self._waiting[pod]
        move = self._plan(waiting.request, waiting.priority)
        if move is None or not self._affordable(move):
            self._check_at(self._now + self.limits.retry_seconds, pod)
            return
        self._carry_out(pod, waiting, move, result)

    def _plan(self, request: NeuronRequest, priority: int) -> Move | None:
        """The best move for a stranded pod (some node has its count free), on any node that
        allows its size (extender/loops/movers), or None (also when some node fits it now:
        then it is only waiting for kube-scheduler's next try)."""
        candidates = []
        stranded = False
        for node in self.nodes:
            decision = allocate(node.topology, node.state, request, self.policy)
            if isinstance(decision, Placement):
                return None
            stranded = stranded or fits_by_count(node.topology, node.state, request)
            if not decision.unresolvable and self._cooling.get(node.name, 0.0) <= self._now:
                candidates.append(node)
        if not stranded:
            return None
        best: Move | None = None
        for node in candidates:
            movers = {
                name: Mover(
                    Occupant(r.cores, 0, r.priority, r.started),
                    r.request,
                    name,
                    "" if name in self._owned else "a bare pod",
                )
                for name, r in ((n, self._residents[n]) for n in node.pods)
            }
            answer = plan_move(
                node.name,
                node.topology,
                node.state,
                request,
                priority,
                movers,
                self._rooms,
                max_victims=self.limits.max_victims,
                policy=self.policy,
            )
            if isinstance(answer, Move) and (
                best is None or (answer.key, answer.node) < (best.key, best.node)
            ):
                best = answer
        return best

    def _rooms(self, uid: str, request: NeuronRequest) -> Iterable[Room]:
        del uid, request
        return [Room(n.name, n.topology, n.state) for n in self.nodes]

    def _affordable(self, move: Move) -> bool:
        while self._evictions and self._evictions[0] <= self._now - HOUR:
            self._evictions.popleft()
        return len(self._evictions) + len(move.victims) <= self.limits.evictions_per_hour

    def _carry_out(self, pod: str, waiting: Waiting, move: Move, result: SimResult) -> None:
        by_name = {n.name: n for n in self.nodes}
        node = by_name[move.node]
        residents = {v: self._residents[v] for v in move.victims}
        for victim in move.victims:
            self._release(victim)
            self._evictions.append(self._now)
        self._cooling[move.node] = self._now + self.limits.node_cooldown
        result.moved += len(move.victims)
        if node.state.used_cores & move.block.core_mask:  # cannot happen: the planner freed it
            result.moved_for_nothing += len(move.victims)
        else:
            self._bind(node, pod, move.block, waiting.request)
            self._placed(pod, waiting, result)
            result.unblocked += 1
        placed = {d.pod: d for d in move.destinations}
        for victim, resident in residents.items():
            destination = placed.get(victim)
            if destination is not None:
                target = by_name[destination.node]
                self._bind(target, victim, destination.placement, resident.request)
                self._residents[victim] = Resident(
                    resident.request, resident.priority, self._now, destination.placement.core_mask
                )
                continue
            end = self._ends.get(victim)
            left = None if end is None else max(end - self._now, 0.0)
            self._waiting[victim] = Waiting(
                resident.request, resident.priority, self._now, left, "moved"
            )
            self._requeued.add(victim)
            self._check_at(self._now + self.limits.pending_seconds, victim)
