"""bind: decide again under the node's lock, hold the placement, write our annotations, create the
Binding, and undo all of it on any error. The extender's only writer to the cluster.

Binds of one pod never overlap: kube-scheduler retries a bind whose answer outlived its
`httpTimeout`, possibly to another node, while the first is still running; the retry is refused
at once (kube-scheduler tries again and then finds the pod bound). A failed attempt gives up only
the hold it made, on its own node, and removes the annotations only while the pod is unbound and
they are still the ones it wrote (a resourceVersion precondition makes the check and the removal
one step): no pod is ever left bound with a Neuron request and no ids.

A write whose answer is an error may still land later (a request delayed on its way, a timeout
while kube-apiserver works on it). So each write is conditioned on the pod as the attempt last saw
it (the annotation patch on the pod bind read, the Binding on the patched pod), and an attempt
gives up its devices only once its Binding can no longer land: the pod is bound, deleted, or has
changed since the patch (removing the annotations is such a change). While that cannot be known
(the API keeps failing), the devices stay held, for `ANNOUNCED_SECONDS` at most, and the pod's next
bind settles it first.

The pod is read from the watch when it shows it pending (extender/state/pending.py), saving a round
trip: a copy behind the pod fails the patch's resourceVersion precondition (nothing is written,
nothing can land later) or gets a refusal it might not get now (its own earlier bind may have
landed), and bind then starts over from the API's copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from neuron_scheduler.core import handoff
from neuron_scheduler.core.allocation import Placement, Policy, Refusal, allocate
from neuron_scheduler.core.ids import format_ids
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.resources import NeuronRequest, RequestError
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.ledger import ANNOUNCED_SECONDS, Claimant, Ledger
from neuron_scheduler.extender.state.plugins import NodeFilter, Reserver
from neuron_scheduler.extender.verbs.wire import BadRequest, ExtenderBindingArgs
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.errors import READ_ERRORS, Conflict, NotFound, error_text
from neuron_scheduler.kube.events import EventRecorder
from neuron_scheduler.kube.nodefit import why_not
from neuron_scheduler.kube.objects import ObjectRef, Pod
from neuron_scheduler.kube.reading import assignment, neuron_request, servable_request

log = logging.getLogger("neuron_scheduler.extender")

SETTLE_ATTEMPTS = 4  # reads of the pod (and removals of our annotations) to settle a failed bind


class Outcome(Enum):
    """What became of a bind attempt whose writes met an API error."""

    BOUND = "bound"  # the pod is bound to the attempt's node with its ids: keep them
    SETTLED = "settled"  # it is not, and its Binding can no longer land: its hold can go
    OPEN = "open"  # not bound yet, but its Binding may still land: keep holding its devices


@dataclass(frozen=True, eq=False)
class Attempt:
    """One bind attempt's writes: the annotations, and the pod's resourceVersion after them,
    which its Binding is conditioned on (None: the patch failed, so no Binding was sent)."""

    pod: Pod
    node: str
    written: dict[str, str]
    version: str | None


DEFAULT_SCHEDULER_NAMES = ("my-scheduler",)

# What kube-scheduler sends: object names (DNS-1123 subdomains) and UIDs. Anything else (a path,
# control characters, megabytes) is refused before it reaches an API path, a log line, or the
# event thinning's memory, which keys on messages naming the node.
NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
UID = re.compile(r"[0-9A-Za-z-]{1,128}")


class Binder:
    def __init__(
        self,
        api: KubeAPI,
        ledger: Ledger,
        metrics: Metrics,
        synced: asyncio.Event,
        events: EventRecorder,
        policy: Policy = Policy.BEST_FIT,
        reservers: Sequence[Reserver] = (),
        scheduler_names: Sequence[str] = DEFAULT_SCHEDULER_NAMES,
        quiet: Callable[[str], contextlib.AbstractAsyncContextManager[None]] | None = None,
        pending: Callable[[str], Pod | None] | None = None,
        filters: Sequence[NodeFilter] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`synced`: set once the watches have listed every pod and node; `reservers` hold a
        placement while its API calls are in flight (the ledger, and any plugin that counts
        bound pods itself); `scheduler_names`: the profiles whose binds this extender serves;
        `quiet(uid)`: entered for the whole bind, so no other writer of ours (the waker) changes
        the pod while bind's writes are conditioned on its resourceVersion; `pending(uid)`: the
        pod as the watch last showed it, if it is pending (extender/state/pending.py), read
        instead of asking the API for it; `filters`: the node filters filter ran (the training-job
        rule), asked again under the node's lock (by `clock`, filter's)."""
        self.api = api
        self.ledger = ledger
        self.metrics = metrics
        self.synced = synced
        self.events = events
        self.policy = policy
        self.reservers = tuple(reservers)
        self.scheduler_names = frozenset(scheduler_names)
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._binding: dict[str, str] = {}  # pod uid -> the node its bind in flight is for
        self._quiet = quiet or (lambda _: contextlib.nullcontext())
        self._open: dict[str, Attempt] = {}  # pod uid -> its failed attempt that may still land
        self._pending = pending or (lambda _: None)
        self.filters = tuple(filters)
        self.clock = clock

    async def bind(self, args: ExtenderBindingArgs) -> str:
        """Empty string on success, else the error kube-scheduler shows and retries on."""
        if not (args.PodName and args.PodNamespace and args.PodUID and args.Node):
            raise BadRequest("bind needs PodName, PodNamespace, PodUID and Node")
        for field, value, form in (
            ("PodName", args.PodName, NAME),
            ("PodNamespace", args.PodNamespace, NAME),
            ("Node", args.Node, NAME),
            ("PodUID", args.PodUID, UID),
        ):
            if not form.fullmatch(value):
                raise BadRequest(f"bind: {field} {value[:80]!r} cannot be a Kubernetes {field}")
        if not self.synced.is_set():
            self.metrics.binds.labels("not_ready").inc()
            return "neuron-scheduler is starting: its cache of pods and nodes is not synced yet"
        key = f"{args.PodNamespace}/{args.PodName}"
        other = self._binding.get(args.PodUID)
        if other is not None:
            self.metrics.binds.labels("in_progress").inc()
            return (
                f"a bind of pod {key} to {other} is still in progress; not binding it to "
                f"{args.Node} as well (kube-scheduler retries and will find it bound)"
            )
        self._binding[args.PodUID] = args.Node
        try:
            async with self._quiet(args.PodUID):
                return await self._settle_earlier(args.PodUID, key) or await self._bind(args, key)
        finally:
            del self._binding[args.PodUID]

    def _watched(self, args: ExtenderBindingArgs) -> Pod | None:
        """The pod as the watch last showed it, when that is the pod asked about and pending."""
        pod = self._pending(args.PodUID)
        if pod is None or not pod.metadata.resourceVersion:
            return None
        meta = pod.metadata
        if (meta.namespace, meta.name, meta.uid) != (args.PodNamespace, args.PodName, args.PodUID):
            return None
        return pod

    async def _bind(self, args: ExtenderBindingArgs, key: str, watched: bool = True) -> str:
        """`watched`: start from the watch's copy of the pod when it has one (its first write
        then fails as a Conflict if the pod changed since, and bind starts over from the API's
        copy)."""
        pod = self._watched(args) if watched else None
        from_watch = pod is not None
        if pod is None:
            try:
                pod = await self.api.get_pod(args.PodNamespace, args.PodName)
            except READ_ERRORS as error:
                self.metrics.binds.labels("failure").inc()
                return f"cannot read pod {key}: {error_text(error)}"
        if pod.metadata.uid != args.PodUID:
            self.metrics.binds.labels("failure").inc()
            return (
                f"pod {key} has UID {pod.metadata.uid}, not {args.PodUID}: it was deleted "
                "and created again; not binding"
            )
        if pod.spec.nodeName:
            return self._already_bound(pod, args.Node)
        try:
            request = neuron_request(pod)
        except RequestError as error:
            self.metrics.binds.labels("failure").inc()
            return str(error)
        refusal = self._not_ours_to_bind(pod, request, args.Node)
        if refusal is not None:
            self.metrics.binds.labels("refused").inc()
            log.warning(
                "refused to bind %s to %s: %s",
                loggable(key),
                loggable(args.Node),
                loggable(refusal),
            )
            self._warn(pod, "NeuronBindRefused", f"not bound to {args.Node}: {refusal}")
            return f"not binding pod {key} to {args.Node}: {refusal}"
        assert request is not None  # checked above

        start = time.perf_counter()
        ask_api = False  # the watch's copy may be behind (a bind of it landed): ask the API
        async with self._locks[args.Node]:
            entry = self.ledger.nodes.get(args.Node)
            if entry is None:
                self.metrics.binds.labels("failure").inc()
                return f"node {args.Node} left neuron-scheduler's cache"
            # Filter's answer may be old: a node filter (the training-job rule) may refuse the
            # node now, e.g. a preemption's claim took it for another job since. Checked here,
            # under the node's lock and with the hold below in the same step, so a claim is
            # either seen here or sees this pod counted on the node.
            refusing = self._refusing(pod, args.Node)
            if refusing is not None and not from_watch:
                self.metrics.binds.labels("refused").inc()
                refusal = (
                    f"the extender's {refusing} rule no longer admits it there (the node changed "
                    "since kube-scheduler's filter: claimed for another training job, or taken "
                    "by a member of one)"
                )
                log.info(
                    "refused to bind %s to %s: %s",
                    loggable(key),
                    loggable(args.Node),
                    refusal,
                )
                self._warn(pod, "NeuronBindRefused", f"not bound to {args.Node}: {refusal}")
                return f"not binding pod {key} to {args.Node}: {refusal}"
            claimant = Claimant.of(pod, request)  # its own held block is its
            state = self.ledger.state_for(claimant, args.Node)
            decision = allocate(
                entry.topology, state, request, self.policy, self.ledger.demand.weights
            )
            if from_watch and (refusing is not None or isinstance(decision, Refusal)):
                ask_api = True  # the watch's copy: the API's may be bound already
            elif isinstance(decision, Refusal):
                reason = self.ledger.failed_devices_refusal(args.Node, request, decision).reason
                held = self.ledger.hold_reason(claimant, args.Node, request, self.policy)
                self.metrics.binds.labels("failure").inc()
                self._warn(pod, "FailedNeuronAllocation", f"{args.Node}: {held or reason}")
                return f"node {args.Node}: {held or reason}"
            else:
                # Held from here on, so concurrent filters and binds on this node see it taken
                # while the API calls below are in flight (outside the lock). A plugin such as
                # the training-job rule counts the pod on its node from here too: kube-scheduler
                # asks about the next MPI worker before this binding is visible in the watch.
                for reserver in self.reservers:
                    reserver.reserve(pod, args.Node, decision)
                values = handoff.encode(
                    args.Node, request, decision, pod.container_names, time.time_ns()
                )
        if ask_api or not isinstance(decision, Placement):  # (the lock is free again)
            return await self._bind(args, key, watched=False)
        self.metrics.bind_work.observe(time.perf_counter() - start)
        answer = await self._write(pod, args.Node, request, decision, values, from_watch)
        if answer is None:  # the watch's copy was behind the pod: nothing was written
            return await self._bind(args, key, watched=False)
        return answer

    async def _write(
        self,
        pod: Pod,
        node: str,
        request: NeuronRequest,
        placement: Placement,
        values: dict[str, str],
        from_watch: bool = False,
    ) -> str | None:
        """The bind's answer; None when the pod (`from_watch`: the watch's copy) had changed
        since: the patch found another resourceVersion and nothing was written or is held."""
        meta = pod.metadata
        version: str | None = None  # the pod's resourceVersion our Binding is conditioned on
        try:
            # Both writes are conditioned on the pod as we last saw it: the patch on the pod
            # bind read (a Binding sent earlier, by an attempt or an extender that gave up on
            # it, cannot have landed in between), the Binding on the patched pod.
            try:
                version = await self.api.patch_annotations(
                    meta.namespace,
                    meta.name,
                    meta.uid,
                    dict(values),
                    resource_version=meta.resourceVersion or None,
                )
            except Conflict:
                if not from_watch:
                    raise
                # A refused precondition writes nothing (unlike a timeout, nothing can land
                # later): let the hold go, the caller starts over from the API's copy.
                for reserver in self.reservers:
                    reserver.unreserve(pod, node)
                return None
            await self.api.bind(meta.namespace, meta.name, meta.uid, node, resource_version=version)
        except READ_ERRORS as error:  # (an answer that does not decode may follow a landed write)
            if not await self._undo(pod, node, values, version, error):
                return f"binding {pod.key} to {node} failed: {error_text(error)}"
            # The binding went through although its answer was an error (a timeout, a retried
            # request): the pod holds these ids now, so they are kept.
        except BaseException:  # cancelled (shutdown) or a bug: never leave the hold behind
            for reserver in self.reservers:
                reserver.unreserve(pod, node)
            raise
        ids = values[handoff.IDS]
        # One line per bind (a line cost as much as a tenth of bind's own work, issue 50).
        log.info(
            "Allocated ids for POD %s are: %s (bound to Node:%s, %s; devices %s, cores %s)",
            loggable(pod.key),
            ids,
            loggable(node),
            request.describe(),
            format_ids(placement.devices),
            format_ids(placement.cores),
        )
        self.metrics.binds.labels("success").inc()
        self.events.record(
            ObjectRef.of_pod(pod),
            "NeuronAllocated",
            f"Bound to {node} with {request.resource} ids {ids} (devices {values[handoff.DEVS]})",
            warning=False,
        )
        return ""

    async def _undo(
        self,
        pod: Pod,
        node: str,
        written: dict[str, str],
        version: str | None,
        error: BaseException,
    ) -> bool:
        """After an API error: True when the pod is bound to `node` with these ids anyway (keep
        everything). Else this attempt's hold goes once its Binding can no longer land, and
        stays (see `Attempt`) while it still may."""
        attempt = Attempt(pod, node, written, version)
        outcome, removed = await self._settle(attempt)
        if outcome is Outcome.BOUND:
            log.warning(
                "bind of %s to %s reported %s, but the pod is bound; keeping its ids",
                loggable(pod.key),
                loggable(node),
                loggable(error),
            )
            return True
        if outcome is Outcome.SETTLED:
            self._let_go(attempt)
            after = "rolled back its reservation" + (" and annotations" if removed else "")
        else:
            self._keep_open(attempt)
            self.metrics.unsettled.inc()
            after = (
                "its Binding may still land, so its devices stay held until it cannot (at most "
                f"{ANNOUNCED_SECONDS:.0f}s, or until the pod's next bind settles it)"
            )
        self.metrics.rollbacks.inc()
        self.metrics.binds.labels("failure").inc()
        log.warning(
            "bind of %s to %s failed (%s); %s",
            loggable(pod.key),
            loggable(node),
            loggable(error),
            after,
        )
        self._warn(pod, "FailedNeuronAllocation", f"binding failed: {error} (node {node})")
        return False

    async def _settle(self, attempt: Attempt) -> tuple[Outcome, bool]:
        """What became of a bind attempt whose writes met an API error, made final where it is
        not yet: while the pod is unbound, still as the attempt's Binding expects it and carries
        its annotations, removing them (on that resourceVersion) both tidies up and changes the
        pod, so the Binding can no longer land. Also whether the annotations were removed."""
        pod, version = attempt.pod, attempt.version
        meta = pod.metadata
        ours = attempt.written[handoff.ALLOC_TIME]
        fenced = version is None  # no Binding was sent
        for _ in range(SETTLE_ATTEMPTS):
            try:
                fresh = await self.api.get_pod(meta.namespace, meta.name)
            except NotFound:
                return Outcome.SETTLED, False  # gone: nothing can land on it, nothing to remove
            except READ_ERRORS as problem:
                log.warning(
                    "could not read %s to settle its bind: %s", loggable(pod.key), loggable(problem)
                )
                continue
            if fresh.metadata.uid != meta.uid:
                return Outcome.SETTLED, False
            carries_ours = fresh.metadata.annotations.get(handoff.ALLOC_TIME) == ours
            if fresh.spec.nodeName:
                bound_here = fresh.spec.nodeName == attempt.node and carries_ours
                return (Outcome.BOUND if bound_here else Outcome.SETTLED), False
            fenced = fenced or fresh.metadata.resourceVersion != version
            if not carries_ours:
                # Our patch never landed (so no Binding was sent; should it land late, its ids
                # hold nothing), or the pod changed since it did (so the Binding, conditioned on
                # the patched pod, cannot land).
                self.ledger.disown(pod, ours)
                return Outcome.SETTLED, False
            try:
                await self.api.patch_annotations(
                    meta.namespace,
                    meta.name,
                    meta.uid,
                    dict(handoff.removal()),
                    resource_version=fresh.metadata.resourceVersion,
                )
                return Outcome.SETTLED, True
            except Conflict:
                continue  # changed since we read it: read again
            except READ_ERRORS as problem:
                log.warning(
                    "could not remove annotations from %s: %s", loggable(pod.key), loggable(problem)
                )
                if fenced:  # they stay on the pod, holding nothing
                    self.ledger.disown(pod, ours)
                    return Outcome.SETTLED, False
        if not fenced:
            return Outcome.OPEN, False
        self.ledger.disown(pod, ours)
        return Outcome.SETTLED, False

    def _keep_open(self, attempt: Attempt) -> None:
        """Holds the attempt's devices while its Binding may still land: until the ids it wrote
        are as old as `ANNOUNCED_SECONDS` (what a restarted extender would hold them for), or
        until a later bind of the pod settles it. The watch lets go earlier when it shows the
        pod bound (its holding then counts them) or deleted."""
        uid = attempt.pod.metadata.uid
        self._open[uid] = attempt
        written_at = int(attempt.written[handoff.ALLOC_TIME][:20]) / 1e9
        left = max(0.0, written_at + ANNOUNCED_SECONDS - time.time())
        asyncio.get_running_loop().call_later(left, self._expire, uid, attempt)

    def _expire(self, uid: str, attempt: Attempt) -> None:
        if self._open.get(uid) is attempt:
            del self._open[uid]
            self._let_go(attempt)

    def _let_go(self, attempt: Attempt) -> None:
        """Gives up this attempt's hold on its node (each reserver keeps what the watch has
        shown by now: a pod bound there all the same still counts there)."""
        for reserver in self.reservers:
            reserver.unreserve(attempt.pod, attempt.node)

    async def _settle_earlier(self, uid: str, key: str) -> str | None:
        """Settles an earlier attempt of this pod whose Binding may still land; the reason not to
        bind now while it still may."""
        attempt = self._open.get(uid)
        if attempt is None:
            return None
        outcome, removed = await self._settle(attempt)
        if outcome is Outcome.OPEN:
            self.metrics.binds.labels("unsettled").inc()
            return (
                f"an earlier binding of pod {key} to {attempt.node} may still land; not binding "
                "it again until that is settled"
            )
        if self._open.get(uid) is not attempt:
            return None  # its time ran out while we looked (`_expire` let go of it)
        del self._open[uid]
        if outcome is Outcome.SETTLED:
            self._let_go(attempt)
        log.info(
            "the earlier bind of %s to %s is settled: %s%s",
            loggable(key),
            loggable(attempt.node),
            "the pod is bound" if outcome is Outcome.BOUND else "its Binding cannot land",
            " (its annotations removed)" if removed else "",
        )
        return None

    def _refusing(self, pod: Pod, node: str) -> str | None:
        """The outcome label of the first node filter that would refuse the pod there now."""
        now = self.clock()
        for node_filter in self.filters:
            if not node_filter.admits(pod, node, now):
                return node_filter.outcome
        return None

    def _not_ours_to_bind(self, pod: Pod, request: NeuronRequest | None, node: str) -> str | None:
        """Why kube-scheduler could never have sent this bind, or None. It binds through an
        extender only pods of the profiles it serves, that request one of the extender's
        managedResources, and only to nodes their own spec allows."""
        if pod.spec.schedulerName not in self.scheduler_names:
            served = ", ".join(sorted(self.scheduler_names))
            return (
                f"its schedulerName is {pod.spec.schedulerName!r}; this extender binds only for "
                f"{served} (--scheduler-name)"
            )
        if request is None:
            return "it requests no Neuron resource (kube-scheduler binds those pods itself)"
        facts = self.ledger.facts.get(node)
        if facts is None:
            unusable = self.ledger.unusable.get(node)
            if unusable is not None:
                return f"node {node} is unusable for Neuron pods: {unusable.reason}"
            return f"node {node} is not a Neuron node in neuron-scheduler's cache"
        return why_not(pod, facts)

    def _already_bound(self, pod: Pod, node: str) -> str:
        entry = self.ledger.nodes.get(node)
        if pod.spec.nodeName == node:
            try:
                ours = assignment(pod, entry.topology.cores_per_device if entry else None)
            except handoff.AnnotationError:
                ours = None
            if ours is not None or servable_request(pod) is None:
                # kube-scheduler retries a bind whose answer it did not get; it already happened
                # (also for a request the extender cannot serve: there is nothing left to do).
                self.metrics.binds.labels("already_bound").inc()
                log.info(
                    "POD %s is already bound to Node:%s; nothing to do",
                    loggable(pod.key),
                    loggable(node),
                )
                return ""
        self.metrics.binds.labels("failure").inc()
        return f"pod {pod.key} is already bound to {pod.spec.nodeName}"

    def _warn(self, pod: Pod, reason: str, message: str) -> None:
        self.events.record(ObjectRef.of_pod(pod), reason, message, warning=True)
