"""Who holds which Neuron cores on which node, rebuilt from the cluster's pods. No I/O.

The only source of truth is the pods themselves: a pod bound to a node and not finished holds the
ids in our annotations (when they are for that node), or, without them, an unknown set of its
requested size. Node annotations are never read: upstream's usage maps in node annotations go stale
across restarts. In-flight binds add reservations until the pod shows up bound with its
annotations, so a filter or a second bind never sees those ids as free.

The ledger is a `ClusterView` (the watches feed it) and a `Reserver` (bind holds placements in it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from neuron_scheduler.core.allocation import Decision, NodeState, Placement, Policy, allocate
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.handoff import AnnotationError
from neuron_scheduler.core.resources import NeuronRequest, RequestError, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.kube.objects import Node, Pod
from neuron_scheduler.kube.reading import assignment, held_by_others, neuron_request, node_topology

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeEntry:
    name: str
    topology: Topology
    warning: str | None
    withheld_cores: int  # capacity the node does not offer (allocatable below capacity)


@dataclass(frozen=True, slots=True)
class Holding:
    """What one pod holds on one node: known cores, or a count whose ids we do not know."""

    node: str
    cores: int = 0  # mask
    unknown_count: int = 0  # in `unknown_unit`s
    unknown_unit: Unit = Unit.CORE
    ours: bool = False  # ids come from our annotations for this node


class Verdicts:
    """The allocator's decision for one request shape on each node asked about so far.

    filter and prioritize ask about hundreds of nodes per call while a node's state changes only
    when a pod lands on it or leaves, so decisions are kept until their node changes.
    """

    __slots__ = ("decisions", "fits", "scores")

    def __init__(self) -> None:
        self.decisions: dict[str, Decision] = {}
        self.fits: set[str] = set()  # the nodes whose decision is a Placement
        self.scores: dict[str, int] = {}  # prioritize's answer: the fit score, 0 when refused

    def forget(self, node: str) -> None:
        if self.decisions.pop(node, None) is not None:
            self.fits.discard(node)
            del self.scores[node]


# Request shapes in a cluster are few (a handful of sizes per resource); this bounds memory when
# they are not: 5,000 nodes x 64 shapes is ~30 MB at worst.
MAX_REQUEST_SHAPES = 64


class Ledger:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.nodes: dict[str, NodeEntry] = {}
        self._holdings: dict[str, Holding] = {}  # pod uid -> holding
        self._by_node: dict[str, dict[str, Holding]] = {}
        self._reservations: dict[str, Holding] = {}  # pod uid -> in-flight bind
        self._pod_keys: dict[str, str] = {}  # pod uid -> namespace/name
        self._states: dict[str, NodeState] = {}
        self._verdicts: dict[tuple[Unit, int, Policy], Verdicts] = {}

    # --- nodes -------------------------------------------------------------------------------

    def apply_node(self, node: Node) -> None:
        name = node.metadata.name
        resolved = node_topology(node, self.catalog)
        if resolved is None:
            self.remove_node(name)
            return
        if resolved.warning and (name not in self.nodes or self.nodes[name].warning is None):
            log.warning("node %s: %s", name, resolved.warning)
        topology = resolved.topology
        entry = NodeEntry(
            name, topology, resolved.warning, held_by_others(node, topology.cores_per_device)
        )
        if self.nodes.get(name) != entry:
            self.nodes[name] = entry
            self._invalidate(name)

    def remove_node(self, name: str) -> None:
        if self.nodes.pop(name, None) is not None:
            self._invalidate(name)

    def replace_nodes(self, nodes: Iterable[Node]) -> None:
        """A full re-list: apply every node, forget those that are gone."""
        seen = set()
        for node in nodes:
            seen.add(node.metadata.name)
            self.apply_node(node)
        for name in [n for n in self.nodes if n not in seen]:
            self.remove_node(name)

    # --- pods --------------------------------------------------------------------------------

    def apply_pod(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        self._pod_keys[uid] = pod.key
        holding = self._holding_of(pod)
        previous = self._holdings.get(uid)
        if holding != previous:
            if previous is not None:
                self._drop(uid, previous)
            if holding is not None:
                self._holdings[uid] = holding
                self._by_node.setdefault(holding.node, {})[uid] = holding
                self._invalidate(holding.node)
        reservation = self._reservations.get(uid)
        if reservation is not None and (pod.finished or (holding is not None and holding.ours)):
            # The watch now shows what the bind wrote (or the pod is gone): the reservation has
            # done its job.
            self._release(uid)
        if holding is None and uid not in self._reservations:
            self._pod_keys.pop(uid, None)

    def remove_pod(self, uid: str) -> None:
        previous = self._holdings.get(uid)
        if previous is not None:
            self._drop(uid, previous)
        self._release(uid)
        self._pod_keys.pop(uid, None)

    def replace_pods(self, pods: Iterable[Pod]) -> None:
        seen = set()
        for pod in pods:
            seen.add(pod.metadata.uid)
            self.apply_pod(pod)
        for uid in [u for u in self._holdings if u not in seen]:
            self.remove_pod(uid)

    def _drop(self, uid: str, holding: Holding) -> None:
        del self._holdings[uid]
        on_node = self._by_node.get(holding.node, {})
        on_node.pop(uid, None)
        if not on_node:
            self._by_node.pop(holding.node, None)
        self._invalidate(holding.node)

    def _holding_of(self, pod: Pod) -> Holding | None:
        node = pod.spec.nodeName
        if not node or pod.finished:
            return None
        try:
            request = neuron_request(pod)
        except RequestError as error:
            log.warning("pod %s on %s: %s; not counted", pod.key, node, error)
            return None
        if request is None:
            return None  # the device plugin's own pod, and every non-Neuron pod
        entry = self.nodes.get(node)
        try:
            found = assignment(pod, entry.topology.cores_per_device if entry else None)
        except AnnotationError as error:
            log.warning(
                "pod %s on %s: unreadable annotations (%s); counting %s with unknown ids",
                pod.key,
                node,
                error,
                request.describe(),
            )
            found = None
        if found is not None:
            return Holding(node, cores=found.core_mask, ours=True)
        # Placed by another scheduler: its ids are unknown, but its size still counts.
        return Holding(node, unknown_count=request.count, unknown_unit=request.unit)

    # --- in-flight binds ---------------------------------------------------------------------

    def reserve(self, pod: Pod, node: str, placement: Placement) -> None:
        uid = pod.metadata.uid
        self._reservations[uid] = Holding(node, cores=placement.core_mask, ours=True)
        self._pod_keys[uid] = pod.key
        self._invalidate(node)

    def unreserve(self, pod: Pod, node: str) -> None:
        reservation = self._reservations.get(pod.metadata.uid)
        if reservation is not None and reservation.node == node:
            self._release(pod.metadata.uid)

    def _release(self, uid: str) -> None:
        reservation = self._reservations.pop(uid, None)
        if reservation is not None:
            self._invalidate(reservation.node)

    def _invalidate(self, node: str) -> None:
        """The node's holdings or topology changed: drop what was derived from them."""
        self._states.pop(node, None)
        for verdicts in self._verdicts.values():
            verdicts.forget(node)

    # --- reading -----------------------------------------------------------------------------

    def verdicts(self, request: NeuronRequest, policy: Policy) -> Verdicts:
        """What is kept for this request shape: every decision in it is current, though it may
        not cover every node yet (`fill_verdicts` fills it in)."""
        key = (request.unit, request.count, policy)
        verdicts = self._verdicts.get(key)
        if verdicts is None:
            if len(self._verdicts) >= MAX_REQUEST_SHAPES:
                del self._verdicts[next(iter(self._verdicts))]  # the oldest shape
            verdicts = self._verdicts[key] = Verdicts()
        return verdicts

    def fill_verdicts(
        self, names: Iterable[str], request: NeuronRequest, policy: Policy
    ) -> Verdicts:
        """Decisions for `request` on every named node that is in the cache (others are left
        out of the result's `decisions`)."""
        verdicts = self.verdicts(request, policy)
        decisions = verdicts.decisions
        for name in names:
            if name in decisions:
                continue
            entry = self.nodes.get(name)
            if entry is None:
                continue
            decision = allocate(entry.topology, self.state(name), request, policy)
            decisions[name] = decision
            if isinstance(decision, Placement):
                verdicts.fits.add(name)
                verdicts.scores[name] = decision.score
            else:
                verdicts.scores[name] = 0
        return verdicts

    def state(self, node: str) -> NodeState:
        """The node's cores in use: bound pods, in-flight binds, and counts with unknown ids."""
        cached = self._states.get(node)
        if cached is not None:
            return cached
        entry = self.nodes.get(node)
        per_device = entry.topology.cores_per_device if entry else 1
        used = 0
        unknown = entry.withheld_cores if entry else 0
        holdings = self._by_node.get(node, {})
        for holding in holdings.values():
            used |= holding.cores
            if holding.unknown_count:
                size = per_device if holding.unknown_unit is Unit.DEVICE else 1
                unknown += holding.unknown_count * size
        for uid, reservation in self._reservations.items():
            if reservation.node == node and uid not in holdings:
                used |= reservation.cores
        state = NodeState(used, unknown)
        self._states[node] = state
        return state

    def holding(self, uid: str) -> Holding | None:
        return self._holdings.get(uid)

    def reservation(self, uid: str) -> Holding | None:
        return self._reservations.get(uid)

    @property
    def pod_count(self) -> int:
        return len(self._holdings)

    def pods_on(self, node: str) -> list[str]:
        return sorted(self._pod_keys[uid] for uid in self._by_node.get(node, {}))
