"""Marks the bound pods an autoscaler's consolidation must not move (extender/state/protection):
the leader's loop. Off by default (`--autoscaler-do-not-disrupt`, chart
scheduler.autoscaling.doNotDisrupt); docs/autoscaling.md says why it exists and what it costs.

A pod first seen bound is judged at once (the loop is woken), every pod again each
`SWEEP_SECONDS`: marked (`karpenter.sh/do-not-disrupt: "true"`,
`cluster-autoscaler.kubernetes.io/safe-to-evict: "false"` and our `MARK`) while no other node it
may go to has a legal block for it, unmarked when one has. A key someone else set is left
alone (the other is still set). At most `WRITES_PER_STEP` patches a step (each a JSON merge patch
of those keys, the pod's uid as precondition). Turned off, the leader lifts its own marks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.logtext import NAME_LIMIT, loggable
from neuron_scheduler.extender.loops.movers import Admits, anywhere
from neuron_scheduler.extender.loops.stepping import run_steps
from neuron_scheduler.extender.loops.waking import AnnotationWriter
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.state.protection import (
    MARK,
    MARK_TEXT,
    MARKED,
    Bound,
    BoundPod,
    at_risk,
    mark_text,
)
from neuron_scheduler.kube.errors import READ_ERRORS, Conflict, NotFound, error_text

log = logging.getLogger("neuron_scheduler.extender.protecting")

STEP_SECONDS = 1.0  # new pods are judged within this long of the watch showing them bound
SWEEP_SECONDS = 30.0  # every pod is judged again this often
WRITES_PER_STEP = 20


class Protector:
    def __init__(
        self,
        ledger: Ledger,
        bound: Bound,
        api: AnnotationWriter,
        registry: CollectorRegistry,
        *,
        on: bool = False,
        policy: Policy = Policy.BEST_FIT,
        admits: Admits = anywhere,
        is_leader: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ledger = ledger
        self.bound = bound
        bound.on_new = self._new
        self.api = api
        self.on = on
        self.policy = policy
        self.admits = admits
        self.is_leader = is_leader
        self.clock = clock
        self._new_pods: set[str] = set()
        self._swept = -SWEEP_SECONDS
        self._signal = asyncio.Event()
        self.marks = Counter(
            "neuron_scheduler_do_not_disrupt_marks",
            "karpenter.sh/do-not-disrupt marks written on bound pods: set (no other node has "
            "a legal block for the pod), lifted (one has now), failed",
            ["action"],
            registry=registry,
        )
        self.marked = Gauge(
            "neuron_scheduler_do_not_disrupt_marked_pods",
            "Bound pods carrying our karpenter.sh/do-not-disrupt mark",
            registry=registry,
        )
        self.marked.set_function(lambda: sum(1 for p in self.bound.pods.values() if p.marked))

    def _new(self, uid: str) -> None:
        if self.on:
            self._new_pods.add(uid)
            self._signal.set()

    async def run(self) -> None:
        await run_steps(self.step, self._signal, STEP_SECONDS, "do-not-disrupt", log)

    async def step(self) -> None:
        if not self.is_leader():
            self._new_pods.clear()
            return
        now = self.clock()
        if now - self._swept >= SWEEP_SECONDS:
            self._swept = now
            judged = list(self.bound.pods.values())
        else:
            judged = [p for u in self._new_pods if (p := self.bound.pods.get(u)) is not None]
        self._new_pods.clear()
        writes = 0
        for pod in judged:
            if writes >= WRITES_PER_STEP:
                self._swept = -SWEEP_SECONDS  # the rest on the next step
                return
            if not pod.keys:  # someone else set both
                continue
            wanted = self.on and at_risk(self.ledger, pod, self.policy, self.admits)
            if wanted != pod.marked:
                writes += 1
                await self._write(pod, wanted)

    async def _write(self, pod: BoundPod, mark: bool) -> None:
        values: dict[str, str | None] = {key: MARKED[key] if mark else None for key in pod.keys}
        values[MARK] = mark_text(pod.keys) if mark else None
        try:
            await self.api.patch_annotations(pod.namespace, pod.name, pod.uid, values)
        except (NotFound, Conflict):
            return  # gone, or another pod now
        except READ_ERRORS as error:
            self.marks.labels("failed").inc()
            log.warning(
                "cannot %s the do-not-disrupt mark on %s: %s",
                "set" if mark else "lift",
                loggable(pod.key, NAME_LIMIT),
                loggable(error_text(error)),
            )
            return
        self.marks.labels("set" if mark else "lifted").inc()
        log.info(
            "%s the do-not-disrupt mark on %s (on %s): %s",
            "set" if mark else "lifted",
            loggable(pod.key, NAME_LIMIT),
            loggable(pod.node, NAME_LIMIT),
            MARK_TEXT if mark else "another node has a legal block for it now",
        )
