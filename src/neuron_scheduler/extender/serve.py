"""The extender process: wires the ledger, plugins, judge and binder, runs the watches, the Lease
and the HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from neuron_scheduler.commandline import setup_logging
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.dra.claims import ResourceClaim
from neuron_scheduler.dra.pools import PoolSlice
from neuron_scheduler.extender.http import DEFAULT_BODY_LIMIT, build_apps
from neuron_scheduler.extender.loops.consolidating import Limits
from neuron_scheduler.extender.loops.devicefailures import Action
from neuron_scheduler.extender.loops.requesting import DEFAULT_CAPACITY, CapacityLimits
from neuron_scheduler.extender.loops.waking import DEFAULT_GRACE, DEFAULT_RATE
from neuron_scheduler.extender.memory import MemoryReturner, malloc_trim
from neuron_scheduler.extender.state.dranodes import ClaimClasses
from neuron_scheduler.extender.state.placeholders import PodRouter
from neuron_scheduler.extender.state.plugins import ClusterView
from neuron_scheduler.extender.verbs.binding import DEFAULT_SCHEDULER_NAMES
from neuron_scheduler.extender.wiring import Extender, wire
from neuron_scheduler.jobs.network import EKS_LEVELS
from neuron_scheduler.jobs.placement import CLAIM_SECONDS, claims_absent
from neuron_scheduler.kube.client import (
    ADMISSION_CHECKS,
    CLAIMS,
    DISRUPTION_BUDGETS,
    NODES,
    POD_GROUP_PATHS,
    PODS,
    RESOURCE_CLAIMS,
    RESOURCE_FLAVORS,
    RESOURCE_SLICES,
    WORKLOADS,
    KubeAPI,
    group_version,
)
from neuron_scheduler.kube.config import load_config
from neuron_scheduler.kube.election import ElectionConfig, LeaderElector
from neuron_scheduler.kube.errors import READ_ERRORS, Forbidden, NotFound
from neuron_scheduler.kube.kueue import AdmissionCheck, ResourceFlavor, Workload
from neuron_scheduler.kube.objects import (
    JobClaim,
    Node,
    Pod,
    PodDisruptionBudget,
    PodGroup,
)
from neuron_scheduler.kube.watching import Watch

log = logging.getLogger("neuron_scheduler.server")
CRD_RETRY_SECONDS = 60.0
T = TypeVar("T")


@dataclass
class ExtenderOptions:
    kubeconfig: Path | None = None
    host: str = "0.0.0.0"
    port: int = 12345
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Callers of the verbs must present a certificate signed by this CA (kube-scheduler's
    # extender tlsConfig certFile/keyFile); without it the TLS handshake fails.
    client_ca: Path | None = None
    # No client CA: any caller may drive binds. Only when asked for; warned about at start.
    insecure: bool = False
    # /healthz, /readyz and /metrics, plain HTTP, no client certificate; 0: none.
    metrics_port: int = 12346
    topology_file: Path | None = None
    log_level: str = "info"
    body_limit: int = DEFAULT_BODY_LIMIT
    election: ElectionConfig | None = None
    scheduler_names: tuple[str, ...] = DEFAULT_SCHEDULER_NAMES
    # Wake writes per second for refused pods whose room freed (0: only log them), and how long
    # kube-scheduler gets to retry on a cluster event itself before the extender wakes a pod.
    wake_rate: float = DEFAULT_RATE
    wake_grace: float = DEFAULT_GRACE
    # How long a training job's Pending claim outlives its job's last activity.
    claim_seconds: float = CLAIM_SECONDS
    # The network's topology levels (node-label keys, broadest first) jobs are placed close in.
    topology_levels: tuple[str, ...] = EKS_LEVELS
    # Consolidation's mode and bounds, and the Lease (namespace, name) of its eviction budget.
    consolidation: Limits = field(default_factory=Limits)
    budget_lease: tuple[str, str] = ("kube-system", "k8s-neuron-scheduler-consolidation")
    # Capacity requests' mode and bounds, where their placeholders live and whose they are.
    capacity: CapacityLimits = DEFAULT_CAPACITY
    # Mark bound pods that no other node has a block for with karpenter.sh/do-not-disrupt.
    do_not_disrupt: bool = False
    # What the leader does about pods running on a failed device: report, or evict too.
    device_failure_action: Action = Action.REPORT
    # Our DRA driver and DeviceClasses: pods with such claims are scored by prioritize-claims.
    dra: ClaimClasses | None = None
    # The placement admission check for Kueue: how long an admitted workload's pods have to bind
    # (None: the check is off).
    kueue_hold_seconds: float | None = None


def start_watches(api: KubeAPI, extender: Extender) -> list[asyncio.Task[None]]:
    """List-then-watch nodes and pods into every view, UltraServerClaims, PodGroups where the
    cluster serves them, and disruption budgets; the extender's `synced` is set after the first
    lists of nodes, pods and claims."""
    views, synced, ledger = extender.views, extender.synced, extender.ledger
    occupancy = extender.occupancy

    def each(call: Callable[[ClusterView, T], None]) -> Callable[[T], None]:
        def fan_out(item: T) -> None:
            for view in views:
                call(view, item)

        return fan_out

    nodes: Watch[Node] = Watch(
        api,
        NODES,
        Node,
        on_list=each(lambda view, nodes: view.replace_nodes(nodes)),
        on_change=each(lambda view, node: view.apply_node(node)),
        on_delete=each(lambda view, node: view.remove_node(node.metadata.name)),
        timer=extender.metrics.watch_seconds.labels("nodes").observe,
    )
    # Capacity requests' placeholders count as pods in no view but their own.
    router = PodRouter(views, extender.placeholders)

    pods: Watch[Pod] = Watch(
        api,
        PODS,
        Pod,
        on_list=lambda listed: router.replace_pods(listed, pods.list_started),
        on_change=router.apply_pod,
        on_delete=lambda pod: router.remove_pod(pod.metadata.uid),
        # Finished pods hold nothing; when one finishes the watch reports it as deleted.
        params={"fieldSelector": "status.phase!=Succeeded,status.phase!=Failed"},
        timer=extender.metrics.watch_seconds.labels("pods").observe,
    )

    claims: Watch[JobClaim] = Watch(
        api,
        CLAIMS,
        JobClaim,
        on_list=occupancy.replace_claims,
        on_change=occupancy.apply_claim,
        on_delete=occupancy.remove_claim,
    )

    async def watch_pod_groups() -> None:
        # The Workload API is off by default (alpha in 1.36, beta in 1.37), in one version or
        # another: without it, no PodGroups, and a job's size comes from its pods.
        path = await api.first_served(POD_GROUP_PATHS)
        if path is None:
            versions = ", ".join(group_version(p) for p in POD_GROUP_PATHS)
            log.info("PodGroups are not read (none of %s is served)", versions)
            return
        pod_groups: Watch[PodGroup] = Watch(
            api,
            path,
            PodGroup,
            on_list=occupancy.replace_pod_groups,
            on_change=occupancy.apply_pod_group,
            on_delete=occupancy.remove_pod_group,
        )
        await run_if_served(api, pod_groups, f"{group_version(path)} PodGroups")

    claims_known = asyncio.Event()  # listed, or the cluster has no UltraServerClaim CRD

    async def watch_claims() -> None:
        def absent(why: str) -> None:
            occupancy.unavailable = claims_absent(why)
            claims_known.set()

        async def listed() -> None:
            await claims.synced.wait()
            claims_known.set()

        def served() -> None:
            if occupancy.unavailable is not None:
                log.info("UltraServerClaims are served now: training jobs go all or nothing")
                occupancy.unavailable = None

        waiting = asyncio.get_running_loop().create_task(listed())
        try:
            # Checked again every minute: the CRD may be installed (or established) later.
            await run_if_served(
                api, claims, "UltraServerClaims", absent, served, retry_seconds=CRD_RETRY_SECONDS
            )
        finally:
            waiting.cancel()

    async def mark_synced() -> None:
        await nodes.synced.wait()
        await pods.synced.wait()
        await claims_known.wait()
        # The first list is most of the heap (every cached pod and node) and lives as long as the
        # process: frozen, the collector stops rescanning it, which at tens of thousands of pods
        # was a pause every few hundred requests and the largest part of filter's p99.
        gc.collect()
        gc.freeze()
        synced.set()
        extender.reservations.ready.set()
        log.info(
            "cache synced: %d Neuron nodes, %d pods holding Neuron resources",
            len(ledger.nodes),
            ledger.pod_count,
        )

    budgets: Watch[PodDisruptionBudget] = Watch(
        api,
        DISRUPTION_BUDGETS,
        PodDisruptionBudget,
        on_list=extender.budgets.replace,
        on_change=extender.budgets.apply,
        on_delete=lambda b: extender.budgets.remove(f"{b.metadata.namespace}/{b.metadata.name}"),
    )

    async def pods_after_nodes() -> None:
        # Pods are read against their nodes' topologies (ids beyond a node's cores are rejected,
        # ids given by device count need its cores per device): nodes first.
        await nodes.synced.wait()
        await pods.run()

    loop = asyncio.get_running_loop()
    named = [*dra_watches(api, extender), *kueue_watches(api, extender)]
    return [
        *(loop.create_task(work, name=name) for name, work in named),
        loop.create_task(nodes.run(), name="the node watch"),
        loop.create_task(pods_after_nodes(), name="the pod watch"),
        # Disruption budgets only order preemption victims: not waited for.
        loop.create_task(budgets.run(), name="the disruption budget watch"),
        loop.create_task(watch_claims(), name="the job claim watch"),
        loop.create_task(watch_pod_groups(), name="the pod group watch"),
        loop.create_task(mark_synced(), name="the sync marker"),
    ]


def stop_on_failure(tasks: list[asyncio.Task[Any]], stop: Callable[[], None]) -> None:
    """A watch or loop that raised stops the extender (`stop`), with its traceback in the log.
    Left alone, the task was gone and nothing said so: a pod watch that failed on one object
    kept serving filter and bind from a cache that no longer saw deletions or other schedulers'
    pods, for as long as the process lived. Stopped, Kubernetes restarts it, and a restarted
    extender rebuilds everything from the API (its design: annotations and claims say what is
    held). Tasks that end on their own (a resource not served, a loop done) end quietly."""

    def done(task: asyncio.Task[Any]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.critical(
            "%s failed; stopping the extender, so that it restarts and lists everything again",
            task.get_name(),
            exc_info=task.exception(),
        )
        stop()

    for task in tasks:
        task.add_done_callback(done)


LAG_INTERVAL = 0.05  # seconds between samples of the event loop's lag


async def sample_loop_lag(observe: Callable[[float], None], interval: float = LAG_INTERVAL) -> None:
    """Tells `observe` how late each of a stream of timers ran: while a request waits for the loop
    to finish other work (a watch event, another request), a timer due then waits as long."""
    while True:
        start = time.perf_counter()
        await asyncio.sleep(interval)
        observe(max(0.0, time.perf_counter() - start - interval))


def dra_watches(api: KubeAPI, extender: Extender) -> list[tuple[str, Coroutine[Any, Any, None]]]:
    """Our DRA driver's counter slices and every ResourceClaim into the DRA view, where the
    cluster serves resource.k8s.io/v1 and we may read them. Not waited for: they only score.
    Each with its name, for the line that says it failed."""
    dra = extender.dra
    if dra is None:
        return []
    slices: Watch[PoolSlice] = Watch(
        api,
        RESOURCE_SLICES,
        PoolSlice,
        on_list=dra.replace_slices,
        on_change=dra.apply_slice,
        on_delete=dra.remove_slice,
        params={"fieldSelector": f"spec.driver={dra.classes.driver}"},
        timer=extender.metrics.watch_seconds.labels("resourceslices").observe,
    )
    claims: Watch[ResourceClaim] = Watch(
        api,
        RESOURCE_CLAIMS,
        ResourceClaim,
        on_list=dra.replace_claims,
        on_change=dra.apply_claim,
        on_delete=dra.remove_claim,
        timer=extender.metrics.watch_seconds.labels("resourceclaims").observe,
    )
    unscored = "{} (pods with DRA claims are not scored)"
    return [
        ("the ResourceSlice watch", run_if_served(api, slices, unscored.format("ResourceSlices"))),
        ("the ResourceClaim watch", run_if_served(api, claims, unscored.format("ResourceClaims"))),
    ]


def kueue_watches(api: KubeAPI, extender: Extender) -> list[tuple[str, Coroutine[Any, Any, None]]]:
    """Kueue's Workloads, AdmissionChecks and ResourceFlavors into the placement check's view,
    when the check is on (and once Kueue's CRDs are served: looked for again every minute). The
    check decides only once all three are listed and the extender's cache is synced."""
    kueue, admissions = extender.kueue, extender.admissions
    if kueue is None or admissions is None:
        return []
    workloads: Watch[Workload] = Watch(
        api,
        WORKLOADS,
        Workload,
        on_list=kueue.replace_workloads,
        on_change=kueue.apply_workload,
        on_delete=kueue.remove_workload,
        timer=extender.metrics.watch_seconds.labels("workloads").observe,
    )
    checks: Watch[AdmissionCheck] = Watch(
        api,
        ADMISSION_CHECKS,
        AdmissionCheck,
        on_list=kueue.replace_checks,
        on_change=kueue.apply_check,
        on_delete=kueue.remove_check,
    )
    flavors: Watch[ResourceFlavor] = Watch(
        api,
        RESOURCE_FLAVORS,
        ResourceFlavor,
        on_list=kueue.replace_flavors,
        on_change=kueue.apply_flavor,
        on_delete=kueue.remove_flavor,
    )

    async def listed() -> None:
        for watch in (workloads, checks, flavors):
            await watch.synced.wait()
        await extender.synced.wait()
        admissions.ready.set()
        log.info(
            "the placement admission check is on: %d of our AdmissionChecks, %d Workloads with "
            "admission checks",
            len(kueue.checks),
            len(kueue.workloads),
        )

    what = "Kueue's {} (the placement admission check waits for them)"
    watches = (("Workload", workloads), ("AdmissionCheck", checks), ("ResourceFlavor", flavors))
    return [
        ("the Kueue sync marker", listed()),
        *(
            (
                f"the {kind} watch",
                run_if_served(
                    api, watch, what.format(f"{kind}s"), lambda _: None, None, CRD_RETRY_SECONDS
                ),
            )
            for kind, watch in watches
        ),
    ]


async def run_if_served(
    api: KubeAPI,
    watch: Watch[Any],
    what: str,
    absent: Callable[[str], None] | None = None,
    served: Callable[[], None] | None = None,
    retry_seconds: float | None = None,
) -> None:
    """The watch, unless the API server does not serve the resource (or we may not read it):
    then one log line and `absent(why)`; with `retry_seconds`, it looks again that often and
    runs the watch once the resource is there (`served()`)."""
    said = False
    while True:
        try:
            await api.request("GET", watch.path, params={"limit": "1"})
            break
        except (NotFound, Forbidden) as error:
            why = "not served" if isinstance(error, NotFound) else "no permission to list them"
            if not said:
                said = True
                if absent is None:
                    log.info("%s are not read (%s)", what, why)
                else:
                    log.warning("%s are not read (%s)", what, why)
                    absent(why)
            if retry_seconds is None:
                return
            await asyncio.sleep(retry_seconds)
        except READ_ERRORS:
            break  # the watch itself retries
    if served is not None:
        served()
    await watch.run()


async def _after_sync(extender: Extender) -> None:
    """Consolidation, capacity requests and the do-not-disrupt marks act, and pods on failed
    devices are told, only on a cache that has every node and pod."""
    await extender.synced.wait()
    await asyncio.gather(
        extender.consolidator.run(),
        extender.requester.run(),
        extender.protector.run(),
        extender.failures.run(),
    )


class _Server(uvicorn.Server):
    """uvicorn re-raises the SIGTERM it caught as soon as serve() returns, which ends the process
    before code after serve() runs: what must happen on shutdown goes in shutdown()."""

    def __init__(
        self, config: uvicorn.Config, on_shutdown: Callable[[], Awaitable[None]] | None
    ) -> None:
        super().__init__(config)
        self.on_shutdown = on_shutdown

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        await super().shutdown(sockets)  # in-flight requests (binds) finish first
        if self.on_shutdown is not None:
            await self.on_shutdown()  # e.g. release the Lease: a standby takes over at once


class _SideServer(uvicorn.Server):
    """The probes' and metrics' port: stopped by the main server, never by signals itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def server_config(app: Any, host: str, port: int, log_level: str, **tls: Any) -> uvicorn.Config:
    """The HTTP server as the extender runs it (bench/nullextender.py serves the same way)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="none",
        http="httptools",
        access_log=False,
        # kube-scheduler talks to us directly: no proxy headers to trust, and no Server/Date
        # headers it would read (each costs per-request work).
        proxy_headers=False,
        server_header=False,
        date_header=False,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=5,
        lifespan="off",
        **tls,
    )


