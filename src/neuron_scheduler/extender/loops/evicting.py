"""Evicting the victims of a training job's preemption (issue 40), as kube-scheduler evicts its
own: the `DisruptionTarget` condition with reason `PreemptionByScheduler` on the pod (a Job's
podFailurePolicy, and other controllers, tell a preemption from a failure by it), then a graceful
delete of exactly that pod (its uid as precondition), then a `Preempted` event on it.

Not the Eviction API: a PodDisruptionBudget could refuse one member of a job and let the others
go, and a victim job goes whole or not at all. kube-scheduler's preemption does the same (it
prefers victims that violate no budget, then deletes).

Idempotent: a victim already leaving or gone is skipped, and so is one this helper deleted before
(the watch may show it leaving only after the next step: without this it would be marked and
deleted again, with a second `Preempted` event), so the reservation loop calls it again for a
claim's victims on every step until they are gone (a restart in between finishes the job).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.kube.errors import (
    READ_ERRORS,
    ApiError,
    Conflict,
    NotFound,
    TooManyRequests,
)
from neuron_scheduler.kube.events import Report
from neuron_scheduler.kube.objects import ObjectRef

log = logging.getLogger("neuron_scheduler.extender.reserving")
MAX_REMEMBERED = 10_000
DRY_RUNS_AT_ONCE = 8
REFUSAL_SECONDS = 5.0  # a refused deletion is believed that long without asking again


class PodEvicter(Protocol):
    """What evictions need of KubeAPI."""

    async def mark_preempted(self, namespace: str, name: str, uid: str, message: str) -> None: ...

    async def delete_pod(
        self, namespace: str, name: str, uid: str, *, dry_run: bool = False
    ) -> None: ...


class Evictions:
    def __init__(
        self,
        api: PodEvicter,
        ledger: Ledger,
        report: Report | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.ledger = ledger
        self.report = report
        self.clock = clock
        self._refused: dict[str, tuple[float, str]] = {}  # uid -> (believed until, why)
        self._failed: set[str] = set()  # uids whose eviction failed and was logged
        self._deleted: dict[str, None] = {}  # uids deleted, oldest first (at most MAX_REMEMBERED)
        self._spared: set[str] = set()  # uids not evicted for their priority, logged

    def leaving(self, uids: Iterable[str]) -> list[str]:
        """Those still holding devices (bound, not finished), leaving or not."""
        return [uid for uid in uids if self.ledger.holding(uid) is not None]

    def begun(self, uids: Iterable[str]) -> bool:
        """Whether any of `uids` is leaving or was deleted by this helper: their eviction is
        under way. (One that is gone may have finished on its own, or never been there: a
        claim lists what its writer chose.)"""
        for uid in uids:
            holding = self.ledger.holding(uid)
            if uid in self._deleted or (holding is not None and holding.terminating):
                return True
        return False

    async def refusals(self, uids: Iterable[str]) -> list[str]:
        """Those of `uids` still there whose deletion the API server refuses now, each as
        "namespace/name: why", by a dry run of it (an admission policy or webhook, or a missing
        permission). Evicting whole jobs, one refusal found only after the others went would
        leave a job partly evicted; an error that may pass (the server unreachable, 5xx,
        throttled) refuses nothing: the eviction tries again each step. A refusal is believed
        for REFUSAL_SECONDS without asking again: kube-scheduler asks about every member of a
        job, and each ask would otherwise dry-run every victim again."""
        now = self.clock()
        for uid, (until, _) in list(self._refused.items()):
            if until <= now:
                del self._refused[uid]
        asked = []
        for uid in uids:
            holding = self.ledger.holding(uid)
            if holding is None or holding.terminating or uid in self._deleted:
                continue
            if uid in self._refused:
                return [self._refused[uid][1]]  # still refused: nothing to ask
            namespace, _, name = self.ledger.pod_key(uid).partition("/")
            if name:
                asked.append((uid, namespace, name))
        gate = asyncio.Semaphore(DRY_RUNS_AT_ONCE)

        async def refusal(uid: str, namespace: str, name: str) -> str | None:
            async with gate:
                try:
                    await self.api.delete_pod(namespace, name, uid, dry_run=True)
                except (NotFound, Conflict):
                    return None  # gone meanwhile, or another pod of that name
                except ApiError as error:
                    if 400 <= error.status < 500 and not isinstance(error, TooManyRequests):
                        return f"{namespace}/{name}: {str(error)[:300]}"
                    return None
                except READ_ERRORS:
                    return None
                return None

        # At once (a few at a time): the plan waits for them, and the world moves meanwhile.
        answers = await asyncio.gather(*(refusal(*each) for each in asked))
        found = []
        for (uid, _, _), text in zip(asked, answers, strict=True):
            if text is not None:
                if len(self._refused) >= MAX_REMEMBERED:
                    self._refused.clear()
                self._refused[uid] = (now + REFUSAL_SECONDS, text)
                found.append(text)
        return found

    async def evict(self, uids: Iterable[str], message: str, below: int) -> int:
        """Evicts those of `uids` still there and not leaving already, of a priority below
        `below` (the preemptor's); how many it evicted."""
        evicted = 0
        for uid in uids:
            holding = self.ledger.holding(uid)
            if holding is None or holding.terminating or uid in self._deleted:
                continue  # gone, or going (perhaps not shown by the watch yet)
            namespace, _, name = self.ledger.pod_key(uid).partition("/")
            if not name:
                continue
            if holding.priority >= below:
                if _first_time(self._spared, uid):  # once: every step sees it again
                    log.warning(
                        "not evicting %s/%s: its priority %d is not below the preemptor's %d",
                        loggable(namespace),
                        loggable(name),
                        holding.priority,
                        below,
                    )
                continue
            try:
                await self.api.mark_preempted(namespace, name, uid, message)
                await self.api.delete_pod(namespace, name, uid)
            except NotFound:
                self._remember(uid)
                continue  # gone meanwhile
            except Conflict:
                continue  # another pod of that name now: not ours to evict
            except READ_ERRORS as error:
                if _first_time(self._failed, uid):  # once: every step tries again
                    log.warning(
                        "cannot evict %s/%s (each step tries again): %s",
                        loggable(namespace),
                        loggable(name),
                        loggable(error),
                    )
                continue
            self._failed.discard(uid)
            self._remember(uid)
            evicted += 1
            if self.report is not None:
                self.report(ObjectRef("Pod", namespace, name, uid), "Preempted", message, False)
        return evicted

    def _remember(self, uid: str) -> None:
        if len(self._deleted) >= MAX_REMEMBERED:
            del self._deleted[next(iter(self._deleted))]
        self._deleted[uid] = None


def _first_time(seen: set[str], uid: str) -> bool:
    """Whether `uid` is new to `seen` (which it is added to; at most MAX_REMEMBERED)."""
    if uid in seen:
        return False
    if len(seen) >= MAX_REMEMBERED:
        seen.clear()
    seen.add(uid)
    return True
