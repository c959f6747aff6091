"""A contender no real scheduler can be: it knows when every pod will leave. Pure.

What it is for: issue 16 asks for a utilization at the first fragmentation refusal of 90% or
more, and where a target is out of reach, for data on what is reachable. Fragmentation in these
workloads comes from departures: small pods that outlive their neighbours leave holes in the
blocks large pods need. Lifetimes are what an online scheduler lacks, so a run that has them
says how much of the gap knowing them could close.

How it uses them: everything else is neuron-scheduler's (allocator, demand, the chart's profile
and kube-scheduler's scores); only kube-scheduler's random pick among equally scored nodes is
replaced, by lifetime alignment in the manner of NILAS, the lifetime-aware scoring of LAVA (Ling
et al., "LAVA: Lifetime-Aware VM Allocation with Learned Distributions and Adaptation to
Mispredictions", MLSys 2025), with exact lifetimes where LAVA predicts them: prefer a
node whose last pod leaves no earlier than the new one, the one whose last pod leaves soonest
after it (the pod lengthens no node's busy time, and the node empties soon after it leaves);
else the node whose last pod leaves closest before it (lengthening its busy time least); an
empty node last.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.sim.simulation import PodEvent, SimNode, SimResult, Simulation, Waiting

# Alignment classes, best first.
_OUTLIVED = 0  # the node's last pod leaves no earlier than the new one
_LENGTHENS = 1  # the new pod ends after the node's last pod
_EMPTY = 2


class ClairvoyantSimulation(Simulation):
    """neuron-scheduler with kube-scheduler's tie-break replaced by lifetime alignment."""

    _ends: dict[str, float]  # running pods: when each leaves (inf: never)

    def run(
        self, events: list[PodEvent], progress: Callable[[int], None] | None = None
    ) -> SimResult:
        self._ends = {}
        return super().run(events, progress)

    def _end_of(self, waiting: Waiting) -> float:
        return math.inf if waiting.duration is None else self._now + waiting.duration

    def _placed(self, pod: str, waiting: Waiting, result: SimResult) -> None:
        self._ends[pod] = self._end_of(waiting)
        super()._placed(pod, waiting, result)

    def _release(self, pod: str) -> SimNode:
        self._ends.pop(pod, None)
        return super()._release(pod)

    def _break_tie(
        self, tied: list[tuple[Placement, dict[str, SimNode]]], waiting: Waiting
    ) -> tuple[SimNode, Placement]:
        end = self._end_of(waiting)
        best: tuple[tuple[int, float, str], SimNode, Placement] | None = None
        for placement, members in tied:
            for node in members.values():
                key = (*alignment(end, [self._ends[pod] for pod in node.pods]), node.name)
                if best is None or key < best[0]:
                    best = (key, node, placement)
        assert best is not None  # kube-scheduler's pick had at least one node
        return best[1], best[2]


def alignment(end: float, node_ends: list[float]) -> tuple[int, float]:
    """How well a pod ending at `end` fits a node whose pods end at `node_ends`; smaller is
    better."""
    if not node_ends:
        return (_EMPTY, 0.0)
    last = max(node_ends)
    if end <= last:
        return (_OUTLIVED, 0.0 if end == last else last - end)
    return (_LENGTHENS, end - last)
