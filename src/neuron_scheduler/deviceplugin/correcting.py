"""Keeping the pods' annotations true to what kubelet handed out: a pass reads kubelet's pod
resources and this node's pods, and rewrites the annotations that disagree (`reconciling`).

A pass runs `settle` seconds after the last Allocate (kubelet records an allocation as soon as the
plugin answers, and allocates a pod's containers back to back) and every `interval` seconds, for
what a pass missed (an API error, a conflict, a restarted kubelet). A pass that overlaps an
Allocate is dropped: it may have read half of an admission. When kubelet's answer is the one a
pass already found in agreement, the API server is not asked again. Each correction is a merge
patch of our keys only, on the resourceVersion the pass read, and an event on the pod says what
changed and why (`reconciling`; the Assigner's `withheld` says which containers kubelet did not
offer their ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.deviceplugin.admission import Withheld
from neuron_scheduler.deviceplugin.holdings import HoldingsError, HoldingsReader, KubeletHoldings
from neuron_scheduler.deviceplugin.pods import NodePods
from neuron_scheduler.deviceplugin.reconciling import CORRECTED, Correction, Review, review
from neuron_scheduler.kube.errors import API_ERRORS, Conflict, NotFound

log = logging.getLogger(__name__)

_READ_ERRORS: tuple[type[BaseException], ...] = (HoldingsError, *API_ERRORS)


class Corrector:
    def __init__(
        self,
        pods: NodePods,
        holdings: HoldingsReader,
        node: str,
        topology: Callable[[], Awaitable[Topology]],
        *,
        settle: float = 1.0,
        interval: float = 30.0,
        withheld: Mapping[tuple[str, str], Withheld] | None = None,
        unhealthy: Callable[[], int] = lambda: 0,
    ) -> None:
        self.pods = pods
        self.holdings = holdings
        self.node = node
        self.topology = topology
        self.settle = settle
        self.interval = interval
        self.withheld = withheld if withheld is not None else {}
        self.unhealthy = unhealthy  # the devices (mask) the plugin reports failed now
        self.corrected = 0  # corrections applied since start
        self._allocations = 0  # Allocate calls begun or ended: a pass must see it unchanged
        self._due = time.monotonic() + settle
        self._wake = asyncio.Event()
        self._said: set[str] = set()  # problems of the last pass, each logged once
        self._settled: tuple[KubeletHoldings, Review] | None = None  # the last full agreement

    def allocating(self) -> None:
        """Called by the Assigner when an Allocate begins and when it ends."""
        self._allocations += 1
        self._due = time.monotonic() + self.settle
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            delay = self._due - time.monotonic()
            if delay > 0:
                self._wake.clear()
                waiters = [asyncio.ensure_future(e.wait()) for e in (stop, self._wake)]
                try:
                    await asyncio.wait(waiters, timeout=delay, return_when="FIRST_COMPLETED")
                finally:
                    for waiter in waiters:
                        waiter.cancel()
                continue
            self._due = time.monotonic() + self.interval
            try:
                await self.reconcile()
            except Exception:  # a pass must never end the plugin; the next one tries again
                log.exception("reconciling annotations with kubelet's pod resources failed")

    async def reconcile(self) -> Review | None:
        """One pass; None when it was dropped or could not read what it needs."""
        before = self._allocations
        try:
            held = await self.holdings.read()
            if self._settled is not None and self._settled[0] == held:
                return self._settled[1]
            pods = await self.pods.list_pods()
            topology = await self.topology()
        except _READ_ERRORS as error:
            self._tell([f"cannot compare annotations with kubelet's pod resources: {error}"])
            return None
        if self._allocations != before:
            log.debug("kubelet allocated during the pass; comparing again once it settles")
            return None
        found = review(pods, held, self.node, topology, self.withheld, self.unhealthy())
        problems = [f"left alone: {problem}" for problem in (*held.skipped, *found.problems)]
        self._tell(problems)
        for correction in found.corrections:
            await self._apply(correction)
        agreed = not problems and not found.corrections and not found.unstarted
        self._settled = (held, found) if agreed else None
        return found

    def _tell(self, problems: list[str]) -> None:
        # A trouble that persists from pass to pass is said once, then at debug level.
        for text in problems:
            if text in self._said:
                log.debug("%s", loggable(text))
            else:
                log.warning("%s", loggable(text))
        self._said = set(problems)

    async def _apply(self, correction: Correction) -> bool:
        """Whether the pod's annotations were rewritten."""
        pod = correction.pod
        try:
            await self.pods.patch_annotations(pod, correction.values, resource_version=True)
        except Conflict:
            # Changed since this pass read it (or recreated): read again after the next settle.
            log.info("%s changed while being corrected; comparing again", loggable(pod.key))
            self._due = min(self._due, time.monotonic() + self.settle)
            return False
        except NotFound:
            return False
        except API_ERRORS as error:
            log.warning(
                "could not correct %s (%s); retrying later", loggable(pod.key), loggable(error)
            )
            return False
        self.corrected += 1
        log.warning("corrected %s: %s", loggable(pod.key), loggable(correction.message))
        with contextlib.suppress(*API_ERRORS):
            await self.pods.record_event(pod, CORRECTED, correction.message)
        return True
