"""The extender process: wires the ledger, plugins, judge and binder, runs the watches, the Lease
and the HTTP server."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from neuron_scheduler.commandline import setup_logging
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.extender.http import DEFAULT_BODY_LIMIT, build_app
from neuron_scheduler.extender.ledger import Ledger
from neuron_scheduler.extender.plugins import ClusterView
from neuron_scheduler.extender.wiring import wire
from neuron_scheduler.kube.client import NODES, PODS, KubeAPI
from neuron_scheduler.kube.config import load_config
from neuron_scheduler.kube.election import ElectionConfig, LeaderElector
from neuron_scheduler.kube.objects import Node, Pod
from neuron_scheduler.kube.watching import Watch

log = logging.getLogger("neuron_scheduler.server")
T = TypeVar("T")


@dataclass
class ExtenderOptions:
    kubeconfig: Path | None = None
    host: str = "0.0.0.0"
    port: int = 12345
    tls_cert: Path | None = None
    tls_key: Path | None = None
    topology_file: Path | None = None
    log_level: str = "info"
    body_limit: int = DEFAULT_BODY_LIMIT
    election: ElectionConfig | None = None


def start_watches(
    api: KubeAPI, views: Sequence[ClusterView], synced: asyncio.Event, ledger: Ledger
) -> list[asyncio.Task[None]]:
    """List-then-watch nodes and pods into every view; `synced` is set after both first lists."""

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
    )
    pods: Watch[Pod] = Watch(
        api,
        PODS,
        Pod,
        on_list=each(lambda view, pods: view.replace_pods(pods)),
        on_change=each(lambda view, pod: view.apply_pod(pod)),
        on_delete=each(lambda view, pod: view.remove_pod(pod.metadata.uid)),
        # Finished pods hold nothing; when one finishes the watch reports it as deleted.
        params={"fieldSelector": "status.phase!=Succeeded,status.phase!=Failed"},
    )

    async def mark_synced() -> None:
        await nodes.synced.wait()
        await pods.synced.wait()
        # The first list is most of the heap (every cached pod and node) and lives as long as the
        # process: frozen, the collector stops rescanning it, which at tens of thousands of pods
        # was a pause every few hundred requests and the largest part of filter's p99.
        gc.collect()
        gc.freeze()
        synced.set()
        log.info(
            "cache synced: %d Neuron nodes, %d pods holding Neuron resources",
            len(ledger.nodes),
            ledger.pod_count,
        )

    async def pods_after_nodes() -> None:
        # Pods are read against their nodes' topologies (ids beyond a node's cores are rejected,
        # ids given by device count need its cores per device): nodes first.
        await nodes.synced.wait()
        await pods.run()

    loop = asyncio.get_running_loop()
    return [
        loop.create_task(nodes.run()),
        loop.create_task(pods_after_nodes()),
        loop.create_task(mark_synced()),
    ]


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


async def serve(options: ExtenderOptions) -> None:
    catalog = Catalog.load(options.topology_file)
    config = load_config(options.kubeconfig)
    async with KubeAPI(config) as api:
        extender = wire(api, catalog)
        elector = LeaderElector(api, options.election) if options.election else None
        app = build_app(extender, options.body_limit, elector)
        server = _Server(
            uvicorn.Config(
                app,
                host=options.host,
                port=options.port,
                loop="none",
                http="httptools",
                access_log=False,
                # kube-scheduler talks to us directly: no proxy headers to trust, and no
                # Server/Date headers it would read (each costs per-request work).
                proxy_headers=False,
                server_header=False,
                date_header=False,
                log_level=options.log_level.lower(),
                ssl_certfile=str(options.tls_cert) if options.tls_cert else None,
                ssl_keyfile=str(options.tls_key) if options.tls_key else None,
                timeout_graceful_shutdown=5,
                lifespan="off",
            ),
            on_shutdown=elector.release if elector is not None else None,
        )
        tasks = start_watches(api, extender.views, extender.synced, extender.ledger)
        if elector is not None:
            tasks.append(asyncio.get_running_loop().create_task(elector.run()))
        log.info(
            "extender listening on %s://%s:%d (API server %s)",
            "https" if options.tls_cert else "http",
            options.host,
            options.port,
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
            if elector is not None:
                await elector.release()  # a standby takes over now, not after the lease expires


def run(options: ExtenderOptions) -> None:
    import uvloop

    setup_logging(options.log_level)
    uvloop.run(serve(options))
