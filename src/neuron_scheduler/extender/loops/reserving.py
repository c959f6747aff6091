"""The reservation loop: UltraServer claims for training jobs, all or nothing. The leader's only
writer of claims (one UltraServerClaim per node, ultraserver/claims.py says why).

Each step, as leader, once the watches have listed pods, nodes and claims:
1. ends what should end: the claims of a job that is gone (no member left) and of a job that
   did nothing for `claim_seconds` while Pending (kube-scheduler asked about none of its
   members), and the part
   of a claim a crash left half written when it can no longer be completed; marks Bound a claim
   whose members are all bound; renews a Pending claim its job is still working on;
2. plans, highest priority first and then oldest, for each job with members waiting and no
   complete claim (`ultraserver.placement.plan`): either the nodes of every unit its members
   need, claimed at once, or the reason its members are refused with until they fit.

A claim is written node by node; until every node is written it admits nobody, and a conflict
(another writer holds a node) deletes what this attempt wrote. The waker hears of each claim
made and ended (`Occupancy.hold` / `release`), so the job's members, and the next job's, are
retried at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Collection
from typing import Protocol

from neuron_scheduler.core.allocation import Placement, Policy, allocate
from neuron_scheduler.core.logtext import NAME_LIMIT, loggable
from neuron_scheduler.core.resources import RequestError
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.kube.errors import READ_ERRORS, Conflict, NotFound, error_text
from neuron_scheduler.kube.nodefit import placement_kind, why_not
from neuron_scheduler.kube.objects import Pod, UltraServerClaim
from neuron_scheduler.kube.reading import neuron_request
from neuron_scheduler.ultraserver.claims import (
    BOUND,
    PENDING,
    ClaimError,
    NodeClaim,
    from_object,
    to_object,
)
from neuron_scheduler.ultraserver.jobs import JobKey
from neuron_scheduler.ultraserver.placement import (
    Occupancy,
    Pending,
    Shortfall,
    UnitKey,
    UnitPlacement,
    job_text,
    openings,
    plan,
    shortfall,
)

log = logging.getLogger("neuron_scheduler.extender.reserving")

TICK = 1.0  # seconds between steps when nothing changes (claims end by the clock)
# A burst of changes (members binding, filter asking) is one step: plans cost a scan of the
# UltraServers per waiting job (16 ms for 20 jobs on 100 UltraServers, tests/unit/test_reserving).
COALESCE = 0.1
CLAIM_WRITE_ERRORS: tuple[type[BaseException], ...] = (Conflict, *READ_ERRORS, ClaimError)


class ClaimWriter(Protocol):
    """What the loop needs of KubeAPI."""

    async def create_claim(self, claim: UltraServerClaim) -> UltraServerClaim: ...

    async def replace_claim(self, claim: UltraServerClaim) -> UltraServerClaim: ...

    async def delete_claim(self, name: str, uid: str, resource_version: str) -> None: ...


def member_unusable(ledger: Ledger, pod: Pod, policy: Policy, node: str) -> str | None:
    """Why this member cannot run on the node now (its spec keeps it off, or its devices do
    not fit there), or None."""
    entry = ledger.nodes.get(node)
    if entry is None:
        return "not a usable Neuron node"
    facts = ledger.facts.get(node)
    excluded = why_not(pod, facts) if facts is not None else None
    if excluded is not None:
        return excluded
    try:
        request = neuron_request(pod)
    except RequestError as error:
        return str(error)
    if request is None:
        return None
    state = ledger.state_for(Claimant.of(pod, request), node)
    decision = allocate(entry.topology, state, request, policy)
    if isinstance(decision, Placement):
        return None
    return ledger.failed_devices_refusal(node, request, decision).reason


class Reservations:
    def __init__(
        self,
        api: ClaimWriter,
        occupancy: Occupancy,
        units: UnitPlacement,
        ledger: Ledger,
        scheduler_names: Collection[str],
        claim_seconds: float,
        *,
        policy: Policy = Policy.BEST_FIT,
        is_leader: Callable[[], bool] = lambda: True,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`units`: the filter, whose `asked` says which jobs kube-scheduler is working on (by
        `clock`)."""
        self.api = api
        self.occupancy = occupancy
        self.units = units
        self.ledger = ledger
        self.scheduler_names = frozenset(scheduler_names)
        self.claim_seconds = max(1, int(claim_seconds))
        self.policy = policy
        self.is_leader = is_leader
        self.wall_clock = wall_clock
        self.clock = clock
        self.ready = asyncio.Event()  # set once pods, nodes and claims are listed
        self._signal = asyncio.Event()
        self._said: dict[JobKey, str] = {}  # the shortfall last logged per job
        # Jobs whose claim ended because they did nothing (by `clock`): not planned for again
        # until kube-scheduler asks about one of their members after that.
        self._idle: dict[JobKey, float] = {}

    def changed(self) -> None:
        self._signal.set()

    async def run(self) -> None:
        await self.ready.wait()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._signal.wait(), TICK)
            await asyncio.sleep(COALESCE)
            self._signal.clear()
            try:
                await self.step()
            except Exception:  # a bug must not end the loop: claims would never end
                log.exception("reservation step failed; trying again in %.0fs", TICK)
                await asyncio.sleep(TICK)

    async def step(self) -> None:
        """One round (nothing unless this replica is the leader)."""
        if not self.is_leader() or self.occupancy.unavailable:
            return
        await self._tend()
        await self._plan()

    # --- claims that exist -------------------------------------------------------------------

    async def _tend(self) -> None:
        now = self.wall_clock()
        by_job: dict[JobKey, list[NodeClaim]] = {}
        for claim in self.occupancy.claims.values():
            if claim.scheduler in self.scheduler_names:  # others' are their extenders' to tend
                by_job.setdefault(claim.job, []).append(claim)
        jobs = self.occupancy.jobs()
        for job in [j for j in self._idle if j not in jobs]:
            del self._idle[job]  # gone
        for job, claims in by_job.items():
            waiting = jobs.get(job, [])
            workers = self.occupancy.job_workers(job)
            if not waiting and not workers:
                await self._release(job, claims, "its job has no member left")
                continue
            if any(c.expired(now) for c in claims):
                if self._asked_within(job, self.claim_seconds):
                    await self._rewrite(claims, PENDING)
                else:
                    self._idle[job] = self.clock()
                    await self._release(
                        job,
                        claims,
                        f"none of its members was scheduled for {self.claim_seconds}s",
                    )
                continue
            claimed = {c.node for c in claims}
            size = self.occupancy.claimed_size(job)
            if self.occupancy.complete(job) and sum(w.node in claimed for w in workers) >= size:
                if any(c.phase == PENDING for c in claims):
                    await self._rewrite(claims, BOUND)
                    log.info(
                        "the claim of job %s is Bound: its %d members run on %s",
                        loggable(job_text(job), NAME_LIMIT),
                        size,
                        ", ".join(sorted(claimed)),
                    )
                continue
            pending = [c for c in claims if c.phase == PENDING]
            stale = [c for c in pending if c.renewed + c.seconds / 3 <= now]
            if stale and self._asked_within(job, self.claim_seconds):
                await self._rewrite(stale, PENDING)

    def _asked_within(self, job: JobKey, seconds: float) -> bool:
        asked = self.units.asked.get(job)
        return asked is not None and self.clock() - asked < seconds

    async def _rewrite(self, claims: list[NodeClaim], phase: str) -> None:
        """The claims again, in `phase`, renewed now (each conditioned on what we read)."""
        now = self.wall_clock()
        for claim in claims:
            fresh = NodeClaim(
                claim.node,
                claim.job,
                claim.config,
                claim.size,
                phase,
                now,
                claim.seconds,
                claim.scheduler,
                claim.version,
                claim.uid,
            )
            try:
                written = await self.api.replace_claim(to_object(fresh))
            except Conflict:
                continue  # changed since we read it: the watch brings the new one
            except READ_ERRORS as error:
                log.warning("cannot renew the claim on %s: %s", claim.node, loggable(error))
                continue
            self._hold(written)

    async def _release(self, job: JobKey, claims: list[NodeClaim], why: str) -> None:
        ended = []
        for claim in claims:
            try:
                await self.api.delete_claim(claim.node, claim.uid, claim.version)
            except NotFound:
                pass
            except Conflict:
                continue  # changed since we read it (renewed by another writer): not ours to end
            except READ_ERRORS as error:
                log.warning("cannot end the claim on %s: %s", claim.node, loggable(error))
                continue
            self.occupancy.release(claim.node, claim.uid)
            ended.append(claim.node)
        if ended:
            log.info(
                "ended the claim of job %s on %s: %s",
                loggable(job_text(job), NAME_LIMIT),
                ", ".join(sorted(ended)),
                why,
            )

    def _hold(self, written: UltraServerClaim) -> None:
        try:
            self.occupancy.hold(from_object(written))
        except ClaimError as error:  # the API server gave back what we wrote: should not be
            log.warning("a claim as written cannot be read back: %s", loggable(error))

    # --- jobs waiting for a claim ------------------------------------------------------------

    async def _plan(self) -> None:
        """Claims for the jobs waiting, highest priority then oldest. A job with no member and
        no claim yet (nearly every one) takes from the units open to any such job, worked out
        once per kind of member (`openings`): a step costs one scan of the UltraServers per
        kind, not one per job."""
        jobs = self.occupancy.jobs()
        for job in [j for j in self.occupancy.shortfalls if j not in jobs]:
            del self.occupancy.shortfalls[job]  # gone, or all its members bound
        for job in [j for j in self._said if j not in jobs]:
            del self._said[job]
        order = sorted(
            jobs.items(),
            key=lambda item: (
                -(item[1][0].pod.spec.priority or 0),
                item[1][0].pod.metadata.creationTimestamp or "",
                item[0],
            ),
        )
        opened: dict[tuple[int, bytes], list[UnitKey]] = {}  # what new jobs of a kind may take
        usable: dict[tuple[str, bytes], str | None] = {}
        for count, (job, waiting) in enumerate(order):
            if count % 64 == 63:
                await asyncio.sleep(0)  # filter and bind are answered in between
            first = waiting[0]
            if first.pod.spec.schedulerName not in self.scheduler_names or self._idle_now(job):
                continue
            size = self.occupancy.size(first.member, job)
            if self.occupancy.complete(job) and size <= self.occupancy.claimed_size(job):
                continue
            kind = placement_kind(first.pod)

            def fits(node: str, first: Pending = first, kind: bytes = kind) -> str | None:
                key = (node, kind)
                if key not in usable:
                    usable[key] = member_unusable(self.ledger, first.pod, self.policy, node)
                return usable[key]

            own = bool(self.occupancy.by_job.get(job)) or any(
                w.job == job for w in self.occupancy.workers.values()
            )
            if own:
                chosen = plan(self.occupancy, job, first.config, size, fits)
            else:
                units = opened.get((first.config, kind))
                if units is None:
                    units = openings(self.occupancy, first.config, fits)
                    opened[(first.config, kind)] = units
                needed = math.ceil(size / first.config)
                chosen = (
                    sorted(n for unit in units[:needed] for n in self.occupancy.nodes_of(unit))
                    if len(units) >= needed
                    else shortfall(job, first.config, size, needed, len(units), False)
                )
            if isinstance(chosen, Shortfall):
                if own and self.occupancy.by_job.get(job) and not self.occupancy.complete(job):
                    # What a crash left half written, and cannot be completed now.
                    claimed = [self.occupancy.claims[n] for n in self.occupancy.claimed(job)]
                    await self._release(job, claimed, "its other nodes are no longer free")
                self.occupancy.shortfalls[job] = chosen.reason
                if self._said.get(job) != chosen.reason:
                    self._said[job] = chosen.reason
                    log.info("%s", loggable(chosen.reason))
                continue
            if chosen and await self._claim(job, first, size, chosen):
                opened.clear()  # those units are taken: what is open is worked out again

    def _idle_now(self, job: JobKey) -> bool:
        """Whether the job's claim ended unused and kube-scheduler has not asked since."""
        idle = self._idle.get(job)
        if idle is None:
            return False
        asked = self.units.asked.get(job)
        if asked is None or asked <= idle:
            return True
        del self._idle[job]
        return False

    async def _claim(self, job: JobKey, first: Pending, size: int, nodes: list[str]) -> bool:
        """Claims every node for the job (those it holds already are written again with its
        size now); on a conflict or an error, deletes what it wrote. Whether it claimed them."""
        now = self.wall_clock()
        config, scheduler = first.config, first.pod.spec.schedulerName
        written: list[NodeClaim] = []
        for node in nodes:
            known = self.occupancy.claims.get(node)
            if known is not None and known.job == job and known.size >= size:
                continue  # held already (what a crash left half written)
            claim = NodeClaim(node, job, config, size, PENDING, now, self.claim_seconds, scheduler)
            try:
                if known is not None and known.job == job:  # the job grew: its size anew
                    grown = dataclasses.replace(claim, version=known.version, uid=known.uid)
                    self._hold(await self.api.replace_claim(to_object(grown)))
                    continue  # (not undone: the node was the job's before this attempt)
                written.append(from_object(await self.api.create_claim(to_object(claim))))
            except CLAIM_WRITE_ERRORS as error:
                why = (
                    f"node {node} is claimed already (a claim this replica had not seen)"
                    if isinstance(error, Conflict)
                    else f"cannot write the claim on {node}: {error_text(error)}"
                )
                log.warning(
                    "reserving for job %s: %s; undoing this attempt",
                    loggable(job_text(job), NAME_LIMIT),
                    loggable(why),
                )
                await self._undo(written)
                return False
        for claim in written:
            self.occupancy.hold(claim)
        self._said.pop(job, None)
        log.info(
            "reserved %s for job %s (%d members, units of %d nodes)",
            ", ".join(nodes),
            loggable(job_text(job), NAME_LIMIT),
            size,
            config,
        )
        return True

    async def _undo(self, written: list[NodeClaim]) -> None:
        for claim in written:
            try:
                await self.api.delete_claim(claim.node, claim.uid, claim.version)
            except NotFound:
                pass
            except READ_ERRORS as error:
                # It stays until it ends by itself (Pending, its job does nothing with it).
                log.warning("cannot undo the claim on %s: %s", claim.node, loggable(error))
