"""The live cluster read into the extender's views (its ledger, and the UltraServer occupancy its
node filter reads): every node and every unfinished pod, a page at a time, as the extender's
watches list them. The only I/O of the live views; it writes nothing.

What the API returns is untrusted: lists are bounded (`list_all`), and the ledger already bounds
and checks what it reads (capacities, annotations, ids against the node's topology).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.planrecord import (
    BUDGET_ANNOTATION,
    BUDGET_LABEL,
    BUDGET_LABEL_VALUE,
    BudgetRecord,
    PlanError,
    decode_budget,
)
from neuron_scheduler.core.resources import DRA_DRIVER
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.state.movability import Movability
from neuron_scheduler.extender.state.placeholders import Placeholders, PodRouter
from neuron_scheduler.extender.state.plans import Plans
from neuron_scheduler.jobs.placement import Occupancy, claims_absent
from neuron_scheduler.kube.client import (
    CLAIMS,
    NODES,
    POD_GROUP_PATHS,
    PODS,
    RESOURCE_SLICES,
    KubeAPI,
)
from neuron_scheduler.kube.errors import READ_ERRORS, Forbidden, NotFound, error_text
from neuron_scheduler.kube.kueue import WorkloadState
from neuron_scheduler.kube.names import SUBDOMAIN
from neuron_scheduler.kube.objects import JobClaim, Node, Pod, PodGroup
from neuron_scheduler.live.dranodes import DraNode, HealthSlice, dra_nodes
from neuron_scheduler.live.gated import GatedPods, gated_view, with_workloads

PAGE = 500
# Far above Kubernetes' tested limits (5,000 nodes, 150,000 pods): a list longer than this is
# refused rather than held in memory.
MOST_NODES = 50_000
MOST_PODS = 1_000_000
MOST_SLICES = 200_000  # our driver writes a few per node
WORKLOAD_READS = 8  # Workloads read at once by `status`
# Finished pods hold nothing (the extender's pod watch leaves them out the same way).
UNFINISHED = "status.phase!=Succeeded,status.phase!=Failed"


@dataclass(frozen=True, slots=True)
class Snapshot:
    ledger: Ledger
    occupancy: Occupancy  # training jobs' units, members and claims
    node_names: frozenset[str]  # every node listed, with Neuron resources or not
    movability: Movability  # what consolidation knows of each Neuron pod
    plans: Plans  # consolidation plans in flight, holding in `ledger` as in the extender's
    placeholders: Placeholders  # capacity requests' placeholder pods (counted in no other view)
    claims_unread: str | None = None  # why the job claims were not read
    dra: tuple[DraNode, ...] = ()  # nodes our DRA driver serves, and their failed devices
    dra_unread: str | None = None  # why its ResourceSlices were not read
    gated: GatedPods = field(default_factory=GatedPods)  # pods held back by scheduling gates

    @property
    def other_nodes(self) -> int:
        """Nodes that advertise no Neuron resources."""
        ledger = self.ledger
        return len(self.node_names - ledger.nodes.keys() - ledger.unusable.keys())

    def apply_pod(self, pod: Pod) -> None:
        """A pod read after the list (the list may be older)."""
        router = PodRouter(
            (self.ledger, self.occupancy, self.movability, self.plans), self.placeholders
        )
        router.apply_pod(pod)


@dataclass(frozen=True, slots=True)
class Budget:
    """Consolidation's eviction budget as its Lease says, or why it could not be read."""

    record: BudgetRecord | None
    lease: str  # namespace/name, "" when none was found
    problem: str  # "" when read


