"""The placement admission check (issue 48, docs/kueue.md): the leader answers for Kueue's
AdmissionChecks whose controllerName is the extender's (kube.kueue.CONTROLLER_NAME). Kueue gives
quota, the check says whether the pods that quota pays for can be placed now.

Each step, as leader, once the watches have listed Kueue's objects and the extender's cache is
synced:
1. marks each of our AdmissionChecks Active (Kueue keeps a ClusterQueue that lists an inactive
   check inactive);
2. tends the workloads it made Ready: their holds end when all their pods have bound (done), when
   Kueue evicts, finishes or deletes them (at once, also while their pods are terminating), or when
   their pods have not all bound `hold_seconds` after the check made them Ready: then the check
   goes to Retry, saying so (Kueue evicts the workload and queues it again);
3. decides for each workload whose check is Pending and whose quota Kueue reserved
   (extender/state/admission.place): Ready, with its blocks held in the ledger and its training
   jobs' units claimed for it (held until its pods bind), and podSetUpdates that put the
   workload's uid on its pods (that is how they take what is held for them); else Retry, with the
   reason and a requeueAfterSeconds that grows with Kueue's retry count, so Kueue gives the quota
   to the next workload instead of holding it; Pending only while the check cannot decide yet (a
   flavor not listed yet).

A Ready workload the loop does not hold for (a new leader, a restart) is held for again while
within its time: its blocks planned anew when none of its pods has bound yet (its units' claims
are objects, and stay), else its pods' time only is tended.

Status writes are server-side applies of the check's own entry in status.admissionChecks (kube
client `apply_check_state`), conditioned on the Workload's uid and resourceVersion: Kueue's
fields and other checks' states are never touched, and a decision made on a Workload that has
changed since is dropped (the watch brings the new one, decided again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from datetime import UTC, datetime
from typing import Any, Protocol

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.logtext import NAME_LIMIT, loggable
from neuron_scheduler.extender.loops.reserving import Reservations
from neuron_scheduler.extender.loops.stepping import run_steps
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.admission import NotPlaced, Placed, place
from neuron_scheduler.extender.state.admitted import Admitted, AdmittedHolds, HeldBlock
from neuron_scheduler.extender.state.kueuepods import KueuePods
from neuron_scheduler.extender.state.ledger import HOLD_EXPIRED, Ledger
from neuron_scheduler.extender.state.workloads import KueueObjects
from neuron_scheduler.jobs.claims import BOUND
from neuron_scheduler.jobs.placement import Occupancy
from neuron_scheduler.kube.errors import READ_ERRORS, Conflict, NotFound
from neuron_scheduler.kube.kueue import (
    PENDING,
    READY,
    RETRY,
    WORKLOAD_UID_ANNOTATION,
    CheckState,
    Workload,
    condition,
    over,
    quota_reserved,
    workload_owner,
)
from neuron_scheduler.kube.reading import epoch

log = logging.getLogger("neuron_scheduler.extender.admitting")

TICK = 1.0  # seconds between steps when nothing changes (holds end by the clock)
COALESCE = 0.1  # a burst of workload and pod changes is one step
HOLD_SECONDS = 120.0  # how long an admitted workload's pods have to bind (the default)
RETRY_BASE = 5  # seconds Kueue waits before it tries a workload again, at its first retry
RETRY_MAX = 60  # and at most (a workload that can never run as the nodes are waits this long)
MAX_MESSAGE = 4096  # of a check state's message (Kueue allows 32 KiB)


class CheckWriter(Protocol):
    """What the loop needs of KubeAPI."""

    async def apply_check_state(
        self, namespace: str, name: str, uid: str, resource_version: str, state: dict[str, Any]
    ) -> None: ...

    async def apply_check_condition(self, name: str, condition: dict[str, Any]) -> None: ...


def stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def requeue_seconds(retries: int | None, never: bool) -> int:
    """How long Kueue waits before it reserves quota for the workload again: doubling with its
    retries from RETRY_BASE, at most RETRY_MAX (at once for one that can never run now)."""
    if never:
        return RETRY_MAX
    return int(min(RETRY_MAX, RETRY_BASE * 2 ** min(max(retries or 0, 0), 8)))


class Admissions:
    def __init__(
        self,
        api: CheckWriter,
        objects: KueueObjects,
        holds: AdmittedHolds,
        ledger: Ledger,
        occupancy: Occupancy,
        reservations: Reservations,
        scheduler_names: Collection[str],
        *,
        hold_seconds: float = HOLD_SECONDS,
        policy: Policy = Policy.BEST_FIT,
        is_leader: Callable[[], bool] = lambda: True,
        wall_clock: Callable[[], float] = time.time,
        metrics: Metrics | None = None,
        pods: KueuePods | None = None,
    ) -> None:
        """`pods`: the labels and annotations of the pods Kueue's pod integration manages
        (their Workloads' templates carry none)."""
        self.api = api
        self.pods = pods if pods is not None else KueuePods()
        self.objects = objects
        self.holds = holds
        self.ledger = ledger
        self.occupancy = occupancy
        self.reservations = reservations
        self.scheduler_names = frozenset(scheduler_names)
        self.hold_seconds = max(1, int(hold_seconds))
        self.policy = policy
        self.is_leader = is_leader
        self.wall_clock = wall_clock
        self.metrics = metrics
        self.ready = asyncio.Event()  # set once Kueue's objects are listed and the cache synced
        self._signal = asyncio.Event()
        # Ready workloads whose holds ended (their pods all came, or their time ran out): not held
        # for again while the check stays Ready.
        self._settled: set[str] = set()
        self._active: set[str] = set()  # checks this leader marked Active
        self._said: dict[str, str] = {}  # workload uid -> the last answer logged

    def changed(self) -> None:
        self._signal.set()

    async def run(self) -> None:
        await self.ready.wait()
        await run_steps(self._coalesced_step, self._signal, TICK, "placement check", log)

    async def _coalesced_step(self) -> None:
        await asyncio.sleep(COALESCE)
        self._signal.clear()
        await self.step()

    async def step(self) -> None:
        if not self.is_leader():
            self._active.clear()  # a later leadership marks them again
            return
        await self._activate()
        await self._tend()
        await self._decide()

    # --- our AdmissionChecks -----------------------------------------------------------------

    async def _activate(self) -> None:
        for name, check in list(self.objects.checks.items()):
            active = condition(check.status.conditions, "Active")
            if name in self._active and active is not None and active.status == "True":
                continue
            if active is not None and active.status == "True":
                self._active.add(name)
                continue
            try:
                await self.api.apply_check_condition(
                    name,
                    {
                        "type": "Active",
                        "status": "True",
                        "reason": "Active",
                        "message": "neuron-scheduler's extender places the pods of workloads "
                        "this check admits",
                        "lastTransitionTime": stamp(self.wall_clock()),
                    },
                )
            except READ_ERRORS as error:
                log.warning("cannot mark AdmissionCheck %s Active: %s", name, loggable(error))
                continue
            self._active.add(name)
            log.info("AdmissionCheck %s is Active: this extender answers for it", loggable(name))

    # --- workloads it made Ready ---------------------------------------------------------------

    async def _tend(self) -> None:
        now = self.wall_clock()
        for uid, admitted in list(self.holds.admitted.items()):
            workload = self.objects.workloads.get(uid)
            state = self.objects.ours(workload) if workload is not None else None
            why = "deleted" if workload is None else over(workload)
            if why is None and (state is None or state.state != READY):
                why = f"its check was set to {state.state if state else 'nothing'}"
            if why is not None:
                await self._let_go(admitted, f"the workload is {why}" if workload else why)
                self._count("released")
                continue
            assert workload is not None and state is not None
            came = self.holds.came(admitted.owner)
            if came >= admitted.pods and self._jobs_bound(admitted):
                self.holds.release(uid)
                self._settled.add(uid)
                log.info(
                    "Kueue workload %s: its %d pods are bound; nothing held for it any more",
                    loggable(admitted.key, NAME_LIMIT),
                    admitted.pods,
                )
                continue
            if now < admitted.until:
                continue
            message = (
                f"its pods did not all bind within {self.hold_seconds}s of its admission "
                f"({came} of {admitted.pods} bound): the devices held for them are let go"
            )
            await self._let_go(admitted, message, HOLD_EXPIRED)
            self._settled.add(uid)
            self._count("expired")
            await self._write(
                workload, state, RETRY, message, requeue_seconds(state.retryCount, False)
            )

    def _jobs_bound(self, admitted: Admitted) -> bool:
        """Whether every training job it claimed units for has its members bound (its claim
        Bound, or gone with its members)."""
        for job in admitted.jobs:
            claims = [self.occupancy.claims[n] for n in self.occupancy.claimed(job)]
            if any(c.phase != BOUND for c in claims):
                return False
        return True

    async def _let_go(self, admitted: Admitted, why: str, cause: str = "") -> None:
        """Ends what is held for the workload: its blocks, its jobs' claims made for it."""
        if cause:
            self.holds.release(admitted.uid, cause)
        else:
            self.holds.release(admitted.uid)
        for job in admitted.jobs:
            await self.reservations.release_workload(job, admitted.uid, why)
        log.info("Kueue workload %s: holds let go: %s", loggable(admitted.key, NAME_LIMIT), why)

    # --- deciding -----------------------------------------------------------------------------

    async def _decide(self) -> None:
        workloads = self.objects.workloads
        for uid in [u for u in self._settled if u not in workloads]:
            self._settled.discard(uid)
        for uid in [u for u in self._said if u not in workloads]:
            del self._said[uid]
        for count, workload in enumerate(list(workloads.values())):
            if count:
                await asyncio.sleep(0)  # filter and bind are answered in between
            uid = workload.metadata.uid
            state = self.objects.ours(workload)
            if state is None or uid in self.holds.admitted:
                continue
            if state.state != READY:
                self._settled.discard(uid)
            if over(workload) is not None or not quota_reserved(workload):
                continue
            if state.state == PENDING:
                await self._check(workload, state)
            elif state.state == READY and uid not in self._settled:
                await self._resume(workload, state)

    def _place(self, workload: Workload) -> Placed | NotPlaced:
        flavors = {
            name: (f.spec.nodeLabels, list(f.spec.tolerations))
            for name, f in self.objects.flavors.items()
        }
        return place(
            workload,
            flavors,
            self.ledger,
            self.occupancy,
            self.policy,
            self.scheduler_names,
            self.pods.get,
        )

    async def _check(self, workload: Workload, state: CheckState) -> None:
        answer = self._place(workload)
        if isinstance(answer, NotPlaced):
            self._say(workload, answer.reason)
            if answer.wait:
                await self._write(workload, state, PENDING, answer.reason)
                self._count("pending")
                return
            requeue = requeue_seconds(state.retryCount, answer.never)
            if await self._write(workload, state, RETRY, answer.reason, requeue):
                self._count("retry")
            return
        admitted = await self._hold(workload, answer, self.wall_clock() + self.hold_seconds)
        if admitted is None:
            return  # a claim could not be written: decided again next step
        message = (
            f"placed now: {answer.text}; held until its pods bind (at most {self.hold_seconds}s)"
        )
        updates = [
            {"name": p.name, "annotations": {WORKLOAD_UID_ANNOTATION: workload.metadata.uid}}
            for p in workload.spec.podSets
        ]
        if not await self._write(workload, state, READY, message, updates=updates):
            await self._let_go(admitted, "its Ready could not be written; decided again")
            return
        self._say(workload, message)
        self._count("ready")

    async def _hold(self, workload: Workload, answer: Placed, until: float) -> Admitted | None:
        """Holds the answer's blocks and claims its jobs' units for the workload."""
        meta = workload.metadata
        blocks = [HeldBlock(b.node, b.request, b.cores) for b in answer.blocks]
        jobs = tuple(j.job for j in answer.jobs)
        admitted = self.holds.hold(
            meta.uid, workload.key, meta.namespace, blocks, _pods(workload), until, jobs
        )
        for job in answer.jobs:
            ok = await self.reservations.claim_for_workload(
                job.job, job.scheduler, job.size, job.planned, meta.uid, self.hold_seconds
            )
            if not ok:
                await self._let_go(admitted, "its units were claimed meanwhile")
                return None
        return admitted

    async def _resume(self, workload: Workload, state: CheckState) -> None:
        """A Ready workload this leader holds nothing for (a restart, a new leader): held for
        again while within its time."""
        meta = workload.metadata
        until = epoch(state.lastTransitionTime) + self.hold_seconds
        owner = workload_owner(meta.namespace, meta.uid)
        came, pods = self.holds.came(owner), _pods(workload)
        jobs = tuple(
            sorted({c.job for c in self.occupancy.claims.values() if c.workload == meta.uid})
        )
        if came >= pods:
            self._settled.add(meta.uid)
            return
        if came == 0 and self.wall_clock() < until:
            answer = self._place(workload)
            if isinstance(answer, Placed):
                admitted = await self._hold(workload, answer, until)
                if admitted is not None:
                    log.info(
                        "Kueue workload %s: Ready before this leader; held for again: %s",
                        loggable(workload.key, NAME_LIMIT),
                        answer.text,
                    )
                    return
        # Its pods' time only: they take what they find.
        self.holds.hold(meta.uid, workload.key, meta.namespace, [], pods, until, jobs)

    # --- writing -------------------------------------------------------------------------------

    async def _write(
        self,
        workload: Workload,
        state: CheckState,
        new: str,
        message: str,
        requeue: int | None = None,
        updates: list[dict[str, Any]] | None = None,
    ) -> bool:
        """The check's state, as a server-side apply of its entry conditioned on what was read;
        whether it was written (or already so)."""
        message = message[:MAX_MESSAGE]
        if state.state == new and state.message == message and new != READY:
            return True
        meta = workload.metadata
        same = state.state == new and state.lastTransitionTime
        entry: dict[str, Any] = {
            "name": state.name,
            "state": new,
            "message": message,
            "lastTransitionTime": state.lastTransitionTime if same else stamp(self.wall_clock()),
            "podSetUpdates": updates or [],
        }
        if requeue is not None:
            entry["requeueAfterSeconds"] = requeue
        try:
            await self.api.apply_check_state(
                meta.namespace, meta.name, meta.uid, meta.resourceVersion, entry
            )
        except (Conflict, NotFound):
            return False  # changed (or gone) since it was read: the watch brings what it is now
        except READ_ERRORS as error:
            log.warning(
                "cannot write the check of Kueue workload %s: %s",
                loggable(workload.key, NAME_LIMIT),
                loggable(error),
            )
            return False
        return True

    def _say(self, workload: Workload, text: str) -> None:
        uid = workload.metadata.uid
        if self._said.get(uid) == text:
            return
        self._said[uid] = text
        log.info("Kueue workload %s: %s", loggable(workload.key, NAME_LIMIT), loggable(text))

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.kueue_checks.labels(outcome).inc()


def _pods(workload: Workload) -> int:
    """The pods its admission makes (each pod set's admitted count)."""
    admission = workload.status.admission
    counts = {a.name: a.count for a in admission.podSetAssignments} if admission else {}
    total = 0
    for pod_set in workload.spec.podSets:
        count = counts.get(pod_set.name)
        total += pod_set.count if count is None else count
    return total
