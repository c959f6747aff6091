"""What the extender knows of nodes served by our DRA driver: each pool's topology, the cores its
allocated claims hold, and what a pod's claim asks for. No I/O.

Fed by watches of our driver's ResourceSlices (the counter slices say how many devices a pool
has and their logical cores, the instance type comes from the Node's label, as the driver takes
it; of the device slices only the unhealthy taints are read: kube-scheduler never allocates a
tainted device, so a failed device's cores count as held) and of every ResourceClaim (its
requests of our classes, and the devices of ours it was allocated). Prioritize reads it to score
nodes for a pod with our claim (`dra.scoring`); kube-scheduler's DRA plugin alone decides which
nodes fit.

A claim the scheduler has allocated but not yet written back (between its Reserve and PreBind)
is not seen here: a pod scheduled right after it may be scored on a node state one claim old.
Everything read is untrusted: device names that are not ours to have published for a node's
topology are ignored, pools whose counters are not the driver's are not scored, and the pod's
claim must be one request of one of our classes, exactly one device of it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from neuron_scheduler.core.allocation import NodeState
from neuron_scheduler.core.catalog import INSTANCE_TYPE_LABEL, Catalog
from neuron_scheduler.core.demand import Demand
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra.claims import MAX_RESULTS, ResourceClaim
from neuron_scheduler.dra.pools import PoolSlice, failed_devices, node_topology, pool_size
from neuron_scheduler.dra.shapes import shapes_by_name
from neuron_scheduler.kube.objects import Node, Pod

log = logging.getLogger("neuron_scheduler.extender.dranodes")

MAX_CLASS_COUNT = 1024  # a class name's count beyond any node: not one of ours


@dataclass(frozen=True, slots=True)
class ClaimClasses:
    """Our driver and its DeviceClass names (the chart's dra.driverName, dra.deviceClassPrefix,
    dra.coreClassPrefix): `<device prefix>-k` asks for k connected devices, `<core prefix>-k`
    for k connected cores."""

    driver: str
    device_prefix: str = "neuron"
    core_prefix: str = "neuroncore"

    def request(self, class_name: str) -> NeuronRequest | None:
        head, dash, count = class_name.rpartition("-")
        if not dash or not count.isdigit() or len(count) > 4:
            return None
        if not 1 <= int(count) <= MAX_CLASS_COUNT:
            return None
        for prefix, resource in ((self.core_prefix, NEURONCORE), (self.device_prefix, NEURON)):
            if head == prefix:
                return NeuronRequest(resource, int(count))
        return None


@dataclass(slots=True)
class _Claim:
    key: str  # namespace/name
    request: NeuronRequest | None  # its one request of our classes, if that is what it is
    held: tuple[tuple[str, str], ...] = ()  # (pool, device) of ours allocated to it


@dataclass(slots=True)
class _Pool:
    size: tuple[int, int] | None = None  # (devices, cores per device), from its counter slice
    claims: set[str] = field(default_factory=set)  # uids of claims holding its devices
    failed: int = 0  # devices (mask) its newest generation's slices taint as unhealthy


class DraNodes:
    """A ClusterView for the Node labels (pods are not read: the pod to score comes with the
    request), and the slices' and claims' watch handlers."""

    def __init__(self, catalog: Catalog, classes: ClaimClasses) -> None:
        self.catalog = catalog
        self.classes = classes
        self.demand = Demand()  # the shapes pods with our claims ask for
        self._instance_types: dict[str, str] = {}
        self._counter_slices: dict[str, tuple[str, int, tuple[int, int] | None]] = {}
        # Device slices that taint failed devices: name -> (node, generation, devices (mask)).
        self._tainting_slices: dict[str, tuple[str, int, int]] = {}
        self._pools: dict[str, _Pool] = {}
        self._claims: dict[str, _Claim] = {}
        self._by_key: dict[str, str] = {}  # namespace/name -> uid
        self._topologies: dict[str, Topology | None] = {}
        self._states: dict[str, NodeState] = {}

    # --- nodes ----------------------------------------------------------------------------

    def replace_nodes(self, nodes: Iterable[Node]) -> None:
        self._instance_types = {
            n.metadata.name: n.metadata.labels.get(INSTANCE_TYPE_LABEL, "") for n in nodes
        }
        self._topologies.clear()
        self._states.clear()  # built from the topologies: a relisted node may have another

    def apply_node(self, node: Node) -> None:
        name = node.metadata.name
        instance_type = node.metadata.labels.get(INSTANCE_TYPE_LABEL, "")
        if self._instance_types.get(name) != instance_type:
            self._instance_types[name] = instance_type
            self._forget(name)

    def remove_node(self, name: str) -> None:
        self._instance_types.pop(name, None)
        self._forget(name)

    def replace_pods(self, pods: Iterable[Pod], listed_since: float) -> None:
        pass

    def apply_pod(self, pod: Pod) -> None:
        pass

    def remove_pod(self, uid: str) -> None:
        pass

    # --- slices ---------------------------------------------------------------------------

    def replace_slices(self, slices: Iterable[PoolSlice]) -> None:
        self._counter_slices.clear()
        self._tainting_slices.clear()
        for pool in self._pools.values():
            pool.size = None
            pool.failed = 0
        for item in slices:
            self.apply_slice(item)
        self._topologies.clear()

    def apply_slice(self, item: PoolSlice) -> None:
        spec = item.spec
        if spec.driver != self.classes.driver or not spec.nodeName:
            return
        if spec.pool.name != spec.nodeName:
            return  # our driver names each node's pool after the node
        name = item.metadata.name
        if spec.sharedCounters:
            self._counter_slices[name] = (
                spec.nodeName,
                spec.pool.generation,
                pool_size(spec.sharedCounters),
            )
        else:
            failed = failed_devices(item, self.classes.driver)
            known = self._tainting_slices.get(name)
            if not failed and known is None:
                return  # the usual device slice: nothing failed, nothing changes
            if failed:
                self._tainting_slices[name] = (spec.nodeName, spec.pool.generation, failed)
            else:
                del self._tainting_slices[name]
        self._resize(spec.nodeName)

    def remove_slice(self, item: PoolSlice) -> None:
        name = item.metadata.name
        found = self._counter_slices.pop(name, None) or self._tainting_slices.pop(name, None)
        if found is not None:
            self._resize(found[0])

    def _resize(self, node: str) -> None:
        newest = max(
            (
                (generation, size)
                for pool, generation, size in self._counter_slices.values()
                if pool == node
            ),
            default=None,
            key=lambda found: found[0],
        )
        pool = self._pools.setdefault(node, _Pool())
        pool.size = newest[1] if newest else None
        pool.failed = 0
        for tainted, generation, failed in self._tainting_slices.values():
            if tainted == node and newest is not None and generation == newest[0]:
                pool.failed |= failed
        self._forget(node)

    # --- claims ---------------------------------------------------------------------------

    def replace_claims(self, claims: Iterable[ResourceClaim]) -> None:
        # A claim known before the relist was counted in demand when it appeared: not again.
        known = set(self._claims)
        self._claims.clear()
        self._by_key.clear()
        for pool in self._pools.values():
            pool.claims.clear()
        self._states.clear()
        for claim in claims:
            self._apply_claim(claim, new=claim.metadata.uid not in known)

    def apply_claim(self, claim: ResourceClaim) -> None:
        self._apply_claim(claim, new=True)

    def _apply_claim(self, claim: ResourceClaim, *, new: bool) -> None:
        meta = claim.metadata
        uid = meta.uid
        old = self._claims.get(uid)
        if old is None:
            request = self._request_of(claim)
            if request is not None and new:
                self.demand.record(request.unit, request.count)
        else:
            request = old.request
        held = self._held_by(claim)
        entry = _Claim(f"{meta.namespace}/{meta.name}", request, held)
        self._claims[uid] = entry
        self._by_key[entry.key] = uid
        before = {pool for pool, _ in old.held} if old else set()
        after = {pool for pool, _ in held}
        for pool in before - after:
            self._pools.setdefault(pool, _Pool()).claims.discard(uid)
        for pool in after:
            self._pools.setdefault(pool, _Pool()).claims.add(uid)
        if old is None or old.held != held:
            for pool in before | after:
                self._states.pop(pool, None)

    def remove_claim(self, claim: ResourceClaim) -> None:
        uid = claim.metadata.uid
        old = self._claims.pop(uid, None)
        if old is None:
            return
        if self._by_key.get(old.key) == uid:
            del self._by_key[old.key]
        for pool, _ in old.held:
            entry = self._pools.get(pool)
            if entry is not None:
                entry.claims.discard(uid)
            self._states.pop(pool, None)

    def _request_of(self, claim: ResourceClaim) -> NeuronRequest | None:
        ours = []
        for request in claim.spec.devices.requests[:MAX_RESULTS]:
            exactly = request.exactly
            if exactly is None:
                continue
            asked = self.classes.request(exactly.deviceClassName)
            if asked is None:
                continue
            if exactly.allocationMode != "ExactCount" or exactly.count != 1:
                return None  # not one legal set: nothing to score by
            ours.append(asked)
        return ours[0] if len(ours) == 1 else None

    def _held_by(self, claim: ResourceClaim) -> tuple[tuple[str, str], ...]:
        allocation = claim.status.allocation
        if allocation is None:
            return ()
        # kube-scheduler does not count an admin-access result as allocated: neither do we.
        return tuple(
            (r.pool, r.device)
            for r in allocation.devices.results[:MAX_RESULTS]
            if r.driver == self.classes.driver and not r.adminAccess
        )

    # --- what prioritize reads ------------------------------------------------------------

    def request_of(self, pod: Pod) -> NeuronRequest | None:
        """The pod's one request of our classes that is not allocated yet; None when it has
        none, or more than one (not scored)."""
        namespace = pod.metadata.namespace
        names = {s.name: s.resourceClaimName for s in pod.status.resourceClaimStatuses}
        found: list[NeuronRequest] = []
        for entry in pod.spec.resourceClaims[:MAX_RESULTS]:
            name = entry.resourceClaimName or names.get(entry.name)
            uid = self._by_key.get(f"{namespace}/{name}") if name else None
            claim = self._claims.get(uid) if uid else None
            if claim is None or claim.request is None:
                continue
            if claim.held:
                return None  # allocated already: its node is decided
            found.append(claim.request)
        return found[0] if len(found) == 1 else None

    def node(self, name: str) -> tuple[Topology, NodeState] | None:
        """The node's topology and the cores its claims and its failed devices hold (the
        scheduler allocates neither); None when it is not one of our DRA pools (or its counters
        or label cannot be read)."""
        topology = self._topology(name)
        if topology is None:
            return None
        state = self._states.get(name)
        if state is None:
            used = self._used_cores(name, topology) | self._failed_cores(name, topology)
            state = self._states[name] = NodeState(used)
        return topology, state

    def _topology(self, name: str) -> Topology | None:
        if name in self._topologies:
            return self._topologies[name]
        pool = self._pools.get(name)
        topology = None
        if pool is not None and pool.size is not None and name in self._instance_types:
            devices, cores = pool.size
            topology, warning = node_topology(
                self.catalog, self._instance_types[name], devices, cores
            )
            if warning:
                log.info("DRA node %s: %s", name, warning)
        self._topologies[name] = topology
        return topology

    def _used_cores(self, name: str, topology: Topology) -> int:
        used = 0
        shapes = shapes_by_name(topology)
        pool = self._pools.get(name)
        for uid in pool.claims if pool else ():
            for held_pool, device in self._claims[uid].held:
                shape = shapes.get(device) if held_pool == name else None
                if shape is not None:
                    used |= shape.core_mask
        return used

    def _failed_cores(self, name: str, topology: Topology) -> int:
        pool = self._pools.get(name)
        failed = pool.failed & topology.all_devices if pool else 0
        return topology.core_mask_of_devices(failed)

    def _forget(self, node: str) -> None:
        self._topologies.pop(node, None)
        self._states.pop(node, None)

    @property
    def claim_count(self) -> int:
        return len(self._claims)
