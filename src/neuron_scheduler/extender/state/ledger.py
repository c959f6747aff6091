"""Who holds which Neuron cores on which node, rebuilt from the cluster's pods. No I/O.

The only source of truth is the pods themselves: a pod bound to a node and not finished holds the
ids in our annotations (when they are for that node), or, without them, an unknown set of its
requested size. Node annotations are never read: upstream's usage maps in node annotations go stale
across restarts. In-flight binds add reservations until the pod shows up bound with its
annotations, so a filter or a second bind never sees those ids as free.

Everything read from the API is untrusted. A node whose Neuron capacity cannot be right (see
`Catalog.resolve`) is unusable, with its reason, and never modelled. A pod's ids are checked
against its node's topology and against the pod before a mask is built from them (`misfit`: the
ids, cores and devices name the same; `beyond_request`: no more than it asks for); ids that
cannot be that node's or that pod's are rejected (logged once, reported as a warning event on
the pod, counted in `rejected_assignments`) and the pod is counted by its request instead, as a
pod placed by another scheduler is: its size stays held, somewhere on the node, until it ends.

The ledger is a `ClusterView` (the watches feed it) and a `Reserver` (bind holds placements in it).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import filterfalse
from typing import NamedTuple

from neuron_scheduler.core import health
from neuron_scheduler.core.allocation import (
    Decision,
    NodeState,
    Placement,
    Policy,
    Refusal,
    allocate,
)
from neuron_scheduler.core.catalog import CapacityError, Catalog
from neuron_scheduler.core.demand import Demand
from neuron_scheduler.core.eviction import Occupant
from neuron_scheduler.core.handoff import (
    ALLOC_TIME,
    NODE,
    AnnotationError,
    beyond_request,
    misfit,
)
from neuron_scheduler.core.handoff import decode as decode_annotations
from neuron_scheduler.core.ids import (
    core_mask_of_devices,
    devices_touched,
    format_ids,
    mask_ids,
)
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest, RequestError, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.kube.events import Report
from neuron_scheduler.kube.kueue import hold_owner
from neuron_scheduler.kube.nodefit import NodeFacts
from neuron_scheduler.kube.objects import Node, ObjectRef, Pod
from neuron_scheduler.kube.reading import (
    SidecarRequest,
    assignment,
    epoch,
    held_by_others,
    neuron_request,
    node_topology,
    unhealthy_devices,
)
from neuron_scheduler.kube.views import node_name, pod_uid, replace_all

# Why a node's room grew (or may have), as the ledger tells its `on_freed` listener (the waker).
POD_DELETED = "pod_deleted"
POD_FINISHED = "pod_finished"
POD_CHANGED = "pod_changed"
NODE_CHANGED = "node_changed"
NOMINATION_ENDED = "nomination_ended"
BIND_RELEASED = "bind_released"
HOLD_EXPIRED = "hold_expired"
HOLD_RELEASED = "hold_released"

# Named as before the split into sub-packages: log names are what operators filter on.
log = logging.getLogger("neuron_scheduler.extender.ledger")
UNIT_RESOURCE = {Unit.DEVICE: NEURON, Unit.CORE: NEURONCORE}


@dataclass(frozen=True, slots=True)
class NodeEntry:
    name: str
    topology: Topology
    warning: str | None
    # Capacity the node does not offer (allocatable below capacity) beyond its failed devices:
    # held in count, as its ids are unknown.
    withheld_cores: int
    # Devices its device plugin reports failed (a mask; core/health): in use for every decision,
    # neither free nor any pod's.
    unhealthy_devices: int = 0

    @property
    def unhealthy_cores(self) -> int:
        return core_mask_of_devices(self.unhealthy_devices, self.topology.cores_per_device)


@dataclass(frozen=True, slots=True)
class Holding:
    """What one pod holds on one node: known cores, or a count whose ids we do not know; and
    what a preemption needs to weigh it (its priority, since when it runs, its labels for
    disruption budgets, whether it is already going)."""

    node: str
    cores: int = 0  # mask
    unknown_count: int = 0  # in `unknown_unit`s
    unknown_unit: Unit = Unit.CORE
    ours: bool = False  # ids come from our annotations for this node
    priority: int = 0
    started: str = ""  # RFC 3339 (sorts as time): status.startTime, else creation
    terminating: bool = False
    leaving_by: str = ""  # RFC 3339: deletionTimestamp, when its grace period ends
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Nomination:
    """A pod kube-scheduler preempted others for, waiting for its node (status.nominatedNodeName):
    the block it will get is held for it, as kube-scheduler holds its resources by count.

    A consolidation plan's holds (`hold`) are Nominations too, with the exact cores it freed
    (`block`): the pending pod's block, and the place of each moved pod's replacement, which
    any pod of the moved pod's controller (`owner`) with the same request may take. `reason`
    names such a hold where a refusal cites it."""

    node: str
    request: NeuronRequest
    priority: int
    block: int = 0  # cores held, exactly; 0: where the allocator would place the pod
    owner: str = ""  # held for a pod of this controller (uid) with `request`, not one pod
    reason: str = ""


LOWEST_PRIORITY = -(2**31)


class Claimant(NamedTuple):  # (not a frozen dataclass: built at every verb, issue 50)
    """The pod a node's state is read for. Blocks held for nominated pods count against it only
    when their priority is at least its own (kube-scheduler's rule for nominated pods'
    resources), and a nominated pod does not see its own block, nor a replacement the place held
    for it (its controller's `owner` uid and its `request`). The default, an unnamed pod of the
    lowest priority, sees every hold."""

    uid: str = ""
    priority: int = LOWEST_PRIORITY
    owner: str = ""
    request: NeuronRequest | None = None
    # The Kueue workload whose held blocks it may take (kube.kueue.hold_owner), "" for none.
    admitted: str = ""

    @classmethod
    def of(cls, pod: Pod, request: NeuronRequest | None = None) -> Claimant:
        controller = pod.metadata.controller
        owner = controller.uid if controller is not None else ""
        return cls(pod.metadata.uid, pod.spec.priority or 0, owner, request, hold_owner(pod))


UNNAMED = Claimant()  # an unnamed pod of the lowest priority: it sees every hold


@dataclass(frozen=True, slots=True)
class Unusable:
    """A node left out of placement, and why (`code` labels the metric)."""

    code: str
    reason: str


# A node's mark in Verdicts.marks when its decision is a Refusal (a Placement's is its score,
# 0-10), and what filter reads for a node not decided yet.
REFUSED = -1
UNDECIDED = -2


class Verdicts:
    """The allocator's decision for one request shape on each node asked about so far.

    filter and prioritize ask about hundreds of nodes per call while a node's state changes only
    when a pod lands on it or leaves, so decisions are kept until their node changes.
    """

    __slots__ = ("decisions", "forgotten", "marks")

    def __init__(self) -> None:
        self.decisions: dict[str, Decision] = {}
        # Each decided node's fit score, or REFUSED: filter reads whether its nodes fit and
        # prioritize's scores in one pass over the names (issue 50).
        self.marks: dict[str, int] = {}
        # How many decisions were dropped so far: while it stays the same, and these are still
        # the ledger's verdicts for their request (Ledger.verdicts), every answer read from them
        # stands (decisions are only ever added in between).
        self.forgotten = 0

    def fitting(self) -> list[str]:
        """The nodes whose decision is a Placement (a pass over every kept mark)."""
        return [node for node, mark in self.marks.items() if mark >= 0]

    def score(self, node: str) -> int | None:
        """prioritize's score for a decided node: its fit score, 0 when refused."""
        mark = self.marks.get(node)
        return None if mark is None else max(mark, 0)

    def forget(self, node: str) -> None:
        if self.decisions.pop(node, None) is not None:
            del self.marks[node]
            self.forgotten += 1


# How long the ids a bind wrote on a pod that is not bound (yet) stay held: its Binding may still
# land that long after it was sent (kube-apiserver's request timeout is a minute), and after the
# extender that sent it was killed or gave up on it.
ANNOUNCED_SECONDS = 90.0


class Announced(NamedTuple):
    """Ids a bind wrote on a pending pod."""

    holding: Holding
    until: float  # wall clock: held until then
    written_at: str  # their NEURON_ALLOC_TIME


# Request shapes in a cluster are few (a handful of sizes per resource); this bounds memory when
# they are not: 5,000 nodes x 64 shapes is ~30 MB at worst.
MAX_REQUEST_SHAPES = 64


class Ledger:
    def __init__(
        self,
        catalog: Catalog,
        report: Report | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`report`: told about nodes and pods whose Neuron data cannot be used (the extender
        turns it into warning events); `clock`: the watches' (when a reservation was made);
        `wall_clock`: the one `NEURON_ALLOC_TIME` is written with."""
        self.catalog = catalog
        self.report = report
        self.clock = clock
        self.wall_clock = wall_clock
        self.nodes: dict[str, NodeEntry] = {}
        self.facts: dict[str, NodeFacts] = {}  # labels and taints, for bind's re-check
        self.unusable: dict[str, Unusable] = {}
        self._health_problems: dict[str, str] = {}  # node -> why its health annotation is unread
        self.rejected_assignments: Counter[str] = Counter()  # by reason code, for metrics
        self._holdings: dict[str, Holding] = {}  # pod uid -> holding
        self._by_node: dict[str, dict[str, Holding]] = {}
        self._reservations: dict[str, Holding] = {}  # pod uid -> in-flight bind
        self._reserved_at: dict[str, float] = {}  # pod uid -> clock() when reserved
        # Pending pods carrying the ids a bind wrote (its Binding may still land).
        self._announced: dict[str, Announced] = {}
        self._next_expiry = float("inf")  # no announced hold ends before this (wall clock)
        # Pending pods whose annotations (by their NEURON_ALLOC_TIME) this extender knows no
        # Binding can follow any more (`disown`): they hold nothing.
        self._disowned: dict[str, str] = {}
        self._pod_keys: dict[str, str] = {}  # pod uid -> namespace/name
        self._rejected: set[str] = set()  # pod uids whose ids were rejected, reported once
        self.nominations: dict[str, Nomination] = {}  # pod uid -> the node it waits for
        # Holds of consolidation plans (`hold`): by the pending pod's uid (its block), or
        # "<its uid>/<moved pod's uid>" (a replacement's place). A pod's block held here stands
        # for its nomination, if it has one.
        self.plan_holds: dict[str, Nomination] = {}
        self._held: set[str] = set()  # nominations whose held block was reported once
        self._states: dict[str, NodeState] = {}
        # (unit, count, policy, nominated owner, lower nomination priorities passed over)
        self._verdicts: dict[tuple[Unit, int, Policy, str, tuple[int, ...]], Verdicts] = {}
        # What the cluster asks for: every pod with a Neuron request counts once, when it is
        # first seen (a restart counts the pods it lists). Kept decisions were made with one
        # snapshot of it (`_verdicts_demand`, its version) and are dropped when it changes.
        self.demand = Demand()
        self._counted: set[str] = set()  # pod uids already in `demand`
        self._verdicts_demand = 0
        self.decisions = 0  # made by fill_verdicts (the rest were kept), for the metrics
        # Told which nodes got room back, and why (the waker); never about room taken.
        self.on_freed: Callable[[Iterable[str], str], None] | None = None
        # Told when a hold with a deadline starts (the waker ends it when due).
        self.on_deadline: Callable[[], None] | None = None
        # Told when a node's failed devices change (pods on them are told at once).
        self.on_health: Callable[[], None] | None = None

    # --- nodes -------------------------------------------------------------------------------

    def apply_node(self, node: Node) -> None:
        name = node.metadata.name
        try:
            resolved = node_topology(node, self.catalog)
        except CapacityError as error:
            self._set_unusable(node, Unusable(error.code, str(error)))
            return
        if resolved is None:
            self.remove_node(name)
            return
        if self.unusable.pop(name, None) is not None:
            log.info("node %s: its Neuron capacity is usable again", loggable(name))
        if resolved.warning and (name not in self.nodes or self.nodes[name].warning is None):
            log.warning("node %s: %s", loggable(name), loggable(resolved.warning))
        topology = resolved.topology
        unhealthy = self._read_health(node, topology)
        entry = NodeEntry(
            name,
            topology,
            resolved.warning,
            held_by_others(node, topology, unhealthy),
            unhealthy,
        )
        if unhealthy != (self.nodes[name].unhealthy_devices if name in self.nodes else 0):
            if unhealthy:
                log.warning(
                    "node %s: %s failed (its device plugin says): never placed on",
                    loggable(name),
                    health.describe(unhealthy),
                )
            else:
                log.info("node %s: every device is healthy again", loggable(name))
            if self.on_health is not None:
                self.on_health()
        self.facts[name] = NodeFacts.of(node)  # never part of a decision: kept verdicts stay
        if self.nodes.get(name) != entry:
            self.nodes[name] = entry
            self._invalidate(name, NODE_CHANGED, entry_changed=True)

    def _read_health(self, node: Node, topology: Topology) -> int:
        """The node's failed devices; none when what its plugin published cannot be read (then
        the capacity the node withholds is held in count, as without the annotation)."""
        name = node.metadata.name
        try:
            unhealthy = unhealthy_devices(node, topology)
        except health.HealthError as error:
            problem = str(error)
            if self._health_problems.get(name) != problem:
                self._health_problems[name] = problem
                text = f"{problem}; its withheld capacity is held in count instead"
                log.warning("node %s: %s", loggable(name), loggable(text))
                if self.report is not None:
                    self.report(ObjectRef.of_node(node), "NeuronHealthUnreadable", text, True)
            return 0
        self._health_problems.pop(name, None)
        return unhealthy

    def _set_unusable(self, node: Node, problem: Unusable) -> None:
        name = node.metadata.name
        if self.unusable.get(name) != problem:
            self.unusable[name] = problem
            log.warning(
                "node %s is unusable for Neuron pods: %s", loggable(name), loggable(problem.reason)
            )
            if self.report is not None:
                self.report(ObjectRef.of_node(node), "NeuronCapacityUnusable", problem.reason, True)
        self.facts.pop(name, None)
        if self.nodes.pop(name, None) is not None:
            self._invalidate(name)

    def remove_node(self, name: str) -> None:
        self.unusable.pop(name, None)
        self._health_problems.pop(name, None)
        self.facts.pop(name, None)
        if self.nodes.pop(name, None) is not None:
            self._invalidate(name)

    def replace_nodes(self, nodes: Iterable[Node]) -> None:
        known = [*self.nodes, *self.unusable]
        replace_all(nodes, node_name, self.apply_node, known, self.remove_node)

    # --- pods --------------------------------------------------------------------------------

    def apply_pod(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        self._pod_keys[uid] = pod.key
        if uid not in self._counted and not pod.finished:
            self._count_demand(pod)
        self._nominate(pod)
        holding = self._holding_of(pod)
        previous = self._holdings.get(uid)
        if holding != previous:
            if previous is not None:
                self._drop(uid, previous, POD_FINISHED if pod.finished else POD_CHANGED)
            if holding is not None:
                self._holdings[uid] = holding
                self._by_node.setdefault(holding.node, {})[uid] = holding
                self._invalidate(holding.node)
        self._announce(uid, self._announced_of(pod), POD_CHANGED)
        reservation = self._reservations.get(uid)
        if reservation is not None and (pod.finished or (holding is not None and holding.ours)):
            # The watch now shows what the bind wrote (or the pod is gone): the reservation has
            # done its job.
            self._release(uid, POD_FINISHED if pod.finished else None)
        if holding is None and not self._keeps_key(uid):
            self._pod_keys.pop(uid, None)
        self._announce_holds()

    def _count_demand(self, pod: Pod) -> None:
        try:
            request = neuron_request(pod)
        except RequestError:
            return  # no node can serve it: not a shape worth keeping room for
        if request is not None:
            self.demand.record(request.unit, request.count)
            self._counted.add(pod.metadata.uid)

    def remove_pod(self, uid: str) -> None:
        self._counted.discard(uid)
        previous = self._holdings.get(uid)
        if previous is not None:
            self._drop(uid, previous, POD_DELETED)
        self._release(uid, POD_DELETED)
        self._announce(uid, None, POD_DELETED)
        self._disowned.pop(uid, None)
        nomination = self.nominations.pop(uid, None)
        if nomination is not None:
            self._invalidate(nomination.node, POD_DELETED)
        self._pod_keys.pop(uid, None)
        self._rejected.discard(uid)
        self._held.discard(uid)
        self._announce_holds()

    def _announce_holds(self) -> None:
        """A nominated pod hears which block it will get as soon as its victims are leaving
        (holds are otherwise worked out only when someone reads the node)."""
        if self.report is None or not self.holds_anything():
            return
        for node in {n.node for uid, n in self.holds() if uid not in self._held}:
            self.state(node)

    def _nominate(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        node = pod.status.nominatedNodeName
        nomination = None
        if node and not pod.spec.nodeName and not pod.finished:
            try:
                request = neuron_request(pod)
            except RequestError:
                request = None
            if request is not None:
                nomination = Nomination(node, request, pod.spec.priority or 0)
        previous = self.nominations.get(uid)
        if nomination == previous:
            return
        if previous is not None:
            del self.nominations[uid]
            self._invalidate(previous.node, NOMINATION_ENDED)
            self._held.discard(uid)
        if nomination is not None:
            self.nominations[uid] = nomination
            self._invalidate(nomination.node)

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        """A full list (asked for at `listed_since`, by `clock`): what it lacks was deleted while
        the watch was down. That includes a reservation made before the list was asked for: its
        bind read the pod first, so a list without it is one taken after the pod was deleted
        (otherwise the reservation would wait for a watch event that never comes). A later
        reservation stays: its pod may be newer than the list."""
        known = [*self._holdings, *self.nominations, *self._announced, *self._counted]
        known += self._disowned
        known += [uid for uid, at in self._reserved_at.items() if at < listed_since]
        replace_all(pods, pod_uid, self.apply_pod, dict.fromkeys(known), self.remove_pod)

    def _drop(self, uid: str, holding: Holding, cause: str) -> None:
        del self._holdings[uid]
        on_node = self._by_node.get(holding.node, {})
        on_node.pop(uid, None)
        if not on_node:
            self._by_node.pop(holding.node, None)
        self._invalidate(holding.node, cause)

    def _keeps_key(self, uid: str) -> bool:
        return (
            uid in self._reservations
            or uid in self.nominations
            or uid in self._announced
            or uid in self.plan_holds
        )

    # --- holds of consolidation plans ----------------------------------------------------------

    def hold(
        self, key: str, held: Nomination | None, cause: str = HOLD_RELEASED, pod: str = ""
    ) -> None:
        """Holds `held` under `key` (see `plan_holds`; `pod`: the namespace/name of the pod a
        block is held for, named in its NeuronBlockHeld event), or lets go of what is held
        there (then `cause` says why the room came back)."""
        previous = self.plan_holds.get(key)
        if pod:
            self._pod_keys[key] = pod
        if previous == held:
            return
        if previous is not None:
            del self.plan_holds[key]
            self._held.discard(key)
            if key not in self._holdings and not self._keeps_key(key):
                self._pod_keys.pop(key, None)
            self._invalidate(previous.node, cause)
        if held is not None:
            self.plan_holds[key] = held
            self._invalidate(held.node)
        self._announce_holds()

    def holds(self) -> Iterable[tuple[str, Nomination]]:
        """Every block held for a pod that is not bound yet: nominations (those a plan's block
        does not stand for) and plans' holds."""
        plans = self.plan_holds
        for uid, nomination in self.nominations.items():
            if uid not in plans:
                yield uid, nomination
        yield from plans.items()

    def holds_anything(self) -> bool:
        """Whether any block is held (usually none: every check of holds starts here)."""
        return bool(self.nominations or self.plan_holds)

    def holds_on(self, node: str) -> bool:
        return self.holds_anything() and any(n.node == node for _, n in self.holds())

    @staticmethod
    def _passes(claimant: Claimant, key: str, held: Nomination) -> bool:
        """Whether the claimant may take what is held under `key`: its own, one of lower
        priority, a replacement's place it is a replacement for, or a block held for the Kueue
        workload it is a pod of (with its request)."""
        if key == claimant.uid or held.priority < claimant.priority:
            return True
        return (
            bool(held.owner)
            and held.owner in (claimant.owner, claimant.admitted)
            and held.request == claimant.request
        )

    def disown(self, pod: Pod, alloc_time: str) -> None:
        """The annotations a failed bind wrote on this pending pod (`alloc_time`) stay there
        (they could not be removed), but no Binding can follow them any more (the pod changed
        since, or none was sent): they hold nothing, so the devices are free at once, not only
        `ANNOUNCED_SECONDS` after they were written (kube-scheduler hears of no event when a hold
        ends, so pods waiting for those devices would wait for its periodic retry)."""
        uid = pod.metadata.uid
        self._disowned[uid] = alloc_time
        announced = self._announced.get(uid)
        if announced is not None and announced.written_at == alloc_time:  # not others' since
            self._announce(uid, None, HOLD_RELEASED)

    def _announced_of(self, pod: Pod) -> Announced | None:
        """The ids a bind wrote on this pending pod, and until when they are held: its Binding
        was sent, or is about to be, and may land after this extender (or the one before it,
        killed meanwhile) stopped waiting for it. Ids for another node, disowned ones, or from
        longer ago than `ANNOUNCED_SECONDS`, hold nothing."""
        uid = pod.metadata.uid
        if pod.spec.nodeName or pod.finished:
            self._disowned.pop(uid, None)
            return None
        annotations = pod.metadata.annotations
        if ALLOC_TIME not in annotations:
            return None  # (perhaps an older version of the pod: a disowned one stays so)
        disowned = self._disowned.get(uid)
        if disowned is not None:
            if disowned == annotations[ALLOC_TIME]:
                return None
            if disowned < annotations[ALLOC_TIME]:
                del self._disowned[uid]  # a later bind wrote others
        entry = self.nodes.get(annotations.get(NODE, ""))
        if entry is None:
            return None
        try:
            # Our bind writes ids only on a pod asking for that much: any other pending pod
            # carrying them (anyone may write them) holds nothing.
            request = neuron_request(pod)
            written = int(annotations[ALLOC_TIME][:20]) / 1e9
            found = decode_annotations(annotations, entry.topology.cores_per_device)
        except (ValueError, AnnotationError):  # (RequestError is a ValueError)
            return None
        # A time to come is no bind's (a clock a little ahead at most): held from now, not for
        # as long as someone wrote.
        now = self.wall_clock()
        until = min(written, now) + ANNOUNCED_SECONDS
        if (
            request is None
            or found is None
            or misfit(found, entry.topology)
            or beyond_request(found, request)
            or until <= now
        ):
            return None
        holding = Holding(entry.name, cores=found.core_mask, ours=True)
        return Announced(holding, until, annotations[ALLOC_TIME])

    def _announce(self, uid: str, announced: Announced | None, cause: str) -> None:
        """`cause`: why the ids held before, if any, are let go."""
        previous = self._announced.pop(uid, None)
        if announced is not None:
            self._announced[uid] = announced
            self._next_expiry = min(self._next_expiry, announced.until)
        if previous is not None and announced is not None and previous.holding == announced.holding:
            return  # the same ids held: nothing derived from them changes
        if previous is not None:
            self._invalidate(previous.holding.node, cause)
        if announced is not None:
            self._invalidate(announced.holding.node)
            if self.on_deadline is not None:
                self.on_deadline()

    def _expire_announced(self) -> None:
        """Drops the held ids whose time is up (checked on every read, and by the waker when the
        next is due: usually none are held)."""
        if not self._announced:
            return
        now = self.wall_clock()
        if now < self._next_expiry:  # (read on every decision: a scan each time was visible)
            return
        for uid in [u for u, announced in self._announced.items() if announced.until <= now]:
            self._announce(uid, None, HOLD_EXPIRED)
        self._next_expiry = min((a.until for a in self._announced.values()), default=float("inf"))

    # A HoldKeeper (extender/state/plugins): the waker ends announced holds when they are due.

    def seconds_to_next_expiry(self) -> float | None:
        if not self._announced:
            return None
        return min(a.until for a in self._announced.values()) - self.wall_clock()

    def expire(self) -> None:
        self._expire_announced()

    def _holding_of(self, pod: Pod) -> Holding | None:
        node = pod.spec.nodeName
        if not node or pod.finished:
            return None
        sidecar = False
        try:
            request = neuron_request(pod)
        except SidecarRequest as error:
            request, sidecar = error.held, True
        except RequestError as error:
            log.warning(
                "pod %s on %s: %s; not counted", loggable(pod.key), loggable(node), loggable(error)
            )
            return None
        if request is None:
            return None  # the device plugin's own pod, and every non-Neuron pod
        entry = self.nodes.get(node)
        try:
            found = assignment(pod, entry.topology.cores_per_device if entry else None)
        except AnnotationError as error:
            if entry is not None:  # without the node, its cores per device may be what is missing
                self._reject(pod.metadata.uid, pod.key, node, request, str(error))
            found = None
        if found is not None:
            problem = beyond_request(found, request)
            if problem is None and entry is not None:
                problem = misfit(found, entry.topology)
            if problem is not None:
                self._reject(pod.metadata.uid, pod.key, node, request, problem)
                found = None
        if sidecar and found is not None and len(found.ids) < request.count:
            # Ids a bind wrote before sidecars were refused, sized as if the sidecar's devices
            # were reused: kubelet holds more than they say, so the pod counts by its size.
            found = None
        # Without our ids (placed by another scheduler, or ids that cannot be used) the pod's
        # size still counts. On a node not listed (yet, or again: its capacity goes while its
        # kubelet restarts), ids are kept: cores beyond the node are rejected when it is listed
        # (state), the rest of `misfit` at the pod's next change.
        return Holding(
            node,
            cores=found.core_mask if found is not None else 0,
            unknown_count=request.count,
            unknown_unit=request.unit,
            ours=found is not None,
            priority=pod.spec.priority or 0,
            started=pod.status.startTime or pod.metadata.creationTimestamp or "",
            terminating=pod.metadata.deletionTimestamp is not None,
            leaving_by=pod.metadata.deletionTimestamp or "",
            labels=pod.metadata.labels,
        )

    def _reject(self, uid: str, key: str, node: str, request: NeuronRequest, problem: str) -> None:
        """Ids that cannot be this node's: reported once per pod; the pod counts by its size."""
        if uid in self._rejected:
            return
        self._rejected.add(uid)
        self.rejected_assignments["annotations"] += 1
        message = (
            f"Neuron ids in the annotations are not used: {problem}; the pod's "
            f"{request.describe()} stays held on {node} until it ends"
        )
        log.warning("pod %s on %s: %s", loggable(key), loggable(node), loggable(message))
        if self.report is not None:
            namespace, _, name = key.partition("/")
            pod = ObjectRef("Pod", namespace, name, uid)
            self.report(pod, "NeuronAnnotationsRejected", message, True)

    # --- in-flight binds ---------------------------------------------------------------------

    def reserve(self, pod: Pod, node: str, placement: Placement) -> None:
        uid = pod.metadata.uid
        self._reservations[uid] = Holding(node, cores=placement.core_mask, ours=True)
        self._reserved_at[uid] = self.clock()
        self._pod_keys[uid] = pod.key
        self._invalidate(node)

    def unreserve(self, pod: Pod, node: str) -> None:
        reservation = self._reservations.get(pod.metadata.uid)
        if reservation is not None and reservation.node == node:
            self._release(pod.metadata.uid, BIND_RELEASED)

    def _release(self, uid: str, cause: str | None = None) -> None:
        """`cause`: why the room comes back, when it does (not when the watch has shown the
        pod bound with the same ids)."""
        reservation = self._reservations.pop(uid, None)
        self._reserved_at.pop(uid, None)
        if reservation is not None:
            self._invalidate(reservation.node, cause)

    def _invalidate(self, node: str, freed: str | None = None, entry_changed: bool = False) -> None:
        """The node's holdings or topology (`entry_changed`) changed: drop what was derived
        from them. `freed`: why room may have come back (the listener hears of it).

        A bind changes its node's state once (its hold), then the watch shows the same cores
        twice more (the pod's announced ids, then the pod bound with them): when the cores in
        use are still those the node's kept state says, with no block held there, the decisions
        made from that state stand (issue 50: filters decided them again, at a visible cost).
        Those made for a claimant that sees the node otherwise (its own held block, or holds of
        lower priority passed over) are dropped all the same."""
        kept = self._states.pop(node, None)
        if (
            kept is not None
            and not entry_changed
            and node in self.nodes
            and not self.holds_on(node)
            and self._state(node) == kept
        ):
            self._states[node] = kept
            for (_, _, _, owner, passed), verdicts in self._verdicts.items():
                if owner or passed:
                    verdicts.forget(node)
        else:
            for verdicts in self._verdicts.values():
                verdicts.forget(node)
        if freed is not None and self.on_freed is not None:
            self.on_freed((node,), freed)

    # --- reading -----------------------------------------------------------------------------

    def verdicts(
        self, request: NeuronRequest, policy: Policy, claimant: Claimant = UNNAMED
    ) -> Verdicts:
        """What is kept for this request shape: every decision in it is current, though it may
        not cover every node yet (`fill_verdicts` fills it in). Claimants that see the same holds
        share them: a nominated pod has its own, and so does each set of lower nomination
        priorities a claimant's priority passes over (usually none: no nominations)."""
        self._expire_announced()
        owner = (
            claimant.uid
            if claimant.uid in self.nominations
            or claimant.uid in self._announced
            or self._own_plan_hold(claimant)
            else ""
        )
        passed = (
            tuple(sorted({n.priority for _, n in self.holds() if n.priority < claimant.priority}))
            if self.holds_anything()
            else ()  # (usually: nothing is held, and this is asked a few times a pod)
        )
        if self.demand.version != self._verdicts_demand:
            self._verdicts.clear()  # made with what the cluster asked for before
            self._verdicts_demand = self.demand.version
        key = (request.unit, request.count, policy, owner, passed)
        verdicts = self._verdicts.get(key)
        if verdicts is None:
            if len(self._verdicts) >= MAX_REQUEST_SHAPES:
                del self._verdicts[next(iter(self._verdicts))]  # the oldest shape
            verdicts = self._verdicts[key] = Verdicts()
        return verdicts

    def fill_verdicts(
        self,
        names: Iterable[str],
        request: NeuronRequest,
        policy: Policy,
        claimant: Claimant = UNNAMED,
    ) -> Verdicts:
        """Decisions for `request` on every named node that is in the cache (others are left
        out of the result's `decisions`)."""
        verdicts = self.verdicts(request, policy, claimant)
        decisions = verdicts.decisions
        # Only the nodes not decided yet, found in C: a filter names hundreds, few of them new.
        for name in list(filterfalse(decisions.__contains__, names)):
            entry = self.nodes.get(name)
            if entry is None:
                continue
            state = self.state_for(claimant, name)
            decision = allocate(entry.topology, state, request, policy, self.demand.weights)
            if entry.unhealthy_devices and isinstance(decision, Refusal):
                decision = self.failed_devices_refusal(name, request, decision)
            self.decisions += 1
            decisions[name] = decision
            verdicts.marks[name] = decision.score if isinstance(decision, Placement) else REFUSED
        return verdicts

    def state(self, node: str) -> NodeState:
        """The node's cores in use: bound pods, in-flight binds, counts with unknown ids, and the
        blocks held for pods nominated to it."""
        self._expire_announced()
        cached = self._states.get(node)
        if cached is not None:
            return cached
        state = self._state(node)
        self._states[node] = state
        return state

    def state_for(self, claimant: Claimant, node: str) -> NodeState:
        """The node as this pod sees it: without its own held block (nominated, or the ids an
        earlier bind of it wrote), and without the blocks held for pods of lower priority."""
        self._expire_announced()
        passed = self._passed_holds(claimant, node)
        if claimant.uid in self._announced:
            passed |= {claimant.uid}
        return self._state(node, passed) if passed else self.state(node)

    def _passed_holds(self, claimant: Claimant, node: str) -> frozenset[str]:
        if not self.holds_anything():
            return frozenset()
        return frozenset(
            key for key, n in self.holds() if n.node == node and self._passes(claimant, key, n)
        )

    def _own_plan_hold(self, claimant: Claimant) -> bool:
        """A plan holds something for this very pod (its block, or its place as a
        replacement): it sees the nodes unlike any other pod."""
        if not self.plan_holds:
            return False
        return claimant.uid in self.plan_holds or any(
            n.owner and self._passes(claimant, key, n) and n.priority >= claimant.priority
            for key, n in self.plan_holds.items()
        )

    def failed_devices_refusal(
        self, node: str, request: NeuronRequest, refusal: Refusal
    ) -> Refusal:
        """A refusal on a node with failed devices says so, and is unresolvable when the node
        could not take the request with every pod gone: the failed devices alone are in the way
        (kube-scheduler then preempts nothing there for it)."""
        entry = self.nodes.get(node)
        if entry is None or not entry.unhealthy_devices:
            return refusal
        note = f"{refusal.reason} ({health.describe(entry.unhealthy_devices)} failed)"
        if refusal.unresolvable:
            return Refusal(note, True)
        alone = NodeState(entry.unhealthy_cores, entry.withheld_cores)
        return Refusal(note, isinstance(allocate(entry.topology, alone, request), Refusal))

    def hold_reason(
        self, claimant: Claimant, node: str, request: NeuronRequest, policy: Policy
    ) -> str | None:
        """Why a pod that fits but for blocks held on the node does not: who they are held for."""
        if not self.holds_anything():
            return None  # nothing is held (the usual case; asked for each node that refused)
        entry = self.nodes.get(node)
        passed = self._passed_holds(claimant, node)
        holders = [(key, n) for key, n in self.holds() if n.node == node and key not in passed]
        if entry is None or not holders:
            return None
        unheld = self._state(node, frozenset(key for key, _ in holders) | passed)
        if not isinstance(allocate(entry.topology, unheld, request, policy), Placement):
            return None
        nominated = [key for key, n in holders if not n.reason]
        reasons = list(dict.fromkeys(n.reason for _, n in holders if n.reason))
        if nominated:
            names = ", ".join(self.pod_key(uid) for uid in nominated[:3])
            more = f" and {len(nominated) - 3} more" if len(nominated) > 3 else ""
            reasons.insert(
                0, f"held for {names}{more}, nominated to this node by preemption, until bound"
            )
        return "devices are " + "; ".join(reasons[:3])

    def _state(self, node: str, excluded: frozenset[str] = frozenset()) -> NodeState:
        """The node's state with the blocks held for the `excluded` nominated pods left out."""
        entry = self.nodes.get(node)
        per_device = entry.topology.cores_per_device if entry else 1
        total = entry.topology.total_cores if entry else 0
        failed = entry.unhealthy_cores if entry else 0
        used = failed
        going = 0  # cores of terminating pods: free soon, so a nominated pod's block may use them
        going_count = 0  # and the cores they hold in count (below)
        unknown = entry.withheld_cores if entry else 0
        holdings = self._by_node.get(node, {})
        in_flight, unbound = self._binds_in_flight(node, holdings, excluded)
        used |= in_flight
        aside = self.set_aside(node, unbound)
        for uid, holding in holdings.items():
            if holding.ours and not holding.cores >> total and uid not in aside:
                used |= holding.cores
                # A pod on a failed device still requests it, while allocatable no longer counts
                # it: kube-scheduler and the kubelet count that device twice until the pod ends,
                # so one more device's worth stays held here too, in count (never freed by
                # evicting anyone but that pod).
                twice = (holding.cores & failed).bit_count()
                unknown += twice
                if holding.terminating:
                    going |= holding.cores & ~failed
                    going_count += twice
                continue
            if holding.ours and holding.cores >> total:  # read while the node was not listed
                request = NeuronRequest(UNIT_RESOURCE[holding.unknown_unit], holding.unknown_count)
                problem = f"cores beyond the {total} of {node}"
                self._reject(uid, self._pod_keys.get(uid, "?/?"), node, request, problem)
            elif holding.ours:
                # Set aside, its ids overlapping another claim: they still count, with its size
                # on top. It may really hold them: ours, bound before a restart read back a
                # stale hold of another pod over them (a disowned write that landed late), or
                # ids the device plugin corrected to what kubelet gave, which knows nothing of a
                # device's cores. Never less than any claim, so no core goes to two pods.
                used |= holding.cores
            size = per_device if holding.unknown_unit is Unit.DEVICE else 1
            unknown += holding.unknown_count * size
        if entry is not None:
            soon = unknown - going_count
            used |= self._held_blocks(node, entry.topology, used, going, soon, excluded)
        return NodeState(used, unknown)

    def _binds_in_flight(
        self, node: str, holdings: Mapping[str, Holding], excluded: frozenset[str] = frozenset()
    ) -> tuple[int, int]:
        """The cores of binds in flight on the node (this extender's reservations, the ids
        announced on pending pods, by it or one before it), in one pass: those the state counts
        (not of the `excluded` pods), and those of pods not bound, which set bound pods' ids
        aside (`set_aside`)."""
        counted = 0
        for uid, reservation in self._reservations.items():
            if reservation.node == node and uid not in holdings:
                counted |= reservation.cores
        unbound = counted
        for uid, announced in self._announced.items():
            if announced.holding.node == node:
                if uid not in excluded:
                    counted |= announced.holding.cores
                if uid not in holdings:
                    unbound |= announced.holding.cores
        return counted, unbound

    def set_aside(self, node: str, held: int | None = None) -> frozenset[str]:
        """The pods on the node whose ids are not counted alone, as they name cores an older
        pod's ids there name too, or cores held for a bind of another pod in flight (anyone who
        may create pods can write them, a pending pod's among them; a correction by the device
        plugin may be under way): each counts by its request as well (in the node's state, its
        ids too: `_state`), so two pods are never taken for one device. The older keeps its ids
        (by start, then uid: the same on every replica and after a restart). Usually none: one
        pass finds no two that overlap. `held`: the cores of those binds in flight, when the
        caller has them already (`_state`)."""
        holdings = self._by_node.get(node)
        entry = self.nodes.get(node)
        if not holdings or entry is None:
            return frozenset()
        total = entry.topology.total_cores
        if held is None:
            held = self._binds_in_flight(node, holdings)[1]
        named = held
        for holding in holdings.values():
            if holding.ours and not holding.cores >> total:
                if holding.cores & named:
                    break
                named |= holding.cores
        else:
            return frozenset()
        named, aside = held, set()
        for uid, holding in sorted(holdings.items(), key=lambda item: (item[1].started, item[0])):
            if holding.ours and not holding.cores >> total:
                if holding.cores & named:
                    aside.add(uid)
                else:
                    named |= holding.cores
        return frozenset(aside)

    def _held_blocks(
        self,
        node: str,
        topology: Topology,
        used: int,
        going: int,
        unknown: int,
        exclude: frozenset[str],
    ) -> int:
        """The blocks held for pods nominated to the node, highest priority first: each where
        the allocator would place it once the terminating pods are gone."""
        held = 0
        waiting = [
            (-n.priority, uid, n)
            for uid, n in self.holds()
            if n.node == node and uid not in exclude
        ]
        for _, uid, nomination in sorted(waiting, key=lambda w: (w[0], w[1])):
            if nomination.block:
                held |= nomination.block
                if not nomination.owner:
                    self._report_held(uid, node, nomination, _placement(topology, nomination.block))
                continue
            free_soon = NodeState((used & ~going) | held, unknown)
            decision = allocate(topology, free_soon, nomination.request, Policy.BEST_FIT)
            if isinstance(decision, Placement):
                held |= decision.core_mask
                self._report_held(uid, node, nomination, decision)
        return held

    def _report_held(self, uid: str, node: str, nomination: Nomination, block: Placement) -> None:
        if uid in self._held or self.report is None:
            return
        self._held.add(uid)
        namespace, _, name = self._pod_keys.get(uid, "?/?").partition("/")
        self.report(
            ObjectRef("Pod", namespace, name, uid),
            "NeuronBlockHeld",
            f"{node} holds devices {format_ids(list(block.devices))} (cores "
            f"{format_ids(list(block.cores))}) for this pod until it is bound; "
            f"{nomination.request.describe()}",
            False,
        )

    def eviction_view(self, claimant: Claimant, node: str) -> tuple[NodeState, dict[str, Occupant]]:
        """The node as a preemptor finds it before anyone is evicted: its state as the claimant
        sees it (`state_for`: its own held block and those of lower-priority nominated pods not
        counted, as kube-scheduler clears those nominations on the node it picks) with the pods
        already leaving taken out (neither victims nor obstacles), and the pods still there as
        eviction weighs them, by uid."""
        state = self.state_for(claimant, node)
        entry = self.nodes.get(node)
        if entry is None:
            return state, {}
        used, unknown = state.used_cores, state.unattributed_cores
        occupants: dict[str, Occupant] = {}
        aside = self.set_aside(node)
        for uid, holding in self._by_node.get(node, {}).items():
            # A pod's cores on a failed device stay in use when it leaves: not freed by evicting.
            occupant = _occupant(entry.topology, holding, entry.unhealthy_cores, uid in aside)
            if holding.terminating:
                used &= ~occupant.cores
                unknown -= occupant.unknown_cores
            else:
                occupants[uid] = occupant
        return NodeState(used, max(unknown, 0)), occupants

    def pods_holding(self, node: str) -> dict[str, Holding]:
        """The pods holding Neuron resources on the node, by uid."""
        return dict(self._by_node.get(node, {}))

    def on_failed_devices(self) -> Iterator[tuple[str, str, int]]:
        """(pod uid, node, the failed devices among its ids) for each pod whose annotated ids
        include a device its node reports failed: it runs on, with a device it cannot use."""
        for name, entry in self.nodes.items():
            if not entry.unhealthy_devices:
                continue
            failed = entry.unhealthy_cores
            per_device = entry.topology.cores_per_device
            aside = self.set_aside(name)
            for uid, holding in self._by_node.get(name, {}).items():
                if holding.ours and holding.cores & failed and uid not in aside:
                    devices = devices_touched(
                        holding.cores & failed, per_device, entry.topology.devices
                    )
                    yield uid, name, devices

    def pod_key(self, uid: str) -> str:
        return self._pod_keys.get(uid, uid)

    def holding(self, uid: str) -> Holding | None:
        return self._holdings.get(uid)

    def reservation(self, uid: str) -> Holding | None:
        return self._reservations.get(uid)

    @property
    def pod_count(self) -> int:
        return len(self._holdings)

    def pods_on(self, node: str) -> list[str]:
        return sorted(self._pod_keys[uid] for uid in self._by_node.get(node, {}))


def _placement(topology: Topology, cores: int) -> Placement:
    """The devices and cores of a mask, as a block held for a pod is reported."""
    ids = tuple(mask_ids(cores))
    per_device = topology.cores_per_device
    return Placement(tuple(sorted({c // per_device for c in ids})), ids, 0)


def _occupant(
    topology: Topology, holding: Holding, unhealthy_cores: int = 0, aside: bool = False
) -> Occupant:
    """The pod as eviction weighs it: evicting it frees its healthy cores, and the cores of its
    failed devices that `_state` holds in count for it, never the failed devices themselves
    (`aside`, `Ledger.set_aside`: its size only; its ids, which `_state` counts as well since
    they overlap another claim, stay taken in eviction's reckoning, which can only err on the
    side of freeing too little)."""
    if holding.ours and not holding.cores >> topology.total_cores and not aside:
        failed = holding.cores & unhealthy_cores
        cores, unknown = holding.cores & ~failed, failed.bit_count()
    else:
        size = topology.cores_per_device if holding.unknown_unit is Unit.DEVICE else 1
        cores, unknown = 0, holding.unknown_count * size
    return Occupant(cores, unknown, holding.priority, epoch(holding.started))
