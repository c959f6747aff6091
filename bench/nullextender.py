"""The null extender: kube-scheduler's extender protocol with no work behind it, the floor any
extender pays (issue 36). bench/throughput.py runs it between "without an extender" and ours.

It is served exactly as ours is (the same uvicorn + uvloop + httptools server, `server_config`,
HTTPS with client certificates) and called by the same kube-scheduler configuration (the same
verbs, nodeCacheCapable, weights, TLS). Per verb it does the least that still answers correctly:
- filter: reads the node names (`NodeNames`, or the names of a `Nodes` list; the Pod is skipped
  unread), and every node passes;
- prioritize: the same names, each with score 0;
- bind: one Binding (pods/binding, with the pod's UID as precondition) through the same API
  client ours uses, with the chart's least-privilege ServiceAccount. kube-scheduler delegates
  the bind to an extender with a bindVerb, so the null extender must bind, and one Binding is
  the least a bind is: what kube-scheduler's own DefaultBinder sends. Anything ours writes
  beyond it (the annotations the device plugin reads, events) is ours to pay for;
- preempt: kube-scheduler's victims, unchanged (never called while every pod fits).

With `--bind-writes` its bind makes other API calls, with no decision behind them, to price
them apart from the extender's own work:
- `ours`: the calls ours makes (patch our hand-off annotations on the pod, the Binding
  conditioned on the patched pod, one event, sent in the background as ours sends it):
  configuration `null-writes`;
- `one-write`: the Binding carrying the annotations (kube-apiserver copies a Binding's
  annotations onto the pod with its nodeName, in one write), and the event: configuration
  `null-one-write`, what ours would make with a bind of one write.
The annotations are ours, key for key (core/handoff.py, for one core on device 0 of the node),
as ours would write them for a one-core pod: the chart's admission policy on the extender's pod
writes (`<extender>-pod-writes`) admits no other key for its ServiceAccount, and its evaluation
is part of what a bind costs the API server.

With `--watch-pods` it also keeps a list and watch of every running and pending pod, as ours
does (the same `kube.watching.Watch`, the same field selector, each pod decoded into the same
`kube.objects.Pod`), and keeps nothing of it but each pod's node: configuration `null-watch`, the
floor of any extender that learns which devices are taken from the API, as every extender that
hands out devices must (ours must, to never give the same ids twice across restarts). It answers
/readyz once its list is read, as ours does.

It times its verbs as ours does (from the request's headers to the answer sent, wall time) and
serves the sums as ours' `neuron_scheduler_request_seconds` at GET /metrics, so bench/throughput.py
reads both extenders' time in their handlers alike.

With `--http2` it serves HTTP/2 as well (uvicorn's zttp protocol, ALPN h2; zttp is a dev
dependency only, for these benchmarks): kube-scheduler's transport then sends every call over
one connection instead of opening one (a TLS handshake) whenever its two idle ones are busy
(configurations `null-h2`, `null-writes-h2` and `null-watch-h2`: what would lift the floor;
BENCHMARKS.md's sixteenth sitting of issue 50 measures it, and why it is not adopted).

Run by bench/throughput.py as
    python bench/nullextender.py --kubeconfig K --port P --tls-cert C --tls-key K --client-ca CA
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
import uvloop
from starlette.types import Receive, Scope, Send

from neuron_scheduler.core import handoff
from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.core.resources import NEURONCORE, NeuronRequest
from neuron_scheduler.extender.http import DEFAULT_BODY_LIMIT, read_body
from neuron_scheduler.extender.serve import ExtenderOptions, server_config, tls_settings
from neuron_scheduler.extender.verbs.wire import (
    ExtenderBindingArgs,
    FilterResult,
    HostPriority,
    MetaVictims,
    NodeRefList,
)
from neuron_scheduler.kube.client import KubeAPI, pod_path
from neuron_scheduler.kube.config import load_config
from neuron_scheduler.kube.errors import READ_ERRORS, error_text
from neuron_scheduler.kube.events import EventRecorder
from neuron_scheduler.kube.objects import ObjectRef, Pod
from neuron_scheduler.kube.watching import Watch

log = logging.getLogger("nullextender")


class Names(msgspec.Struct):
    """filter's and prioritize's request, read for the node names only."""

    Nodes: NodeRefList | None = None
    NodeNames: list[str] | None = None

    def names(self) -> list[str]:
        if self.NodeNames is not None:
            return self.NodeNames
        return [node.metadata.name for node in self.Nodes.items] if self.Nodes else []


class Victims(msgspec.Struct):
    NodeNameToMetaVictims: dict[str, MetaVictims] | None = None


_HEADERS = [(b"content-type", b"application/json")]


# What ours writes for a one-core pod placed on core 0 (module docstring).
ONE_CORE = NeuronRequest(NEURONCORE, 1)
CORE_ZERO = Placement((0,), (0,), 0)


async def bind_writing(
    api: KubeAPI, events: EventRecorder, args: ExtenderBindingArgs, writes: str
) -> None:
    """A bind making the API calls `writes` names (module docstring); the event in the
    background, as ours sends it (bind answers before it is written)."""
    annotations: dict[str, str | None] = {
        **handoff.encode(args.Node, ONE_CORE, CORE_ZERO, ("main",), time.time_ns())
    }
    ref = ObjectRef("Pod", args.PodNamespace, args.PodName, args.PodUID)
    if writes == "ours":
        version = await api.patch_annotations(
            args.PodNamespace, args.PodName, args.PodUID, annotations
        )
        await api.bind(
            args.PodNamespace, args.PodName, args.PodUID, args.Node, resource_version=version
        )
    else:
        await api.request(
            "POST",
            pod_path(args.PodNamespace, args.PodName) + "/binding",
            body={
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {
                    "name": args.PodName,
                    "namespace": args.PodNamespace,
                    "uid": args.PodUID,
                    "annotations": annotations,
                },
                "target": {"apiVersion": "v1", "kind": "Node", "name": args.Node},
            },
        )
    ids = annotations[handoff.IDS]
    message = f"Bound to {args.Node} with {NEURONCORE} ids {ids} (devices {ids})"
    events.record(ref, "NeuronAllocated", message, warning=False)


def pod_watch(api: KubeAPI) -> Watch[Pod]:
    """Every pod not finished, as ours watches them; what is kept is each pod's node."""
    nodes: dict[str, str] = {}

    def listed(pods: list[Pod]) -> None:
        nodes.clear()
        nodes.update((pod.metadata.uid, pod.spec.nodeName) for pod in pods)

    def changed(pod: Pod) -> None:
        nodes[pod.metadata.uid] = pod.spec.nodeName

    def deleted(pod: Pod) -> None:
        nodes.pop(pod.metadata.uid, None)

    return Watch(
        api,
        "/api/v1/pods",
        Pod,
        on_list=listed,
        on_change=changed,
        on_delete=deleted,
        params={"fieldSelector": "status.phase!=Succeeded,status.phase!=Failed"},
    )


