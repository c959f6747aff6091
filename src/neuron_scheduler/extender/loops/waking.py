"""Wakes pending pods the extender refused once a node they were refused on can take them.

kube-scheduler retries a pod the extender refused on any cluster event (the extender's refusal is
recorded under `ExtenderName`, registered for every event; docs/scheduling.md). Two kinds of
freed room reach no such retry:

- room freed without a cluster event: a failed bind's hold that ends, a job's claim that
  expires, a hold that ends after a restart;
- room freed by an event kube-scheduler acted on before our watch did: it retried the pod at
  once, our filter still saw the block taken, and no further event comes.

Both would wait for kube-scheduler's flush of unschedulable pods (5 minutes). So filter records
the pods it refused everywhere (`refused`), the ledger and the other hold keepers say which node
freed room and why (`node_changed`), and the waker updates each pending pod that fits there now
and was refused before the room freed, with one annotation (`WAKE_ANNOTATION`). kube-scheduler
takes an update of an unschedulable pod as an event for it (`PriorityQueue.Update` ->
`isPodWorthRequeuing`, where the extender's wildcard answers Queue) and retries it after its
backoff.

Bounds: one write per pod per refusal (a woken pod is forgotten until kube-scheduler asks about it
again), greedy per node (only as many pods as the freed room takes, highest priority first),
`rate` writes per second at most, none while this replica is not the leader, none for pods of
other schedulers. A wake never touches a pod whose bind is in flight (`quiet`): bind's annotation
patch and Binding are conditioned on the pod's resourceVersion, which a wake changes. A failed
write is logged once per kind of failure and left to kube-scheduler's flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from neuron_scheduler.core.allocation import NodeState, Placement, Policy, allocate
from neuron_scheduler.core.logtext import NAME_LIMIT, loggable
from neuron_scheduler.core.resources import NeuronRequest, RequestError
from neuron_scheduler.extender.loops.stepping import wait_signal
from neuron_scheduler.extender.state.ledger import (
    NODE_CHANGED,
    NOMINATION_ENDED,
    POD_CHANGED,
    POD_DELETED,
    POD_FINISHED,
    Claimant,
    Ledger,
)
from neuron_scheduler.extender.state.plugins import HoldKeeper, NodeFilter
from neuron_scheduler.kube.errors import READ_ERRORS, Conflict, Forbidden, NotFound, error_text
from neuron_scheduler.kube.nodefit import placement_kind, why_not
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import gated, neuron_request, unschedulable

log = logging.getLogger("neuron_scheduler.extender.waking")

# The annotation a wake writes on the pending pod: when, where and why room freed. Its value
# changes with every wake (an unchanged merge patch is no update, and no event).
WAKE_ANNOTATION = "neuron-scheduler.io/woken"

# Changes the cluster made are events kube-scheduler saw too: the waker gives it `grace` to act
# on them first. Holds that end inside the extender (a bind's hold let go or expired, an
# job's claim ended) are nobody's event: those are examined at once.
CLUSTER_EVENTS = frozenset({POD_DELETED, POD_FINISHED, POD_CHANGED, NODE_CHANGED, NOMINATION_ENDED})

DEFAULT_RATE = 20.0  # wake writes per second
DEFAULT_GRACE = 0.5  # seconds kube-scheduler gets to retry on a cluster event itself
MAX_WAITING = 20_000  # refused pods remembered; beyond it the oldest are left to the flush
MAX_IN_FLIGHT = 8  # wake writes at once
QUIET_WAIT = 1.0  # seconds a bind waits at most for a wake already on its way
MAX_FITS_PER_NODE = 64  # pods woken for one node's freed room, at most
MIN_STEP = 0.01  # seconds between steps at least: a deadline that will not pass is no busy loop
MAX_STEP = 5.0  # and at most (keepers say when a new deadline starts; this is the safety net)


class AnnotationWriter(Protocol):
    """What the waker needs of KubeAPI: a merge patch of annotation keys, uid as precondition."""

    async def patch_annotations(
        self,
        namespace: str,
        name: str,
        uid: str,
        values: dict[str, str | None],
        *,
        resource_version: str | None = None,
    ) -> str: ...


@dataclass(slots=True)
class Waiting:
    """A pending pod the extender refused everywhere kube-scheduler asked."""

    pod: Pod
    request: NeuronRequest
    claimant: Claimant
    refused: int  # when, in the waker's sequence of refusals and changes
    order: int  # arrival order, kube-scheduler's tie-break after priority
    kind: bytes  # what decides where it may run (pods of one kind are judged alike)


def _queue_order(waiting: Waiting) -> tuple[int, int]:
    return (-waiting.claimant.priority, waiting.order)


@dataclass(frozen=True, slots=True)
class Change:
    """Room a node freed, not examined yet: when to examine it (the earliest change's grace
    counts, so steady churn does not put it off), the latest change in the waker's sequence
    (pods refused before it may fit now) and its cause."""

    due_at: float
    seq: int
    cause: str


@dataclass(frozen=True, slots=True)
class Wake:
    node: str
    cause: str


class TokenBucket:
    """`rate` tokens a second, up to `rate` saved (at least one)."""

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.capacity = max(rate, 1.0)
        self.clock = clock
        self.tokens = self.capacity
        self.stamp = clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def seconds_to_next(self) -> float:
        return max(0.0, (1.0 - self.tokens) / self.rate)


class Waker:
    def __init__(
        self,
        ledger: Ledger,
        writer: AnnotationWriter,
        scheduler_names: Collection[str],
        *,
        filters: Sequence[NodeFilter] = (),
        keepers: Sequence[HoldKeeper] = (),
        policy: Policy = Policy.BEST_FIT,
        rate: float = DEFAULT_RATE,
        grace: float = DEFAULT_GRACE,
        is_leader: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        on_wake: Callable[[str, str], None] | None = None,
    ) -> None:
        """`filters`: the node filters filter runs after the device check (a woken pod must pass
        them too); `keepers`: what holds devices or nodes until a deadline (the waker ends those
        holds when they are due, as nobody reads them then); `rate`: wake writes per second, 0
        for none (what would be woken is then only logged); `on_wake(cause, result)`: counts
        each wake for the metrics."""
        self.ledger = ledger
        self.writer = writer
        self.scheduler_names = frozenset(scheduler_names)
        self.filters = tuple(filters)
        self.keepers = tuple(keepers)
        self.policy = policy
        self.rate = rate
        self.grace = grace
        self.is_leader = is_leader
        self.clock = clock
        self.wall_clock = wall_clock
        self.on_wake = on_wake
        self.waiting: dict[str, Waiting] = {}
        self.changes: dict[str, Change] = {}
        self.due: dict[str, Wake] = {}  # pod uid -> why it is woken, in the order found
        self._quiet: dict[str, int] = {}  # pod uid -> binds in flight
        self._writing: dict[str, asyncio.Task[None]] = {}
        self._failures: set[str] = set()  # kinds of write failure logged since the last success
        self._arrivals = 0
        self._sequence = itertools.count(1)  # orders refusals and changes, whatever the clock
        self._bucket = TokenBucket(rate, clock) if rate > 0 else None
        self._signal = asyncio.Event()
        self._step_at = float("-inf")  # clock() of the next step while the loop waits for it
        self._seeded = False
        # Pending pods kube-scheduler marked unschedulable (from the watch): what a replica
        # that becomes leader seeds, as the previous leader's refusals died with it.
        self._unschedulable: dict[str, Pod] = {}
        self._leading = False

    # --- what filter and bind tell it --------------------------------------------------------

    def refused(self, pod: Pod, request: NeuronRequest) -> None:
        """filter refused the pod on every node kube-scheduler asked about (some of them for
        room it may get later)."""
        uid = pod.metadata.uid
        if pod.spec.schedulerName not in self.scheduler_names:
            return
        self.due.pop(uid, None)  # kube-scheduler has just asked: what was due is answered
        self._remember(pod, request)

    def placed(self, uid: str) -> None:
        """filter found a node for the pod: it is not waiting for room."""
        if self.waiting:
            self.waiting.pop(uid, None)
            self.due.pop(uid, None)

    @contextlib.asynccontextmanager
    async def quiet(self, uid: str) -> AsyncIterator[None]:
        """While a bind of this pod is in flight: no wake is written to it, and one already on
        its way has landed (or failed) before the bind reads the pod."""
        self.placed(uid)
        self._quiet[uid] = self._quiet.get(uid, 0) + 1
        try:
            writing = self._writing.get(uid)
            if writing is not None:
                # Briefly: kube-scheduler's bind call has a timeout of its own. A wake that lands
                # later makes bind's writes fail their resourceVersion check, not go wrong.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(writing), QUIET_WAIT)
            yield
        finally:
            left = self._quiet[uid] - 1
            if left:
                self._quiet[uid] = left
            else:
                del self._quiet[uid]

    def _remember(self, pod: Pod, request: NeuronRequest) -> None:
        uid = pod.metadata.uid
        known = self.waiting.get(uid)
        if known is None:
            if len(self.waiting) >= MAX_WAITING:
                oldest = next(iter(self.waiting))
                del self.waiting[oldest]
                self.due.pop(oldest, None)
            self._arrivals += 1
            order = self._arrivals
        else:
            order = known.order
        self.waiting[uid] = Waiting(
            pod,
            request,
            Claimant.of(pod, request),
            next(self._sequence),
            order,
            placement_kind(pod),
        )

    # --- what the watches and hold keepers tell it -------------------------------------------

    def node_changed(self, nodes: Iterable[str], cause: str) -> None:
        """Room freed on these nodes (or may have: a pod's holding changed)."""
        if not self.waiting:
            # Only pods refused before a change are woken for it, and none are: every bind
            # changes its node twice, and a step for each was most of the waker's cost (issue 50).
            return
        seq = next(self._sequence)
        due_at = self.clock() + self._grace(cause)
        for node in nodes:
            earlier = self.changes.get(node)
            self.changes[node] = Change(
                min(due_at, earlier.due_at) if earlier else due_at, seq, cause
            )
        self._signal.set()

    def deadline_changed(self) -> None:
        """A keeper holds something new until a deadline: the next step comes by then (a step
        is already due sooner for the holds of binds: they last 90 s, steps come every 5 s)."""
        now = self.clock()
        for keeper in self.keepers:
            wait = keeper.seconds_to_next_expiry()
            if wait is not None and now + wait < self._step_at:
                self._signal.set()
                return

    def replace_nodes(self, nodes: Iterable[object]) -> None:
        pass

    def apply_node(self, node: object) -> None:
        pass

    def remove_node(self, name: str) -> None:
        self.changes.pop(name, None)

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        """The first list after start seeds the pods kube-scheduler left unschedulable: a restart
        lost what filter had refused, and holds rebuilt from annotations end silently later."""
        listed = {pod.metadata.uid: pod for pod in pods}
        for uid in [u for u in self.waiting if u not in listed]:
            self.placed(uid)
        for pod in listed.values():
            self.apply_pod(pod)
            if not self._seeded and _unschedulable(pod):
                self._seed(pod)
        self._seeded = True

    def _seed(self, pod: Pod) -> None:
        if pod.spec.schedulerName not in self.scheduler_names or pod.metadata.uid in self.waiting:
            return
        try:
            request = neuron_request(pod)
        except RequestError:
            return
        if request is not None:
            self._remember(pod, request)

    def apply_pod(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        if (
            pod.spec.nodeName
            or pod.finished
            or pod.metadata.deletionTimestamp is not None
            or gated(pod)  # kube-scheduler does not try it: a wake would be for nothing
        ):
            self.placed(uid)
            self._unschedulable.pop(uid, None)
        elif _unschedulable(pod) and pod.spec.schedulerName in self.scheduler_names:
            if uid in self._unschedulable or len(self._unschedulable) < MAX_WAITING:
                self._unschedulable[uid] = pod
        else:
            self._unschedulable.pop(uid, None)

    def remove_pod(self, uid: str) -> None:
        self.placed(uid)
        self._unschedulable.pop(uid, None)

    # --- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            try:
                delay = self.step()
            except Exception:  # a bug must not end the loop: holds would never end
                log.exception("waker step failed; trying again in %.0fs", MAX_STEP)
                delay = MAX_STEP
            self._step_at = self.clock() + delay
            await wait_signal(self._signal, delay)
            self._step_at = float("-inf")  # (stepping now: what changes meanwhile it sees)
            self._signal.clear()

    def step(self) -> float:
        """Ends the holds that are due, finds the pods to wake, writes what the rate allows;
        seconds until there is more to do (at most MAX_STEP)."""
        leading = self.is_leader()
        if leading and not self._leading:  # just became leader (or started as one)
            for pod in list(self._unschedulable.values()):
                self._seed(pod)
        self._leading = leading
        for keeper in self.keepers:
            wait = keeper.seconds_to_next_expiry()
            if wait is not None and wait <= 0:
                keeper.expire()
        now = self.clock()
        ready = [node for node, change in self.changes.items() if change.due_at <= now]
        if ready:
            found = self._examine({node: self.changes.pop(node) for node in ready})
            self.due.update(found)
        self._write_due()
        return self._next_step(now)

    def _grace(self, cause: str) -> float:
        return self.grace if cause in CLUSTER_EVENTS else 0.0

    def _next_step(self, now: float) -> float:
        deadlines = [MAX_STEP]
        for keeper in self.keepers:
            wait = keeper.seconds_to_next_expiry()
            if wait is not None:
                deadlines.append(wait)
        for change in self.changes.values():
            deadlines.append(change.due_at - now)
        if self.due and self._bucket is not None and len(self._writing) < MAX_IN_FLIGHT:
            deadlines.append(self._bucket.seconds_to_next())
        return max(MIN_STEP, min(deadlines))

    # --- which pods fit where room freed -----------------------------------------------------

    def _examine(self, changes: dict[str, Change]) -> dict[str, Wake]:
        """The waiting pods to wake for these nodes' changes: on each node, greedily, those
        refused before the change that fit now, highest priority first (kube-scheduler's queue
        order), each taking its placement from the room the next ones see. Waiting pods are
        grouped by what decides where they may run (`placement_kind`): a node excluded by a
        group's spec is passed over once for the whole group, and a node stops being looked at
        once no shape fits there any more."""
        if not self.waiting or not self.is_leader():
            return {}
        groups: dict[bytes, list[Waiting]] = {}
        for uid, waiting in self.waiting.items():
            if uid not in self.due:
                groups.setdefault(waiting.kind, []).append(waiting)
        for members in groups.values():
            members.sort(key=_queue_order)
        found: dict[str, Wake] = {}
        now = self.clock()
        for node, change in changes.items():
            entry = self.ledger.nodes.get(node)
            if entry is None:
                continue
            facts = self.ledger.facts.get(node)
            eligible = [
                members
                for members in groups.values()
                if facts is None or why_not(members[0].pod, facts) is None
            ]
            shapes = {(m[0].request.unit, m[0].request.count) for m in eligible}
            taken = 0  # cores given to the pods woken for this node so far
            full: set[tuple[object, int]] = set()  # shapes that no longer fit, for anyone
            nominated = self.ledger.holds_on(node)
            woken = 0
            for waiting in heapq.merge(*eligible, key=_queue_order):
                uid = waiting.pod.metadata.uid
                shape = (waiting.request.unit, waiting.request.count)
                if uid in found or uid in self._quiet or waiting.refused > change.seq:
                    continue
                if shape in full:
                    if len(full) == len(shapes):
                        break  # nothing more fits here
                    continue
                seen = self.ledger.state_for(waiting.claimant, node)
                state = NodeState(seen.used_cores | taken, seen.unattributed_cores)
                decision = allocate(
                    entry.topology, state, waiting.request, self.policy, self.ledger.demand.weights
                )
                if not isinstance(decision, Placement):
                    if not nominated:  # every claimant sees this node alike
                        full.add(shape)
                    continue
                if not all(f.admits(waiting.pod, node, now) for f in self.filters):
                    continue
                taken |= decision.core_mask
                found[uid] = Wake(node, change.cause)
                woken += 1
                if woken >= MAX_FITS_PER_NODE:
                    break
        return found

    # --- writing -----------------------------------------------------------------------------

    def _write_due(self) -> None:
        while self.due and len(self._writing) < MAX_IN_FLIGHT:
            if self.rate > 0 and not self.is_leader():
                self.due.clear()
                return
            uid = next(iter(self.due))
            waiting = self.waiting.get(uid)
            if waiting is None or uid in self._quiet or uid in self._writing:
                del self.due[uid]
                continue
            if self._bucket is not None and not self._bucket.take():
                return
            wake = self.due.pop(uid)
            del self.waiting[uid]  # one wake per refusal: kube-scheduler's next answer re-adds it
            if self._bucket is None:
                log.info(
                    "would wake pod %s: %s freed room for it (%s); waking is off (--wake-rate 0)",
                    loggable(waiting.pod.key, NAME_LIMIT),
                    loggable(wake.node, NAME_LIMIT),
                    wake.cause,
                )
                self._count(wake.cause, "off")
                continue
            task = asyncio.get_running_loop().create_task(self._write(waiting.pod, wake))
            self._writing[uid] = task
            task.add_done_callback(functools.partial(self._finished, uid))

    def _finished(self, uid: str, _: asyncio.Task[None]) -> None:
        self._writing.pop(uid, None)
        self._signal.set()

    async def _write(self, pod: Pod, wake: Wake) -> None:
        meta = pod.metadata
        stamp = datetime.fromtimestamp(self.wall_clock(), UTC).isoformat(timespec="milliseconds")
        value = f"{stamp} {wake.node}: {wake.cause.replace('_', ' ')}"
        try:
            await self.writer.patch_annotations(
                meta.namespace, meta.name, meta.uid, {WAKE_ANNOTATION: value}
            )
        except (NotFound, Conflict):
            self._count(wake.cause, "gone")  # deleted, or deleted and created again: no wake
            return
        except READ_ERRORS as error:
            self._count(wake.cause, "failed")
            kind = "forbidden" if isinstance(error, Forbidden) else type(error).__name__
            if kind not in self._failures:
                self._failures.add(kind)
                log.warning(
                    "cannot wake pending pod %s (%s freed room for it): %s; such pods are left "
                    "to kube-scheduler's periodic retry of unschedulable pods (5 minutes by "
                    "default)%s",
                    loggable(pod.key, NAME_LIMIT),
                    loggable(wake.node, NAME_LIMIT),
                    loggable(error_text(error)),
                    "; the extender's ClusterRole needs patch on pods"
                    if kind == "forbidden"
                    else "",
                )
            return
        self._failures.clear()
        self._count(wake.cause, "woken")
        log.info(
            "woke pending pod %s: %s freed room for it (%s)",
            loggable(pod.key, NAME_LIMIT),
            loggable(wake.node, NAME_LIMIT),
            wake.cause,
        )

    def _count(self, cause: str, result: str) -> None:
        if self.on_wake is not None:
            self.on_wake(cause, result)


def _unschedulable(pod: Pod) -> bool:
    return not pod.spec.nodeName and not pod.finished and unschedulable(pod) and not gated(pod)
