"""The extender's HTTP face: the verbs kube-scheduler calls, health, readiness and metrics.

The verbs are plain ASGI endpoints in front of Starlette, which serves the rest: its routing,
middleware and request/response objects cost a noticeable share of a large filter, and a verb
needs none of them (BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.resources import RequestError
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.verbs.wire import (
    BadRequest,
    ExtenderArgs,
    ExtenderBindingArgs,
    ExtenderPreemptionArgs,
)
from neuron_scheduler.extender.wiring import Extender
from neuron_scheduler.kube.decoding import shallow
from neuron_scheduler.kube.election import LeaderElector

log = logging.getLogger("neuron_scheduler.server")

DEFAULT_BODY_LIMIT = 64 * 1024 * 1024  # a full 5,000-node NodeList is well under this


class Refused(Exception):
    """A request answered with an HTTP error status and a JSON `Error`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise Refused(413, f"request body of {int(value)} bytes is over the {limit} limit")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"request body is over the {limit} byte limit")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


_JSON_HEADERS = [(b"content-type", b"application/json")]


def _line(error: BaseException) -> str:
    """An error for an answer: one line, and short (it may quote the request)."""
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    length = (b"content-length", str(len(body)).encode())
    await send({"type": "http.response.start", "status": status, "headers": [*headers, length]})
    await send({"type": "http.response.body", "body": body})


VerbHandler = Callable[[Any, bytes], Awaitable[Any]]


