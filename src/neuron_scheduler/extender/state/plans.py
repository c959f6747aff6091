"""The consolidation plans in the cluster, read back from their pods' annotations
(core/planrecord), and the holds each makes in the ledger while it is in flight. No I/O: the
leader's consolidation (extender/loops/consolidating) writes and ends plans; `kubectl neuron
status` and `why` feed the same view from a list, so they show what the extender holds.

A plan's holds (`Ledger.hold`): the block freed for its pod until the pod is bound, and the place
of each moved pod's replacement until a pod of the moved pod's controller with the same request,
created after the plan, is bound (on any node: the first such pod bound takes the place held on
its node, else any). Everything goes when the plan ends: done (its pod bound on the block and every
place taken), bound elsewhere, expired (`until`), cancelled (by the extender, or the annotation
removed) or gone (its pod deleted). A plan whose time was up before it was read holds nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import msgspec

from neuron_scheduler.core.ids import ids_mask
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.planrecord import PLAN_ANNOTATION, PlanError, PlanRecord, decode
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.extender.state.ledger import (
    HOLD_EXPIRED,
    HOLD_RELEASED,
    POD_DELETED,
    Ledger,
    Nomination,
)
from neuron_scheduler.extender.state.movability import Facts, Movability
from neuron_scheduler.extender.state.plugins import PodsOnly
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import epoch, servable_request
from neuron_scheduler.kube.views import pod_uid, replace_all

log = logging.getLogger("neuron_scheduler.extender.consolidating")

# A replacement is created after its plan started, by the API server's clock, in whole seconds:
# one created in the plan's own second reads as up to a second earlier, and that clock may be a
# little behind ours (CLOCK_SKEW). A wider margin (5 s) let pods of a moved pod's controller
# created just before the plan count as its replacements, and the places held for the real ones
# went early: a restarted extender let another pod take one.
CLOCK_SKEW = 1.0


@dataclass(slots=True)
class Active:
    """A plan, as read back from its pod's annotation, and what has become of it."""

    uid: str
    namespace: str
    name: str
    priority: int
    request: NeuronRequest
    record: PlanRecord
    bound: str = ""  # the node its pod got
    satisfied: dict[str, str] = field(default_factory=dict)  # moved pod uid -> replacement's
    ended: str = ""  # why it ended ("" while in flight)
    evicted: int = 0  # evictions this process made for it
    asked: set[str] = field(default_factory=set)  # moved pods this process evicted (or tried)
    busy: bool = False  # its evictions are under way in this process
    # False from `adopt` until the watch shows the annotation: watch events of the pod from
    # before the write (without it) may still arrive, and must not end the plan.
    seen: bool = True
    nominated: bool = False  # this process set (or tried to set) the pod's nomination
    reported: bool = False  # this process sent the events of its pods already evicted

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


# How far ahead of ours another replica's clock may run, at most: a plan that starts later than
# this was not written by an extender, and its lifetime bound (planrecord.MAX_LIFETIME) would not
# hold.
CLOCK_AHEAD = 60.0


