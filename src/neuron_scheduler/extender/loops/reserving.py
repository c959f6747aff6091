"""The reservation loop: claims for training jobs, all or nothing, on UltraServer units and nodes
of their own. The leader's only writer of claims (one object per node, jobs/claims.py says
why).

Each step, as leader, once the watches have listed pods, nodes and claims:
1. ends what should end: the claims of a job that is gone (no member left) and of a job that
   did nothing for `claim_seconds` while Pending (counted from the last time kube-scheduler asked
   about one of its members, or from the claim's making), and the part of a claim a crash left
   half written when it can no longer be completed; marks Bound a claim whose members are all
   bound; renews a Pending claim its job is still working on, or whose victims are still
   leaving (and evicts those of them a restart left behind);
2. plans, highest priority first and then oldest, for each job with members waiting and no
   complete claim (`jobs.placement.plan`): either the nodes of every unit its members need,
   close in the network, claimed at once, or, when kube-scheduler asked the preempt verb for one
   of its members, the units preemption frees (`jobs.preemption`: whole jobs of lower priority, or
   nothing), claimed at once with the victims listed on the claim and then evicted, or the
   reason its members are refused with until they fit (a job that can never run here is told so
   in a FailedScheduling event on its members: kube-scheduler itself says only that nodes are
   full when they are).

A claim is written node by node; until every node is written it admits nobody, and a conflict
(another writer holds a node) undoes what this attempt wrote (a node taken from a victim job is
given back). The waker hears of each claim made and ended (`Occupancy.hold` / `release`), so the
job's members, and the next job's, are retried at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Collection
from typing import Protocol

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.logtext import NAME_LIMIT, loggable
from neuron_scheduler.extender.loops.evicting import Evictions
from neuron_scheduler.extender.loops.stepping import run_steps
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.state.members import FitMemo, member_fit, preemption_for
from neuron_scheduler.jobs.claims import (
    BOUND,
    PENDING,
    ClaimError,
    NodeClaim,
    from_object,
    to_object,
)
from neuron_scheduler.jobs.members import JobKey
from neuron_scheduler.jobs.network import closeness_of
from neuron_scheduler.jobs.placement import (
    AtomsMemo,
    Occupancy,
    Pending,
    Planned,
    Shortfall,
    UnitPlacement,
    job_text,
    never_fits,
    plan,
)
from neuron_scheduler.jobs.preemption import Preemption, claim_victims, job_priority
from neuron_scheduler.kube.errors import READ_ERRORS, Conflict, NotFound, error_text
from neuron_scheduler.kube.events import Report
from neuron_scheduler.kube.kueue import kueue_managed
from neuron_scheduler.kube.objects import JobClaim, ObjectRef
from neuron_scheduler.kube.reading import epoch

log = logging.getLogger("neuron_scheduler.extender.reserving")

TICK = 1.0  # seconds between steps when nothing changes (claims end by the clock)
# A burst of changes (members binding, filter asking) is one step: plans cost a scan of the
# units per waiting job with members or a claim, and one per kind of member for the new jobs
# (tests/unit/test_reserving prints a step with 20 jobs on 100 UltraServers,
# tests/unit/test_training_jobs one with 50 jobs on 1,000 plain nodes).
COALESCE = 0.1
CLAIM_WRITE_ERRORS: tuple[type[BaseException], ...] = (Conflict, *READ_ERRORS, ClaimError)
NEVER_EVENTS = 64  # members of one job told, per reason, that it cannot run here (never, or now)
NEVER = "Never"  # a pod's preemptionPolicy that forbids preempting
DRY_RUN_ROUNDS = 3  # plans whose victims are asked before a preemption waits for the next ask


class ClaimWriter(Protocol):
    """What the loop needs of KubeAPI."""

    async def create_claim(self, claim: JobClaim) -> JobClaim: ...

    async def replace_claim(self, claim: JobClaim) -> JobClaim: ...

    async def delete_claim(self, name: str, uid: str, resource_version: str) -> None: ...

    async def mark_preempted(self, namespace: str, name: str, uid: str, message: str) -> None: ...

    async def delete_pod(
        self, namespace: str, name: str, uid: str, *, dry_run: bool = False
    ) -> None: ...


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
        report: Report | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """`units`: the filter, whose `asked` says which jobs kube-scheduler is working on (by
        `clock`); `report`: events on pods (victims, members of a job that can never run)."""
        self.api = api
        self.evictions = Evictions(api, ledger, report, clock)
        self.report = report
        self.metrics = metrics
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
        self._no_preemption: dict[JobKey, str] = {}  # why a job got none, as last logged
        # Jobs whose claim ended because they did nothing (by `clock`): not planned for again
        # until kube-scheduler asks about one of their members after that.
        self._idle: dict[JobKey, float] = {}

    def changed(self) -> None:
        self._signal.set()

    async def run(self) -> None:
        await self.ready.wait()
        await run_steps(self._coalesced_step, self._signal, TICK, "reservation", log)

    async def _coalesced_step(self) -> None:
        await asyncio.sleep(COALESCE)  # the rest of a burst of changes joins this step
        self._signal.clear()
        await self.step()

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
                if any(c.awaits_members(now) for c in claims):
                    continue  # claimed for an admitted Kueue workload: its members are to come
                await self._release(job, claims, "its job has no member left")
                continue
            # Its preemption goes on (a restart finishes the evictions), once its claim is whole:
            # half a claim (a crash while it was written) is `_plan`'s to complete or undo
            # first, and the victims are evicted then.
            complete = self.occupancy.complete(job)
            victims = self._victims_left(job, claims) if complete else []
            if victims:
                go_on = await self._still_deletable(job, claims, victims)
                if go_on is None:
                    continue  # ended: nobody was evicted
                if go_on:
                    await self._evict(job, victims)
            # The claim waits for its victims to go while their grace period lasts (a victim
            # that holds its devices after that, its node down, keeps it no longer: then it
            # ends by the usual rule, `claim_seconds` after the last ask or that wait).
            leaving = self._within_grace(victims, now)
            asked = self._asked_at(job)
            if any(c.expired(now) for c in claims):
                if leaving:
                    await self._rewrite(claims, PENDING, now)  # waiting for its victims to go
                elif (
                    asked is not None
                    and asked + self.claim_seconds > now
                    and asked > min(c.renewed for c in claims)
                ):
                    await self._rewrite(claims, PENDING, asked)
                else:
                    self._idle[job] = self.clock()
                    await self._release(job, claims, self._ended_why(victims))
                continue
            claimed = {c.node for c in claims}
            size = self.occupancy.claimed_size(job)
            if self.occupancy.complete(job) and sum(w.node in claimed for w in workers) >= size:
                if any(c.phase == PENDING for c in claims):
                    await self._rewrite(claims, BOUND, now)
                    log.info(
                        "the claim of job %s is Bound: its %d members run on %s",
                        loggable(job_text(job), NAME_LIMIT),
                        size,
                        ", ".join(sorted(claimed)),
                    )
                continue
            # Renewed to the last time kube-scheduler asked about a member, so a claim ends
            # `claim_seconds` after that, not after the last renewal.
            pending = [c for c in claims if c.phase == PENDING]
            renewed_to = now if leaving else asked
            stale = [
                c
                for c in pending
                if renewed_to is not None and renewed_to - c.renewed >= c.seconds / 3
            ]
            if stale and renewed_to is not None:
                await self._rewrite(stale, PENDING, renewed_to)

    async def _still_deletable(
        self, job: JobKey, claims: list[NodeClaim], victims: list[str]
    ) -> bool | None:
        """Whether the claim's evictions go on this step (None: the claim ended instead). A claim
        can be whole with none of its victims evicted: a crash between the claim and the
        evictions, or an attempt whose undo could not be written after a late victim's
        deletion was refused. So the victims `_evict` would evict are asked as a dry run first,
        as `_preempt` asks them; those this process evicted and those leaving are not asked
        again, so once the evictions are under way this asks nothing. While one is refused,
        nobody more is evicted: the claim cannot be used while that pod holds its devices, and
        evicting the others would leave their jobs half evicted for nothing. If none has gone
        yet, the claim ends; else it waits (the refusal is asked again after REFUSAL_SECONDS)
        and ends by the usual rule."""
        evictable = self._evictable(job, victims)
        if evictable is None:
            return True  # (nobody is evicted)
        uids, priority = evictable
        below = [
            uid for uid in uids if (held := self.ledger.holding(uid)) and held.priority < priority
        ]
        refused = await self.evictions.refusals(below) if below else []
        if not refused:
            return True
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        why = (
            f"the API server refuses to delete {refused[0]}{more}, one of the pods its "
            "preemption evicts"
        )
        if not self.evictions.begun(claim_victims(self.occupancy, claims)):
            await self._release(
                job, claims, f"{why}, and none of them has gone yet: nobody is evicted"
            )
            return None
        if self._said.get(job) != why:
            self._said[job] = why
            log.warning(
                "preemption for job %s: %s; nobody more is evicted while it is refused",
                loggable(job_text(job), NAME_LIMIT),
                loggable(why),
            )
        return False

    def _within_grace(self, victims: list[str], now: float) -> list[str]:
        """The victims leaving whose grace period has not ended (deletionTimestamp)."""
        found = []
        for uid in victims:
            holding = self.ledger.holding(uid)
            if holding is not None and holding.terminating and epoch(holding.leaving_by) > now:
                found.append(uid)
        return found

    def _ended_why(self, victims: list[str]) -> str:
        why = f"none of its members was scheduled for {self.claim_seconds}s"
        if not victims:
            return why
        return (
            f"{why}, and {len(victims)} pod{'s' if len(victims) != 1 else ''} evicted for it "
            f"still hold{'s' if len(victims) == 1 else ''} devices past the grace period "
            f"(such as {self.ledger.pod_key(victims[0])}: is its node down?)"
        )

    def _asked_at(self, job: JobKey) -> float | None:
        """When kube-scheduler last asked about one of the job's members, by the wall clock."""
        asked = self.units.asked.get(job)
        if asked is None:
            return None
        return self.wall_clock() - (self.clock() - asked)

    def _victims_left(self, job: JobKey, claims: list[NodeClaim]) -> list[str]:
        """The pods a Pending claim's preemption evicts that still hold their devices."""
        return self.evictions.leaving(claim_victims(self.occupancy, claims))

    def _evictable(self, job: JobKey, victims: list[str]) -> tuple[list[str], int] | None:
        """Those of a preemption's victims for `job` on Neuron nodes, and the job's priority
        (theirs must be below it: Evictions.evict spares the others, and logs it); None when
        nobody is evicted for the job: no member left, or one must not preempt. A claim is an
        object anyone allowed to write claims could write: what it lists is not enough to
        delete a pod."""
        priority = job_priority(self.occupancy, job)
        if priority is None:
            return None  # no member left: its claim ends, nobody is evicted for it
        waiting = self.occupancy.pending.values()
        if any(p.member.job == job and p.pod.spec.preemptionPolicy == NEVER for p in waiting):
            return None  # (a claim that lists victims for it was not written by this loop)
        servers = self.occupancy.servers
        on_neuron_nodes = [
            uid for uid in victims if (held := self.ledger.holding(uid)) and held.node in servers
        ]
        return on_neuron_nodes, priority

    async def _evict(self, job: JobKey, victims: list[str]) -> int:
        """Evicts a preemption's victims for `job` (`_evictable`)."""
        evictable = self._evictable(job, victims)
        if evictable is None:
            return 0
        text = (
            f"neuron-scheduler: evicted whole with its job, by preemption for job "
            f"{job_text(job)} of higher priority"
        )
        return await self.evictions.evict(evictable[0], text, below=evictable[1])

    async def _rewrite(self, claims: list[NodeClaim], phase: str, renewed: float) -> None:
        """The claims again, in `phase`, renewed to `renewed` (each conditioned on what we
        read). A Bound claim lists no victims: they are gone, its members run."""
        for claim in claims:
            fresh = dataclasses.replace(
                claim,
                phase=phase,
                renewed=renewed,
                victims=claim.victims if phase == PENDING else (),
                victim_jobs=claim.victim_jobs if phase == PENDING else (),
                # Its members came: from now on it ends with them, as any claim does.
                workload=claim.workload if phase == PENDING else "",
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

    def _hold(self, written: JobClaim) -> None:
        try:
            self.occupancy.hold(from_object(written))
        except ClaimError as error:  # the API server gave back what we wrote: should not be
            log.warning("a claim as written cannot be read back: %s", loggable(error))

    # --- jobs waiting for a claim ------------------------------------------------------------

    async def _plan(self) -> None:
        """Claims for the jobs waiting, highest priority then oldest. What each kind of member
        may do on each node is worked out once a step (`FitMemo`): a step costs one scan of the
        nodes per job, and one look at each node per kind of member."""
        jobs = self.occupancy.jobs()
        for job in [j for j in self.occupancy.shortfalls if j not in jobs]:
            del self.occupancy.shortfalls[job]  # gone, or all its members bound
        self.occupancy.told_fits.intersection_update(jobs)
        for job in [j for j in self._said if j not in jobs]:
            del self._said[job]
        for job in [j for j in self._no_preemption if j not in jobs]:
            del self._no_preemption[job]
        asks = self.occupancy.preemption_asks
        for job in [j for j, at in asks.items() if self.clock() - at >= self.claim_seconds]:
            del asks[job]  # kube-scheduler has not asked again: what it asked for is stale
        order = sorted(
            jobs.items(),
            key=lambda item: (
                -(item[1][0].pod.spec.priority or 0),
                item[1][0].pod.metadata.creationTimestamp or "",
                item[0],
            ),
        )
        memo = FitMemo()  # what each kind of member may do on each node, this step
        opened: AtomsMemo = {}  # the units open to a new job of each kind (until one claims)
        for count, (job, waiting) in enumerate(order):
            if count:
                # Filter and bind are answered in between: a job's plan scans every Neuron node
                # (tens of milliseconds at a thousand nodes).
                await asyncio.sleep(0)
            first = waiting[0]
            if first.pod.spec.schedulerName not in self.scheduler_names or self._idle_now(job):
                continue
            size = self.occupancy.size(first.member, job)
            if self.occupancy.complete(job) and size <= self.occupancy.claimed_size(job):
                continue
            fit = member_fit(self.ledger, first.pod, self.policy, memo)
            closeness = closeness_of(first.pod)
            chosen = plan(self.occupancy, job, first.config, size, fit, closeness, opened)
            own = bool(self.occupancy.by_job.get(job))
            # Half a preemption's claim (a crash) is planned again as a preemption, whatever is
            # free now: its victims are worked out anew, and the rest of it let go.
            half = own and not self.occupancy.complete(job) and self._half_preemption(job)
            if (isinstance(chosen, Shortfall) or half) and self._preempting(job, waiting):
                asks.pop(job, None)

                def planning(first: Pending = first) -> Preemption | Shortfall:
                    return preemption_for(
                        self.ledger,
                        self.occupancy,
                        first.pod,
                        first.member,
                        first.config,
                        self.wall_clock(),
                        self.policy,
                    )

                planned = await self._deletable(planning)
                if isinstance(planned, Preemption):
                    self._no_preemption.pop(job, None)
                    await self._preempt(first, size, planned)
                    opened.clear()  # what is open is worked out again
                    continue
                self._impossible(job, planned)
                if half:  # its victims are not evicted for a claim it cannot have now
                    claimed = [self.occupancy.claims[n] for n in self.occupancy.claimed(job)]
                    await self._release(job, claimed, "its preemption cannot be made now")
                    opened.clear()
                    continue
            if isinstance(chosen, Shortfall):
                if own and not self.occupancy.complete(job):
                    # What a crash left half written, and cannot be completed now.
                    claimed = [self.occupancy.claims[n] for n in self.occupancy.claimed(job)]
                    await self._release(job, claimed, "its other nodes are no longer free")
                cannot = never_fits(self.occupancy, job, first.config, size, fit, closeness, opened)
                self._refuse(job, waiting, cannot or chosen, cannot is not None)
                continue
            if chosen.slots or own:
                await self._claim(job, first, size, chosen)
                opened.clear()  # those units are taken: what is open is worked out again

    async def _deletable(
        self, planning: Callable[[], Preemption | Shortfall]
    ) -> Preemption | Shortfall:
        """The preemption `planning` makes, once the API server would delete every victim now
        (a dry run of each); else no preemption, saying which it refuses: evicting whole jobs,
        a refusal met after the others went would leave a job partly evicted, its units held
        for nothing. The dry runs take time, so the plan is made again after them and holds
        only when its victims were all asked."""
        asked: set[str] = set()
        planned = planning()
        for _ in range(DRY_RUN_ROUNDS):
            if not isinstance(planned, Preemption):
                return planned
            new = [uid for uid in planned.victims if uid not in asked]
            if not new:
                return planned
            refused = await self.evictions.refusals(new)
            if refused:
                more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
                return Shortfall(
                    f"job {job_text(planned.job)} would evict {planned.summary}, but the API "
                    f"server refuses to delete {refused[0]}{more}: no preemption"
                )
            asked.update(new)
            planned = planning()
        if not isinstance(planned, Preemption) or asked.issuperset(planned.victims):
            return planned
        return Shortfall("its victims kept changing while their deletions were asked: not now")

    def _preempting(self, job: JobKey, waiting: list[Pending]) -> bool:
        """Whether kube-scheduler asked the preempt verb for one of the job's members, or a
        preemption's claim for it is half written (a crash): the loop works it out now. Never
        for a job one of whose members says `preemptionPolicy: Never`."""
        if any(p.pod.spec.preemptionPolicy == NEVER for p in waiting):
            return False
        if any(kueue_managed(p.pod) for p in waiting):
            return False  # Kueue's preemption acts for its workloads, never ours (docs/kueue.md)
        return job in self.occupancy.preemption_asks or self._half_preemption(job)

    def _impossible(self, job: JobKey, why: Shortfall) -> None:
        """No preemption for the job now: counted each time asked, logged once per reason."""
        self._count("impossible")
        if self._no_preemption.get(job) != why.reason:
            self._no_preemption[job] = why.reason
            log.info(
                "preemption for job %s: %s",
                loggable(job_text(job), NAME_LIMIT),
                loggable(why.reason),
            )

    def _half_preemption(self, job: JobKey) -> bool:
        """Whether the job's claim lists victims (a preemption's), while not complete."""
        claims = self.occupancy.claims
        return not self.occupancy.complete(job) and any(
            claims[n].victims or claims[n].victim_jobs for n in self.occupancy.by_job.get(job, ())
        )

    def _refuse(self, job: JobKey, waiting: list[Pending], why: Shortfall, never: bool) -> None:
        """What its members are refused with; said once per change (logged; and a
        FailedScheduling event on its members when it can never run here, as kube-scheduler
        refuses them itself while every node is full, without asking the extender, or when
        filter told them it fits now: kube-scheduler asks again only on a cluster event, and
        until then its event on them says what they heard)."""
        occupancy = self.occupancy
        occupancy.shortfalls[job] = why.reason
        correcting = job in occupancy.told_fits
        occupancy.told_fits.discard(job)
        if self._said.get(job) != why.reason:
            self._said[job] = why.reason
            log.info("%s", loggable(why.reason))
        elif not correcting:
            return
        if (never or correcting) and self.report is not None:
            for member in waiting[:NEVER_EVENTS]:
                self.report(ObjectRef.of_pod(member.pod), "FailedScheduling", why.reason, True)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.job_preemptions.labels(outcome).inc()

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

    async def _claim(self, job: JobKey, first: Pending, size: int, planned: Planned) -> bool:
        """Claims every node for the job (those it holds already are written again with its
        size now, and the members the plan gives them); on a conflict or an error, what it
        wrote is undone. Whether it claimed them."""
        now = self.wall_clock()
        scheduler = first.pod.spec.schedulerName
        held = self.occupancy.claimed(job)
        writes: list[tuple[NodeClaim, NodeClaim | None]] = [
            (self._new_claim(node, job, planned.config, size, now, scheduler, slots), None)
            for node, slots in planned.slots.items()
            if node not in held  # (held: what a crash left half written)
        ]
        for node in sorted(held):
            mine = self.occupancy.claims[node]
            slots = max(mine.slots, planned.slots.get(node, 0))
            if mine.size < size or slots > mine.slots:  # the job grew: anew on what it holds
                grown = dataclasses.replace(
                    mine, size=max(size, mine.size), slots=slots, renewed=now
                )
                writes.append((grown, mine))
        if not await self._write_claims(job, writes):
            return False
        # What a crash left half written elsewhere goes, or the job would keep it (claimed
        # alongside a whole unit, such a node passes the rule and a member lands there: the job
        # split over two units, the other one's node held for nothing).
        await self._let_go_outside(job, planned.nodes)
        self._said.pop(job, None)
        if planned.slots:
            shown = ", ".join(
                f"{n} ({s} members)" if s > 1 else n for n, s in planned.slots.items()
            )
            kind = f"units of {planned.config} nodes" if planned.config > 1 else "nodes"
            log.info(
                "reserved %s for job %s (%d members, %s%s)",
                shown,
                loggable(job_text(job), NAME_LIMIT),
                size,
                kind,
                f", {planned.span}" if planned.span else "",
            )
        return True

    def _new_claim(
        self,
        node: str,
        job: JobKey,
        config: int,
        size: int,
        now: float,
        scheduler: str,
        slots: int,
        workload: str = "",
        seconds: int = 0,
    ) -> NodeClaim:
        """A Pending claim on `node`, as this loop writes one (renewed now; for a Kueue
        workload, lasting `seconds` without members)."""
        return NodeClaim(
            node,
            job,
            config,
            size,
            PENDING,
            now,
            seconds or self.claim_seconds,
            scheduler,
            slots=slots,
            workload=workload,
        )

    # --- claims for Kueue's admitted workloads (extender/loops/admitting) ----------------------

    async def claim_for_workload(
        self, job: JobKey, scheduler: str, size: int, planned: Planned, workload: str, seconds: int
    ) -> bool:
        """Claims the planned units for a training job of a Kueue workload the placement check
        admits, before any member exists: Pending, naming the workload, lasting `seconds`
        without members (nodes the job holds already are written again so). On a conflict or an
        error, what it wrote is undone. Whether it claimed them."""
        now = self.wall_clock()
        writes: list[tuple[NodeClaim, NodeClaim | None]] = []  # (to write, what it replaces)
        kept = self.occupancy.kept_beside(job, planned.nodes)
        for node in sorted(self.occupancy.claimed(job) & kept):  # (the rest is let go below)
            mine = self.occupancy.claims[node]
            renewed = dataclasses.replace(
                mine,
                size=max(size, mine.size),
                slots=max(mine.slots, planned.slots.get(node, 0)),  # (a held node growing)
                renewed=now,
                workload=workload,
                seconds=seconds,
            )
            writes.append((renewed, mine))
        for node, slots in planned.slots.items():
            known = self.occupancy.claims.get(node)
            if known is None or known.job != job:
                claim = self._new_claim(
                    node, job, planned.config, size, now, scheduler, slots, workload, seconds
                )
                writes.append((claim, None))
        if not await self._write_claims(job, writes):
            return False
        await self._let_go_outside(job, planned.nodes)
        self._said.pop(job, None)
        self.occupancy.shortfalls.pop(job, None)
        log.info(
            "reserved %s for job %s of an admitted Kueue workload (%d members, %s%s), until its "
            "members come (at most %ds)",
            ", ".join(sorted(self.occupancy.claimed(job))),
            loggable(job_text(job), NAME_LIMIT),
            size,
            f"units of {planned.config} nodes" if planned.config > 1 else "nodes",
            f", {planned.span}" if planned.span else "",
            seconds,
        )
        return True

    async def _write_claims(
        self, job: JobKey, writes: list[tuple[NodeClaim, NodeClaim | None]]
    ) -> bool:
        """Creates each claim (None: a new one) or replaces the one it was (conditioned on what
        was read), in order; on a conflict or an error, undoes what it wrote (deletes the new,
        writes back the replaced). Whether all were written."""
        written: list[tuple[NodeClaim, NodeClaim | None]] = []
        for claim, before in writes:
            write = self.api.create_claim if before is None else self.api.replace_claim
            try:
                ours = from_object(await write(to_object(claim)))
            except CLAIM_WRITE_ERRORS as error:
                self._undoing(job, claim.node, error)
                await self._undo(written)
                return False
            written.append((ours, before))
            self.occupancy.hold(ours)  # (admits nobody of the job until complete)
        return True

    async def release_workload(self, job: JobKey, workload: str, why: str) -> None:
        """Ends the job's Pending claims made for this Kueue workload (it was evicted, finished,
        or its members did not come in time)."""
        claims = [
            self.occupancy.claims[n]
            for n in sorted(self.occupancy.claimed(job))
            if self.occupancy.claims[n].workload == workload
        ]
        if claims:
            await self._release(job, claims, why)

    async def _preempt(self, first: Pending, size: int, planned: Preemption) -> bool:
        """Preemption for the job: its claim on the units first, node by node, taking the nodes
        of the victim jobs' claims (conditioned on what was read) and listing the victims; then
        the victims evicted; then what is left of the victim jobs' claims ended. On a conflict
        or an error while claiming, what was written is undone and nobody is evicted."""
        job, now = planned.job, self.wall_clock()
        scheduler = first.pod.spec.schedulerName
        written: list[tuple[NodeClaim, NodeClaim | None]] = []
        slots = planned.slots or (1,) * len(planned.nodes)
        for node, taking in zip(planned.nodes, slots, strict=True):
            known = self.occupancy.claims.get(node)
            claim = dataclasses.replace(
                self._new_claim(node, job, planned.config, size, now, scheduler, taking),
                victims=planned.victims,
                victim_jobs=planned.jobs,
            )
            try:
                if known is None:
                    ours = from_object(await self.api.create_claim(to_object(claim)))
                elif known.job == job or known.job in planned.jobs:
                    taken = dataclasses.replace(claim, version=known.version, uid=known.uid)
                    ours = from_object(await self.api.replace_claim(to_object(taken)))
                else:
                    raise Conflict("PUT", node, 409, b"claimed since the plan was made")
            except CLAIM_WRITE_ERRORS as error:
                self._undoing(job, node, error)
                await self._undo(written)
                self._count("failed")
                return False
            written.append((ours, known))
            # Held at once, not after the last node: from here on filter and bind refuse this
            # node to the victim jobs' members (and to pods of no job) while the rest is written.
            self.occupancy.hold(ours)
        await self._let_go_outside(job, planned.nodes)
        # Worked out again now that the claim holds every node: a victim job's member that was
        # already past filter when the plan was made may have bound (or be binding) since. Its
        # deletion is asked before any eviction, as the plan's own victims' were.
        claims = [self.occupancy.claims[n] for n in self.occupancy.claimed(job)]
        victims = claim_victims(self.occupancy, claims)
        listed = set(planned.victims)
        late = [uid for uid in victims if uid not in listed]
        refused = await self.evictions.refusals(late) if late else []
        if refused:
            self._undoing_refused(job, refused)
            await self._undo(written)
            self._count("failed")
            return False
        self._said.pop(job, None)
        self._count("carried_out")
        log.info(
            "preemption for job %s (%d members, %s, priority %d): reserved %s; "
            "evicting %s (%d pods)",
            loggable(job_text(job), NAME_LIMIT),
            size,
            f"units of {planned.config} nodes" if planned.config > 1 else "nodes",
            first.pod.spec.priority or 0,
            ", ".join(planned.nodes),
            loggable(planned.summary),
            len(victims),
        )
        evicted = await self._evict(job, victims)
        if self.metrics is not None:
            self.metrics.job_preemption_victims.inc(evicted)
        leftover = [
            c
            for c in self.occupancy.claims.values()
            if c.job in planned.jobs and c.node not in planned.nodes
        ]
        for victim in planned.jobs:
            mine = [c for c in leftover if c.job == victim]
            if mine:
                why = f"its job is evicted whole by preemption for job {job_text(job)}"
                await self._release(victim, mine, why)
        return True

    async def _let_go_outside(self, job: JobKey, nodes: Collection[str]) -> None:
        """Ends the job's claim on nodes it does not keep (`Occupancy.kept_beside`): what a crash
        left of an earlier attempt, which this one did not take again."""
        kept = self.occupancy.kept_beside(job, nodes)
        outside = [
            self.occupancy.claims[n] for n in sorted(self.occupancy.claimed(job)) if n not in kept
        ]
        if outside:
            why = "a crash left it half written, and it was planned anew"
            await self._release(job, outside, why)

    def _undoing_refused(self, job: JobKey, refused: list[str]) -> None:
        log.warning(
            "preemption for job %s: a member of a victim job bound since the plan, and the API "
            "server refuses to delete %s; undoing this attempt, nobody is evicted",
            loggable(job_text(job), NAME_LIMIT),
            loggable(refused[0]),
        )

    def _undoing(self, job: JobKey, node: str, error: BaseException) -> None:
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

    async def _undo(self, written: list[tuple[NodeClaim, NodeClaim | None]]) -> None:
        """Deletes the claims this attempt created and gives back the nodes it took from
        another job's claim (as that claim was)."""
        for claim, taken_from in written:
            try:
                if taken_from is None:
                    await self.api.delete_claim(claim.node, claim.uid, claim.version)
                    self.occupancy.release(claim.node, claim.uid)
                else:
                    back = dataclasses.replace(taken_from, version=claim.version, uid=claim.uid)
                    self._hold(await self.api.replace_claim(to_object(back)))
            except NotFound:
                self.occupancy.release(claim.node, claim.uid)
            except READ_ERRORS as error:
                # It stays until it ends by itself (Pending, its job does nothing with it).
                log.warning("cannot undo the claim on %s: %s", claim.node, loggable(error))