def without_tickets(_: uvicorn.Config, default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
    """uvicorn's server context, sending no TLS session tickets. kube-scheduler's extender client
    (client-go's transport) keeps no session cache, so it never resumes a session: the two
    tickets OpenSSL makes after each handshake were a third of its CPU, and kube-scheduler opens
    a connection (a full handshake) for most binds it sends us (issue 36)."""
    context = default()
    context.num_tickets = 0
    return context


def tls_settings(options: ExtenderOptions) -> dict[str, Any]:
    if options.tls_cert is None:
        return {}
    tls: dict[str, Any] = {
        "ssl_certfile": str(options.tls_cert),
        "ssl_context_factory": without_tickets,
    }
    if options.tls_key is not None:
        tls["ssl_keyfile"] = str(options.tls_key)
    if options.client_ca is not None:
        tls["ssl_ca_certs"] = str(options.client_ca)
        tls["ssl_cert_reqs"] = ssl.CERT_REQUIRED
    return tls


def _warn_if_open(options: ExtenderOptions) -> None:
    if options.client_ca is not None:
        return
    where = f"{options.host}:{options.port}"
    if options.tls_cert is None:
        log.warning(
            "serving plain HTTP on %s (--insecure): anyone who reaches this port can have "
            "pods bound to nodes; give --client-ca with --tls-cert/--tls-key so only "
            "kube-scheduler can (docs/security.md)",
            where,
        )
    else:
        log.warning(
            "serving HTTPS on %s without client certificates (--insecure): any caller that "
            "reaches this port can have pods bound to nodes; add --client-ca",
            where,
        )


async def serve(options: ExtenderOptions) -> None:
    catalog = Catalog.load(options.topology_file)
    config = load_config(options.kubeconfig)
    _warn_if_open(options)
    async with KubeAPI(config) as api:
        extender = wire(
            api,
            catalog,
            scheduler_names=options.scheduler_names,
            wake_rate=options.wake_rate,
            wake_grace=options.wake_grace,
            claim_seconds=options.claim_seconds,
            topology_levels=options.topology_levels,
            consolidation=options.consolidation,
            budget_lease=options.budget_lease,
            capacity=options.capacity,
            do_not_disrupt=options.do_not_disrupt,
            device_failure_action=options.device_failure_action,
            dra=options.dra,
            kueue_hold_seconds=options.kueue_hold_seconds,
        )
        elector = LeaderElector(api, options.election) if options.election else None
        if elector is not None:
            extender.waker.is_leader = lambda: elector.is_leader
            extender.reservations.is_leader = lambda: elector.is_leader
            extender.consolidator.is_leader = lambda: elector.is_leader
            extender.requester.is_leader = lambda: elector.is_leader
            extender.protector.is_leader = lambda: elector.is_leader
            extender.failures.is_leader = lambda: elector.is_leader
            if extender.admissions is not None:
                extender.admissions.is_leader = lambda: elector.is_leader
        app, side_app = build_apps(extender, options.body_limit, elector)
        side = None
        if options.metrics_port:
            side = _SideServer(
                server_config(side_app, options.host, options.metrics_port, options.log_level)
            )
        side_task = asyncio.get_running_loop().create_task(side.serve()) if side else None

        election: list[asyncio.Task[None]] = []  # the elector's loop, once started

        async def on_shutdown() -> None:
            if elector is not None:
                # Stop renewing first: a renewal in flight that lands after the release would
                # name us holder again, and the standby would wait out the whole lease.
                for task in election:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                await elector.release()  # a standby takes over at once
            if side is not None and side_task is not None:
                side.should_exit = True
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(side_task, 10)

        server = _Server(
            server_config(
                app, options.host, options.port, options.log_level, **tls_settings(options)
            ),
            on_shutdown=on_shutdown,
        )
        tasks = start_watches(api, extender)
        returner = MemoryReturner(trim=malloc_trim())
        loop = asyncio.get_running_loop()
        tasks.append(loop.create_task(returner.run(), name="the memory returner"))
        lag = sample_loop_lag(extender.metrics.loop_lag.observe)
        tasks.append(loop.create_task(lag, name="the loop lag sampler"))
        tasks.append(loop.create_task(extender.waker.run(), name="the waker"))
        tasks.append(loop.create_task(extender.reservations.run(), name="the job claim loop"))
        if extender.admissions is not None:
            tasks.append(loop.create_task(extender.admissions.run(), name="the admission check"))
        tasks.append(loop.create_task(_after_sync(extender), name="the loops after sync"))
        if elector is not None:
            election.append(loop.create_task(elector.run(), name="leader election"))
            tasks += election

        failed = asyncio.Event()

        def stop() -> None:
            failed.set()
            server.should_exit = True

        stop_on_failure(tasks, stop)
        log.info(
            "extender listening on %s://%s:%d%s; probes and metrics on http://%s:%s (API "
            "server %s)",
            "https" if options.tls_cert else "http",
            options.host,
            options.port,
            " (client certificates required)" if options.client_ca else "",
            options.host,
            options.metrics_port or "-",
            config.server,
        )
        try:
            await server.serve()
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)
            await extender.events.close()
            await on_shutdown()
        if failed.is_set():
            raise SystemExit(1)  # (its pod's restart count says so too)


def run(options: ExtenderOptions) -> None:
    import uvloop

    setup_logging(options.log_level)
    uvloop.run(serve(options))