async def read_cluster(
    api: KubeAPI, catalog: Catalog, dra_driver: str = DRA_DRIVER, kueue_workloads: bool = False
) -> Snapshot:
    """Nodes first, then pods (a pod's ids are checked against its node's topology); then the
    job claims and PodGroups, and our DRA driver's slices, where they can be read; with
    `kueue_workloads`, the Workload of each gated group Kueue holds back (`status` shows them)."""
    nodes = await api.list_all(NODES, Node, page=PAGE, most=MOST_NODES)
    pods = await api.list_all(
        PODS, Pod, params={"fieldSelector": UNFINISHED}, page=PAGE, most=MOST_PODS
    )
    # No report: the extender turns the ledger's findings into events; a viewer stays silent.
    ledger = Ledger(catalog)
    occupancy = Occupancy()
    movability = Movability()
    plans = Plans(ledger, movability)
    placeholders = Placeholders()
    # The extender's views, fed as its watches feed them (plans after movability, placeholders
    # to their own view only).
    views = (ledger, occupancy, movability, plans)
    for view in views:
        view.replace_nodes(nodes)
    PodRouter(views, placeholders).replace_pods(pods)
    unread = None
    try:
        claims = await api.list_all(CLAIMS, JobClaim, page=PAGE, most=MOST_NODES)
        occupancy.replace_claims(claims)
    except (Forbidden, NotFound) as error:
        unread = f"cannot list UltraServerClaims: {error_text(error)}"
        if isinstance(error, NotFound):  # no CRD: the extender has none either, and says so
            occupancy.unavailable = claims_absent("not served")
    groups_path = await api.first_served(POD_GROUP_PATHS)  # the Workload API: often absent
    if groups_path is not None:
        with contextlib.suppress(Forbidden, NotFound):
            groups = await api.list_all(groups_path, PodGroup, page=PAGE, most=MOST_PODS)
            occupancy.replace_pod_groups(groups)
    names = frozenset(n.metadata.name for n in nodes)
    dra, dra_unread = await read_dra_nodes(api, dra_driver)
    gated = gated_view(pods)
    if kueue_workloads:
        gated = with_workloads(gated, await read_workloads(api, gated))
    return Snapshot(
        ledger,
        occupancy,
        names,
        movability,
        plans,
        placeholders,
        unread,
        dra,
        dra_unread,
        gated,
    )


async def read_workloads(
    api: KubeAPI, view: GatedPods
) -> dict[tuple[str, str], WorkloadState | str]:
    """The Workloads of the groups `view` lists (their metadata and status), by namespace and
    name, or why one could not be read (the rest of `status` stands without it). One read each,
    a few at a time: the groups listed are bounded (gated.MAX_GROUPS), while a cluster keeps a
    Workload for every job Kueue has seen, and each carries its pod templates."""
    wanted = sorted(
        {(g.gating.namespace, g.gating.workload) for g in view.groups if g.gating.workload}
    )
    reading = asyncio.Semaphore(WORKLOAD_READS)

    async def read(namespace: str, name: str) -> WorkloadState | str:
        async with reading:
            return await read_workload(api, namespace, name)

    found = await asyncio.gather(*(read(namespace, name) for namespace, name in wanted))
    return dict(zip(wanted, found, strict=True))


async def read_workload(api: KubeAPI, namespace: str, name: str) -> WorkloadState | str:
    """A gated pod's Workload (its metadata and status), or why it could not be read. The name
    comes from the pod's labels, anyone's to write: only a Workload's name goes into a path."""
    if not SUBDOMAIN.fullmatch(name):
        return "that is not a Workload's name"
    try:
        return await api.get_workload_state(namespace, name)
    except NotFound:  # (Kueue makes it after the pods, from their labels)
        return "not found"
    except READ_ERRORS as error:
        return f"cannot read it: {error_text(error)}"


async def read_dra_nodes(
    api: KubeAPI, driver: str = DRA_DRIVER
) -> tuple[tuple[DraNode, ...], str | None]:
    """Our DRA driver's nodes from its ResourceSlices; none, and why, when they cannot be read
    (no DRA API: nothing to say)."""
    try:
        slices = await api.list_all(
            RESOURCE_SLICES,
            HealthSlice,
            params={"fieldSelector": f"spec.driver={driver}"},
            page=PAGE,
            most=MOST_SLICES,
        )
    except NotFound:
        return (), None
    except Forbidden as error:
        return (), f"cannot list ResourceSlices: {error_text(error)}"
    return dra_nodes(slices, driver), None


async def read_budget(api: KubeAPI) -> Budget:
    """The eviction budget's Lease, found by its label in any namespace (the extender's). Not
    being allowed to list Leases is no failure of `status`: it says so."""
    try:
        leases = await api.list_leases(f"{BUDGET_LABEL}={BUDGET_LABEL_VALUE}")
    except READ_ERRORS as error:
        return Budget(None, "", f"cannot list Leases: {error_text(error)}")
    if not leases:
        return Budget(None, "", "")
    lease = leases[0]
    where = f"{lease.metadata.namespace}/{lease.metadata.name}"
    try:
        record = decode_budget(lease.metadata.annotations.get(BUDGET_ANNOTATION, "{}"))
    except PlanError as error:
        return Budget(None, where, str(error))
    return Budget(record, where, "")