def app_for(api: KubeAPI, writes: str, watch: Watch[Pod] | None = None) -> Any:
    events = EventRecorder(api)
    names = msgspec.json.Decoder(Names)
    binding = msgspec.json.Decoder(ExtenderBindingArgs)
    victims = msgspec.json.Decoder(Victims)

    async def answer(path: str, body: bytes) -> Any:
        if path == "/filter":
            request = names.decode(body)
            return FilterResult(request.names(), {}, {}).wire(as_nodes=request.Nodes is not None)
        if path == "/prioritize":
            return [HostPriority(name, 0) for name in names.decode(body).names()]
        if path == "/bind":
            args = binding.decode(body)
            try:
                if writes != "binding":
                    await bind_writing(api, events, args, writes)
                else:
                    await api.bind(
                        args.PodNamespace, args.PodName, args.PodUID, args.Node, resource_version=""
                    )
            except READ_ERRORS as error:
                return {"Error": error_text(error)}
            return {"Error": ""}
        if path == "/preempt":
            return {"NodeNameToMetaVictims": victims.decode(body).NodeNameToMetaVictims or {}}
        if path == "/readyz":
            if watch is not None and not watch.synced.is_set():
                raise LookupError(path)  # (404: not ready until the pods are listed)
            return "ok"
        raise LookupError(path)

    # verb -> [calls, seconds]: as ours' neuron_scheduler_request_seconds counts them
    timed: dict[str, list[float]] = {verb: [0, 0.0] for verb in ("filter", "prioritize", "bind")}

    def metrics_page() -> bytes:
        lines = ["# TYPE neuron_scheduler_request_seconds summary"]
        for verb, (calls, seconds) in timed.items():
            lines.append(f'neuron_scheduler_request_seconds_count{{verb="{verb}"}} {calls}')
            lines.append(f'neuron_scheduler_request_seconds_sum{{verb="{verb}"}} {seconds}')
        return ("\n".join(lines) + "\n").encode()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        start = time.perf_counter()
        status = 200
        try:
            body = await read_body(scope, receive, DEFAULT_BODY_LIMIT)
            if scope["path"] == "/metrics":
                page = metrics_page()
                headers = [(b"content-type", b"text/plain; version=0.0.4")]
                headers.append((b"content-length", str(len(page)).encode()))
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": page})
                return
            payload = msgspec.json.encode(await answer(scope["path"], body))
        except LookupError:
            status, payload = 404, b'{"Error":"unknown path"}'
        except msgspec.DecodeError as error:
            status, payload = 400, msgspec.json.encode({"Error": str(error)})
        length = (b"content-length", str(len(payload)).encode())
        await send(
            {"type": "http.response.start", "status": status, "headers": [*_HEADERS, length]}
        )
        await send({"type": "http.response.body", "body": payload})
        verb = timed.get(scope["path"].lstrip("/"))
        if verb is not None:
            verb[0] += 1
            verb[1] += time.perf_counter() - start

    return app


async def serve(options: ExtenderOptions, writes: str, http2: bool, watch_pods: bool) -> None:
    async with KubeAPI(load_config(options.kubeconfig)) as api:
        watch = pod_watch(api) if watch_pods else None
        watching = asyncio.create_task(watch.run()) if watch is not None else None
        app = app_for(api, writes, watch)
        tls = tls_settings(options)
        config = server_config(app, options.host, options.port, options.log_level, **tls)
        if http2:
            config.http, config.http2 = "zttp", True
        await uvicorn.Server(config).serve()
        if watching is not None:
            watching.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tls-cert", type=Path, required=True)
    parser.add_argument("--tls-key", type=Path, required=True)
    parser.add_argument("--client-ca", type=Path, required=True)
    writes = ("binding", "ours", "one-write")
    parser.add_argument("--bind-writes", choices=writes, default="binding")
    parser.add_argument("--http2", action="store_true")
    parser.add_argument("--watch-pods", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    options = ExtenderOptions(
        kubeconfig=args.kubeconfig,
        host=args.host,
        port=args.port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        client_ca=args.client_ca,
        log_level="warning",
    )
    uvloop.run(serve(options, args.bind_writes, args.http2, args.watch_pods))


if __name__ == "__main__":
    main()
