"""The extender's parts wired together: the one place that decides which views, node filters and
reservers the judge and binder get (today the ledger and the training-job unit rule), what the
waker hears from, and what consolidation reads."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.extender.loops.admitting import Admissions
from neuron_scheduler.extender.loops.consolidating import DEFAULT_LIMITS, Consolidator, Limits
from neuron_scheduler.extender.loops.devicefailures import Action, DeviceFailures
from neuron_scheduler.extender.loops.evictionbudget import EvictionBudget
from neuron_scheduler.extender.loops.protecting import Protector
from neuron_scheduler.extender.loops.requesting import (
    DEFAULT_CAPACITY,
    CapacityLimits,
    CapacityRequester,
)
from neuron_scheduler.extender.loops.reserving import Reservations
from neuron_scheduler.extender.loops.waking import DEFAULT_GRACE, DEFAULT_RATE, Waker
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.admitted import AdmittedHolds
from neuron_scheduler.extender.state.budgets import DisruptionBudgets
from neuron_scheduler.extender.state.dranodes import ClaimClasses, DraNodes
from neuron_scheduler.extender.state.kueuepods import KueuePods
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.state.members import member_fit
from neuron_scheduler.extender.state.movability import Movability
from neuron_scheduler.extender.state.pending import PendingPods
from neuron_scheduler.extender.state.placeholders import Placeholders
from neuron_scheduler.extender.state.plans import Plans
from neuron_scheduler.extender.state.plugins import ClusterView
from neuron_scheduler.extender.state.protection import Bound
from neuron_scheduler.extender.state.workloads import KueueObjects
from neuron_scheduler.extender.verbs.binding import DEFAULT_SCHEDULER_NAMES, Binder
from neuron_scheduler.extender.verbs.judging import Judge
from neuron_scheduler.extender.verbs.preempting import Preemptor
from neuron_scheduler.jobs.network import EKS_LEVELS
from neuron_scheduler.jobs.placement import CLAIM_SECONDS, Occupancy, UnitPlacement
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.events import EventRecorder


@dataclass(frozen=True)
class Extender:
    """The extender's parts, wired: the views the watches feed, the judge (filter, prioritize)
    and the binder, sharing one ledger. The training-job unit rule is given to them as a view, a
    node filter and a reserver."""

    ledger: Ledger
    metrics: Metrics
    synced: asyncio.Event  # set once the watches have listed every node and pod
    events: EventRecorder
    views: tuple[ClusterView, ...]
    budgets: DisruptionBudgets  # fed by a watch of PodDisruptionBudgets
    judge: Judge
    binder: Binder
    preemptor: Preemptor
    waker: Waker  # its loop runs in `serve`; it writes only while `is_leader()`
    occupancy: Occupancy  # training jobs' units, members and claims
    reservations: Reservations  # writes the claims (its loop runs in `serve`, leader only)
    consolidator: Consolidator  # its loop runs in `serve` once synced, leader only
    failures: DeviceFailures  # pods on failed devices: its loop runs like consolidation's
    pending: PendingPods  # what bind reads a pod from, when the watch has it
    # Capacity requests' placeholder pods: the pod watch gives them to this view only.
    placeholders: Placeholders
    requester: CapacityRequester  # its loop runs in `serve` once synced, leader only
    protector: Protector  # karpenter.sh/do-not-disrupt marks: its loop likewise
    dra: DraNodes | None = None  # our DRA driver's nodes and claims (prioritize-claims)
    # The placement admission check for Kueue (its loop runs in `serve`, leader only), and the
    # Kueue objects it reads (fed by watches); None when it is off.
    admissions: Admissions | None = None
    kueue: KueueObjects | None = None


def wire(
    api: KubeAPI,
    catalog: Catalog,
    policy: Policy = Policy.BEST_FIT,
    scheduler_names: Sequence[str] = DEFAULT_SCHEDULER_NAMES,
    wake_rate: float = DEFAULT_RATE,
    wake_grace: float = DEFAULT_GRACE,
    claim_seconds: float = CLAIM_SECONDS,
    topology_levels: tuple[str, ...] = EKS_LEVELS,
    consolidation: Limits = DEFAULT_LIMITS,
    budget_lease: tuple[str, str] = ("kube-system", "k8s-neuron-scheduler-consolidation"),
    capacity: CapacityLimits = DEFAULT_CAPACITY,
    do_not_disrupt: bool = False,
    device_failure_action: Action = Action.REPORT,
    dra: ClaimClasses | None = None,
    kueue_hold_seconds: float | None = None,
) -> Extender:
    """`budget_lease`: (namespace, name) of the Lease consolidation keeps its eviction budget
    on; `do_not_disrupt`: mark the bound pods no other node has a block for with
    karpenter.sh/do-not-disrupt; `dra`: our DRA driver and classes, whose pods
    prioritize-claims scores (None: none); `kueue_hold_seconds`: run the placement admission
    check for Kueue, its holds lasting this long (None: off)."""
    events = EventRecorder(api)
    ledger = Ledger(catalog, report=events.record)
    # Training jobs' units (UltraServers, nodes), members and claims, and where nodes sit.
    occupancy = Occupancy(levels=topology_levels)
    units = UnitPlacement(occupancy, lambda pod: member_fit(ledger, pod, policy))
    metrics = Metrics(ledger)
    synced = asyncio.Event()
    budgets = DisruptionBudgets()
    movability = Movability()
    plans = Plans(ledger, movability)
    budget = EvictionBudget(
        api,
        *budget_lease,
        consolidation.evictions_per_hour,
        consolidation.node_cooldown,
        consolidation.max_plans,
        time.time,
    )
    pending = PendingPods(scheduler_names)  # what bind and consolidation read pods from
    consolidator = Consolidator(
        ledger,
        movability,
        plans,
        budgets,
        api,
        budget,
        pending,
        metrics.registry,
        limits=consolidation,
        report=events.record,
        policy=policy,
        filters=[units],
    )
    placeholders = Placeholders(capacity.namespace)  # its own only: others' are anyone's
    requester = CapacityRequester(
        ledger,
        catalog,
        placeholders,
        plans,
        pending,
        consolidator,
        api,
        metrics.registry,
        limits=capacity,
        report=events.record,
        policy=policy,
        admits=lambda pod, node: units.admits(pod, node, time.monotonic()),
    )
    bound = Bound(scheduler_names)
    protector = Protector(
        ledger,
        bound,
        api,
        metrics.registry,
        on=do_not_disrupt,
        policy=policy,
        admits=lambda pod, node: units.admits(pod, node, time.monotonic()),
    )
    waker = Waker(
        ledger,
        api,
        scheduler_names,
        filters=[units],
        keepers=[ledger, plans],
        policy=policy,
        rate=wake_rate,
        grace=wake_grace,
        on_wake=lambda cause, result: metrics.wakes.labels(cause, result).inc(),
    )
    reservations = Reservations(
        api,
        occupancy,
        units,
        ledger,
        scheduler_names,
        claim_seconds,
        policy=policy,
        report=events.record,
        metrics=metrics,
    )
    failures = DeviceFailures(
        ledger,
        movability,
        api,
        events.record,
        device_failure_action,
        on_evict=lambda result: metrics.failed_device_evictions.labels(result).inc(),
    )
    ledger.on_health = failures.changed
    ledger.on_freed = occupancy.on_freed = waker.node_changed
    ledger.on_deadline = waker.deadline_changed
    occupancy.on_change = reservations.changed
    metrics.waiting.set_function(lambda: len(waker.waiting))
    dra_nodes = DraNodes(catalog, dra) if dra is not None else None
    kueue = admissions = None
    admitted = AdmittedHolds(ledger)
    kueue_pods = KueuePods()
    kueue_views: list[ClusterView] = [admitted, kueue_pods]
    if kueue_hold_seconds is not None:
        kueue = KueueObjects()
        admissions = Admissions(
            api,
            kueue,
            admitted,
            ledger,
            occupancy,
            reservations,
            scheduler_names,
            hold_seconds=kueue_hold_seconds,
            policy=policy,
            metrics=metrics,
            pods=kueue_pods,
        )
        kueue.on_change = admissions.changed
    return Extender(
        ledger,
        metrics,
        synced,
        events,
        # Plans read what movability has of a pod, consolidation what `pending` has: after them.
        # The requester only wakes up on pods and nodes: after the ledger and `pending`.
        (
            ledger,
            occupancy,
            waker,
            movability,
            plans,
            pending,
            consolidator,
            bound,
            requester,
            *([dra_nodes] if dra_nodes is not None else []),
            # The pods of admitted workloads take their blocks once the ledger has them bound.
            *(kueue_views if admissions is not None else []),
        ),
        budgets,
        Judge(ledger, metrics, policy, filters=[units], listener=waker, dra=dra_nodes),
        Binder(
            api,
            ledger,
            metrics,
            synced,
            events,
            policy,
            reservers=[ledger, occupancy],
            scheduler_names=scheduler_names,
            quiet=waker.quiet,
            pending=pending.get,
            filters=[units],
        ),
        Preemptor(ledger, budgets, metrics, policy, planned=plans.planned, occupancy=occupancy),
        waker,
        occupancy,
        reservations,
        consolidator,
        failures,
        pending,
        placeholders,
        requester,
        protector,
        dra_nodes,
        admissions,
        kueue,
    )