class Verb:
    """One extender verb: POST a JSON body of `kind`, get the handler's answer as JSON. Bad
    requests are 4xx with a JSON `Error`; a bug is a logged 500 and the server keeps serving."""

    def __init__(
        self,
        name: str,
        kind: type[Any],
        handler: VerbHandler,
        metrics: Metrics,
        body_limit: int,
        kept_answer: Callable[[bytes], bytes | None] | None = None,
    ) -> None:
        """`kept_answer`: the answer, encoded, to a request answered already, from its body
        alone (None: decode it and ask the handler)."""
        self.name = name
        self.decoder = msgspec.json.Decoder(kind)
        self.handler = handler
        self.kept_answer = kept_answer
        self.timer = metrics.latency.labels(name)
        self.body_limit = body_limit

    async def _respond(self, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        name = self.name
        if scope["method"] != "POST":
            raise Refused(405, f"{name}: use POST (kube-scheduler's extender protocol)")
        body = await read_body(scope, receive, self.body_limit)
        if self.kept_answer is not None:
            answer = self.kept_answer(body)
            if answer is not None:
                return 200, answer
        try:
            try:
                args = self.decoder.decode(body)
            except RecursionError:
                # Nested past the limit where nothing reads: without nodeCacheCapable a Node's
                # managedFields come whole (kube-scheduler strips them from pods only), and one
                # node would otherwise fail every request. Read as if those values were null.
                body = shallow(body)
                args = self.decoder.decode(body)
        except RecursionError as error:  # still: not JSON that the shallow pass could cut
            raise Refused(400, f"{name}: request nests too deeply") from error
        except msgspec.ValidationError as error:
            raise Refused(400, f"{name}: malformed request: {_line(error)}") from error
        except msgspec.DecodeError as error:
            raise Refused(400, f"{name}: request is not JSON: {_line(error)}") from error
        except UnicodeDecodeError as error:  # msgspec reads strings as UTF-8 where it keeps them
            raise Refused(400, f"{name}: request is not valid UTF-8: {_line(error)}") from error
        try:
            return 200, msgspec.json.encode(await self.handler(args, body))
        except (BadRequest, RequestError) as error:
            raise Refused(400, f"{name}: {_line(error)}") from error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.perf_counter()
        headers = _JSON_HEADERS
        try:
            status, body = await self._respond(scope, receive)
        except ClientDisconnect:
            return  # nobody is left to answer
        except Refused as refused:
            status, body = refused.status, msgspec.json.encode({"Error": str(refused)})
            if status == 405:
                headers = [*headers, (b"allow", b"POST")]
        except Exception as error:  # a bug: answer it, log it, keep serving
            log.exception("unexpected error answering %s: %s", self.name, loggable(error))
            status = 500
            message = f"internal error: {type(error).__name__}: {error}"
            body = msgspec.json.encode({"Error": message})
        await _answer(send, status, body, headers)
        self.timer.observe(time.perf_counter() - start)


def _text(body: str, status: int = 200) -> Response:
    return Response(body, status, media_type="text/plain")


def _json_error(message: str, status: int) -> Response:
    return Response(msgspec.json.encode({"Error": message}), status, media_type="application/json")


def build_apps(
    extender: Extender,
    body_limit: int = DEFAULT_BODY_LIMIT,
    elector: LeaderElector | None = None,
) -> tuple[ASGIApp, ASGIApp]:
    """(the verbs' app, the probes' and metrics' app): the first serves kube-scheduler (behind
    client-certificate TLS when configured) and /healthz, /readyz; the second /healthz, /readyz
    and /metrics on a port of its own, so probes and Prometheus need no client certificate.

    With an elector, only the leader is ready and binds (non-leaders answer bind with an
    Error, which kube-scheduler retries); filter and prioritize are read-only and always served."""
    judge, binder, metrics, synced = (
        extender.judge,
        extender.binder,
        extender.metrics,
        extender.synced,
    )

    async def do_filter(args: ExtenderArgs, body: bytes) -> Any:
        return judge.filter(args, body).wire(as_nodes=args.Nodes is not None)

    async def do_prioritize(args: ExtenderArgs, body: bytes) -> Any:
        return judge.prioritize(args, body)

    async def do_prioritize_claims(args: ExtenderArgs, body: bytes) -> Any:
        return judge.prioritize_claims(args, body)

    async def do_prioritize_claims_packing(args: ExtenderArgs, body: bytes) -> Any:
        return judge.prioritize_claims_packing(args, body)

    async def do_bind(args: ExtenderBindingArgs, _: bytes) -> Any:
        if elector is not None and not elector.is_leader:
            metrics.binds.labels("not_leader").inc()
            return {
                "Error": f"this neuron-scheduler replica ({elector.config.identity}) is not the "
                f"leader (Lease holder: {elector.holder or 'none'}); not binding"
            }
        return {"Error": await binder.bind(args)}

    async def do_preempt(args: ExtenderPreemptionArgs, _: bytes) -> Any:
        return await extender.preemptor.preempt(args)

    async def healthz(_: Request) -> Response:
        return _text("ok\n")

    async def readyz(_: Request) -> Response:
        if not synced.is_set():
            return _text("cache not synced\n", 503)
        if elector is not None and not elector.is_leader:
            return _text(f"not the leader (holder: {elector.holder or 'none'})\n", 503)
        return _text("ok\n")

    async def metrics_page(_: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        detail = exc.detail
        if exc.status_code == 404:
            detail = (
                "unknown path; the extender serves POST /filter, /prioritize, /bind, /preempt, "
                "/prioritize-claims, /prioritize-claims-packing (and /metrics on its metrics port)"
            )
        return _json_error(detail, exc.status_code)

    async def crash(_: Request, exc: Exception) -> Response:
        log.exception("unexpected error answering a request: %s", loggable(exc))
        return _json_error(f"internal error: {type(exc).__name__}: {exc}", 500)

    verbs = {
        "/filter": Verb("filter", ExtenderArgs, do_filter, metrics, body_limit),
        "/prioritize": Verb(
            "prioritize",
            ExtenderArgs,
            do_prioritize,
            metrics,
            body_limit,
            kept_answer=judge.answer_as_filtered,
        ),
        # Pods with our DRA claims (prioritize-only extender entries without managedResources).
        "/prioritize-claims": Verb(
            "prioritize-claims", ExtenderArgs, do_prioritize_claims, metrics, body_limit
        ),
        "/prioritize-claims-packing": Verb(
            "prioritize-claims-packing",
            ExtenderArgs,
            do_prioritize_claims_packing,
            metrics,
            body_limit,
        ),
        "/bind": Verb("bind", ExtenderBindingArgs, do_bind, metrics, body_limit),
        "/preempt": Verb("preempt", ExtenderPreemptionArgs, do_preempt, metrics, body_limit),
    }
    probes = [Route("/healthz", healthz), Route("/readyz", readyz)]
    handlers: Any = {HTTPException: http_error, Exception: crash}
    rest = Starlette(routes=probes, exception_handlers=handlers)
    side = Starlette(routes=[*probes, Route("/metrics", metrics_page)], exception_handlers=handlers)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = verbs.get(scope["path"]) if scope["type"] == "http" else None
        await (endpoint or rest)(scope, receive, send)

    return app, side