class Plans(PodsOnly):
    """Every plan annotated on a pod, by the pod's uid (a view fed by the pod watch; a
    HoldKeeper, as the waker ends plans whose time is up). `on_end(active, outcome)` hears of
    each plan that ends."""

    def __init__(
        self,
        ledger: Ledger,
        movability: Movability,
        wall_clock: Callable[[], float] = time.time,
        on_end: Callable[[Active, str], None] | None = None,
    ) -> None:
        self.ledger = ledger
        self.movability = movability
        self.wall_clock = wall_clock
        self.on_end = on_end
        self.plans: dict[str, Active] = {}
        self.unreadable: dict[str, str] = {}  # pod uid -> an annotation that did not decode

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        replace_all(pods, pod_uid, self.apply_pod, {*self.plans, *self.unreadable}, self.remove_pod)
        for active in list(self.plans.values()):  # replacements listed before their plan
            self._find_replacements(active)

    def apply_pod(self, pod: Pod) -> None:
        self._read_plan(pod, pod.finished or pod.metadata.deletionTimestamp is not None)
        if pod.spec.nodeName and not pod.finished and not pod.metadata.deletionTimestamp:
            self._replacement_bound(pod)

    def remove_pod(self, uid: str) -> None:
        self.unreadable.pop(uid, None)
        active = self.plans.pop(uid, None)
        if active is not None:
            self.end(active, "gone", POD_DELETED)

    def adopt(self, pod: Pod, text: str) -> Active | None:
        """The plan just written on the pod (annotation `text`), held before the watch shows
        it."""
        annotations = {**pod.metadata.annotations, PLAN_ANNOTATION: text}
        meta = msgspec.structs.replace(pod.metadata, annotations=annotations)
        self._read_plan(msgspec.structs.replace(pod, metadata=meta), gone=False)
        active = self.plans.get(pod.metadata.uid)
        if active is not None:
            active.seen = False
        return active

    def _read_plan(self, pod: Pod, gone: bool) -> None:
        uid = pod.metadata.uid
        text = pod.metadata.annotations.get(PLAN_ANNOTATION)
        active = self.plans.get(uid)
        if text is None:
            self.unreadable.pop(uid, None)
            if active is not None and not active.seen:
                return  # an event from before the plan was written
            if active is not None:  # removed: by the leader that ended it, or by a person
                del self.plans[uid]
                self.end(active, "cancelled" if not active.ended else active.ended)
            return
        try:
            record = decode(text)
            if record.started > self.wall_clock() + CLOCK_AHEAD:
                raise PlanError("the plan starts in the future")
        except PlanError as error:
            if self.unreadable.get(uid) != text:
                log.warning(
                    "pod %s: annotation %s is not a plan this version reads (%s); ignored",
                    loggable(pod.key),
                    PLAN_ANNOTATION,
                    loggable(error),
                )
            self.unreadable[uid] = text
            if active is not None:
                del self.plans[uid]
                self.end(active, "cancelled")
            return
        request = servable_request(pod)
        if request is None:
            self.unreadable[uid] = text
            return
        if active is None or active.record != record:
            if active is not None:
                self.end(active, "cancelled")
            active = Active(
                uid,
                pod.metadata.namespace,
                pod.metadata.name,
                pod.spec.priority or 0,
                request,
                record,
            )
            self.plans[uid] = active
            if self.wall_clock() >= record.until:
                active.ended = "expired"  # from before a restart: nothing to hold
            self._find_replacements(active)
        active.seen = True
        if gone:
            del self.plans[uid]
            self.end(active, "gone", POD_DELETED)
            return
        if pod.spec.nodeName and not active.bound:
            active.bound = pod.spec.nodeName
        self._hold(active)
        self._maybe_done(active)

    def _replacement_bound(self, pod: Pod) -> None:
        controller = pod.metadata.controller
        if controller is None or not self.plans:
            return
        facts = self.movability.pods.get(pod.metadata.uid)
        if facts is None:
            return
        for active in self.plans.values():
            if not active.ended and self._take(active, pod.metadata.uid, controller.uid, facts):
                self._hold(active)
                self._maybe_done(active)
                return

    def _find_replacements(self, active: Active) -> None:
        """After a restart: replacements bound before their plan was read."""
        for uid, facts in list(self.movability.pods.items()):
            if facts.bound and facts.owner:
                self._take(active, uid, facts.owner, facts)
        self._hold(active)
        self._maybe_done(active)

    def _take(self, active: Active, uid: str, owner: str, facts: Facts) -> bool:
        """Counts a bound pod as the replacement of one moved pod of its controller with its
        request (the place held on the node it got first), if it was created after the plan."""
        record = active.record
        if uid in active.satisfied.values() or any(v.uid == uid for v in record.victims):
            return False
        if epoch(facts.created) + 1.0 <= record.started - CLOCK_SKEW:  # (whole seconds)
            return False
        open_ = [
            v
            for v in record.victims
            if v.owner == owner and v.request == facts.request and v.uid not in active.satisfied
        ]
        if not open_:
            return False
        chosen = next((v for v in open_ if v.node == facts.bound), open_[0])
        active.satisfied[chosen.uid] = uid
        return True

    def _hold(self, active: Active, cause: str = HOLD_RELEASED) -> None:
        """The ledger's holds for the plan as it stands (none once it ended)."""
        record = active.record
        block = None
        if not active.ended and not active.bound:
            block = Nomination(
                record.node,
                active.request,
                active.priority,
                block=ids_mask(record.cores),
                reason=f"held for {active.key} by a consolidation plan until it is bound",
            )
        self.ledger.hold(active.uid, block, cause, pod=active.key)
        for victim in record.victims:
            if not victim.node:
                continue
            place = None
            if not active.ended and victim.uid not in active.satisfied:
                place = Nomination(
                    victim.node,
                    victim.request,
                    victim.priority,
                    block=ids_mask(victim.cores),
                    owner=victim.owner,
                    reason=f"held for the replacement of {victim.pod} by a consolidation plan "
                    "until it is bound",
                )
            self.ledger.hold(f"{active.uid}/{victim.uid}", place, cause)

    def _maybe_done(self, active: Active) -> None:
        if active.ended or not active.bound:
            return
        if active.bound != active.record.node:
            self.end(active, "bound_elsewhere")
            return
        if all(v.uid in active.satisfied for v in active.record.victims if v.node):
            self.end(active, "done")

    def end(self, active: Active, outcome: str, cause: str = HOLD_RELEASED) -> None:
        """The plan ends (once: a later call only re-syncs its holds, all let go)."""
        first = not active.ended
        active.ended = active.ended or outcome
        self._hold(active, cause)
        if first and self.on_end is not None:
            self.on_end(active, outcome)

    def in_flight(self) -> list[Active]:
        return [a for a in self.plans.values() if not a.ended]

    def planned(self, uid: str) -> bool:
        """The pod has a plan in flight (the preempt verb leaves it to the plan)."""
        active = self.plans.get(uid)
        return active is not None and not active.ended

    # A HoldKeeper (extender/state/plugins): the waker ends plans whose time is up.

    def seconds_to_next_expiry(self) -> float | None:
        live = self.in_flight()
        if not live:
            return None
        return min(a.record.until for a in live) - self.wall_clock()

    def expire(self) -> None:
        now = self.wall_clock()
        for active in self.in_flight():
            if active.record.until <= now:
                self.end(active, "expired", HOLD_EXPIRED)
