"""The extender's HTTP server: routes, body limits, health, metrics, and the watch tasks."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from neuron_scheduler.catalog import Catalog
from neuron_scheduler.election import ElectionConfig, LeaderElector
from neuron_scheduler.extender import (
    BadRequest,
    Extender,
    ExtenderArgs,
    ExtenderBindingArgs,
)
from neuron_scheduler.kubeapi import KubeAPI, load_config
from neuron_scheduler.ledger import Ledger
from neuron_scheduler.objects import Node, Pod
from neuron_scheduler.requests import RequestError
from neuron_scheduler.watching import Watch

log = logging.getLogger("neuron_scheduler.server")

DEFAULT_BODY_LIMIT = 64 * 1024 * 1024  # a full 5,000-node NodeList is well under this


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, media_type="application/json")


def error_response(message: str, status: int) -> Response:
    return json_response({"Error": message}, status)


class _Refused(Exception):
    """A request answered with an HTTP error status and a JSON `Error`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise _Refused(413, f"request body of {int(value)} bytes is over the {limit} limit")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _Refused(413, f"request body is over the {limit} byte limit")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


_JSON_HEADERS = [(b"content-type", b"application/json")]


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length]})
    await send({"type": "http.response.body", "body": body})


VerbHandler = Callable[[Any, bytes], Awaitable[Any]]


def build_app(
    extender: Extender,
    body_limit: int = DEFAULT_BODY_LIMIT,
    elector: LeaderElector | None = None,
) -> ASGIApp:
    """With an elector, only the leader is ready and binds (non-leaders answer bind with an
    Error, which kube-scheduler retries); filter and prioritize are read-only and always served.

    The three verbs kube-scheduler calls are plain ASGI endpoints in front of Starlette, which
    serves the rest: its routing, middleware and request/response objects were a tenth of a
    500-node filter's time, and a verb needs none of them."""
    latency = extender.metrics.latency

    def verb(name: str, kind: type[Any], handler: VerbHandler) -> ASGIApp:
        decoder = msgspec.json.Decoder(kind)
        timer = latency.labels(name)

        async def answer(scope: Scope, receive: Receive) -> tuple[int, bytes]:
            if scope["method"] != "POST":
                raise _Refused(405, f"{name}: use POST (kube-scheduler's extender protocol)")
            body = await read_body(scope, receive, body_limit)
            try:
                args = decoder.decode(body)
            except msgspec.ValidationError as error:
                raise _Refused(400, f"{name}: malformed request: {error}") from error
            except msgspec.DecodeError as error:
                raise _Refused(400, f"{name}: request is not JSON: {error}") from error
            try:
                return 200, msgspec.json.encode(await handler(args, body))
            except (BadRequest, RequestError) as error:
                raise _Refused(400, f"{name}: {error}") from error

        async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
            start = time.perf_counter()
            headers = _JSON_HEADERS
            try:
                status, body = await answer(scope, receive)
            except ClientDisconnect:
                return  # nobody is left to answer
            except _Refused as refused:
                status, body = refused.status, msgspec.json.encode({"Error": str(refused)})
                if status == 405:
                    headers = [*headers, (b"allow", b"POST")]
            except Exception as error:  # a bug: answer it, log it, keep serving
                log.exception("unexpected error answering %s: %s", name, error)
                status = 500
                message = f"internal error: {type(error).__name__}: {error}"
                body = msgspec.json.encode({"Error": message})
            await _answer(send, status, body, headers)
            timer.observe(time.perf_counter() - start)

        return endpoint

    async def do_filter(args: ExtenderArgs, body: bytes) -> Any:
        return extender.filter(args, body).wire(as_nodes=args.Nodes is not None)

    async def do_prioritize(args: ExtenderArgs, body: bytes) -> Any:
        return extender.prioritize(args, body)

    async def do_bind(args: ExtenderBindingArgs, _: bytes) -> Any:
        if elector is not None and not elector.is_leader:
            extender.metrics.binds.labels("not_leader").inc()
            return {
                "Error": f"this neuron-scheduler replica ({elector.config.identity}) is not the "
                f"leader (Lease holder: {elector.holder or 'none'}); not binding"
            }
        return {"Error": await extender.bind(args)}

    async def healthz(_: Request) -> Response:
        return Response("ok\n", media_type="text/plain")

    async def readyz(_: Request) -> Response:
        if not extender.ready.is_set():
            return Response("cache not synced\n", 503, media_type="text/plain")
        if elector is not None and not elector.is_leader:
            holder = elector.holder or "none"
            return Response(f"not the leader (holder: {holder})\n", 503, media_type="text/plain")
        return Response("ok\n", media_type="text/plain")

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(extender.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        detail = exc.detail
        if exc.status_code == 404:
            detail = "unknown path; the extender serves POST /filter, /prioritize, /bind"
        return error_response(detail, exc.status_code)

    async def crash(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error answering a request: %s", exc)
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    verbs = {
        "/filter": verb("filter", ExtenderArgs, do_filter),
        "/prioritize": verb("prioritize", ExtenderArgs, do_prioritize),
        "/bind": verb("bind", ExtenderBindingArgs, do_bind),
    }
    rest = Starlette(
        routes=[Route("/healthz", healthz), Route("/readyz", readyz), Route("/metrics", metrics)],
        exception_handlers={HTTPException: http_error, Exception: crash},
    )

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = verbs.get(scope["path"]) if scope["type"] == "http" else None
        await (endpoint or rest)(scope, receive, send)

    return app


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


def start_watches(api: KubeAPI, ledger: Ledger, extender: Extender) -> list[asyncio.Task[None]]:
    nodes: Watch[Node] = Watch(
        api,
        "/api/v1/nodes",
        Node,
        on_list=ledger.replace_nodes,
        on_change=ledger.apply_node,
        on_delete=lambda node: ledger.remove_node(node.metadata.name),
    )
    pods: Watch[Pod] = Watch(
        api,
        "/api/v1/pods",
        Pod,
        on_list=ledger.replace_pods,
        on_change=ledger.apply_pod,
        on_delete=lambda pod: ledger.remove_pod(pod.metadata.uid),
        # Finished pods hold nothing; when one finishes the watch reports it as deleted.
        params={"fieldSelector": "status.phase!=Succeeded,status.phase!=Failed"},
    )

    async def mark_ready() -> None:
        await nodes.synced.wait()
        await pods.synced.wait()
        # The first list is most of the heap (every cached pod and node) and lives as long as the
        # process: frozen, the collector stops rescanning it, which at 50,000 pods was a ~30 ms
        # pause every few hundred requests, the largest part of filter's p99.
        gc.collect()
        gc.freeze()
        extender.ready.set()
        log.info(
            "cache synced: %d Neuron nodes, %d pods holding Neuron resources",
            len(ledger.nodes),
            ledger.pod_count,
        )

    loop = asyncio.get_running_loop()
    return [
        loop.create_task(nodes.run()),
        loop.create_task(pods.run()),
        loop.create_task(mark_ready()),
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
        ledger = Ledger(catalog)
        extender = Extender(ledger, api)
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
        tasks = start_watches(api, ledger, extender)
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
            if elector is not None:
                await elector.release()  # a standby takes over now, not after the lease expires


def run(options: ExtenderOptions) -> None:
    import uvloop

    logging.basicConfig(
        level=options.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    uvloop.run(serve(options))
