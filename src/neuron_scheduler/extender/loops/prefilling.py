"""Decisions made ahead: while no filter or prioritize call is being served, the request shapes the
cluster asks for most are decided on every node not decided yet, so that kube-scheduler's calls
find them kept.

filter and prioritize keep each decision until its node changes (state.ledger), but the first
call for a shape after a restart, after the demand snapshot changed (every kept decision is
dropped then) or on nodes just added decides every node it names: up to four decisions a pod at
5,000 nodes in bench/throughput.py, made on kube-scheduler's serial path (issue 50). Made here
they cost the same CPU when the extender has nothing else to do, a chunk at a time, never while
kube-scheduler is calling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from itertools import islice

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.resources import NeuronRequest, RequestError
from neuron_scheduler.extender.state.ledger import UNIT_RESOURCE, Ledger

log = logging.getLogger("neuron_scheduler.extender.prefilling")

CHUNK = 100  # nodes decided per turn: a millisecond or two of the event loop
IDLE = 0.05  # seconds since the last filter or prioritize call before a turn is taken
PERIOD = 1.0  # seconds between looks once every shape is decided everywhere
MAX_SHAPES = 8  # the most asked-for shapes are decided ahead, no more


class Prefiller:
    def __init__(
        self,
        ledger: Ledger,
        policy: Policy,
        last_call: Callable[[], float],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`last_call`: `clock()` of the last filter or prioritize call (the judge's)."""
        self.ledger = ledger
        self.policy = policy
        self.last_call = last_call
        self.clock = clock

    def shapes(self) -> list[NeuronRequest]:
        """The shapes asked for most lately (core.demand), most asked first."""
        weights = sorted(self.ledger.demand.weights, key=lambda shape: -shape[2])
        shapes = []
        for unit, count, _ in weights[:MAX_SHAPES]:
            try:
                shapes.append(NeuronRequest(UNIT_RESOURCE[unit], count))
            except RequestError:  # (demand only records requests that were valid)
                continue
        return shapes

    def turn(self) -> bool:
        """Decides up to CHUNK nodes for the first shape that has undecided ones; False when
        every shape is decided on every node."""
        nodes = self.ledger.nodes
        for request in self.shapes():
            decided = self.ledger.verdicts(request, self.policy).decisions
            if len(decided) >= len(nodes):
                continue
            missing = list(islice(nodes.keys() - decided.keys(), CHUNK))
            if missing:
                self.ledger.fill_verdicts(missing, request, self.policy)
                return True
        return False

    def idle_for(self) -> float:
        """Seconds to wait before a turn may be taken (0: now)."""
        return max(0.0, self.last_call() + IDLE - self.clock())

    async def run(self) -> None:
        while True:
            wait = self.idle_for()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            try:
                more = self.turn()
            except Exception:  # a bug must not end the loop; filter decides as before
                log.exception("deciding ahead failed; trying again in %.0fs", PERIOD)
                more = False
            await asyncio.sleep(0 if more else PERIOD)
