"""The scheduler extender's verbs: filter, prioritize and bind, over the ledger and the API.

kube-scheduler's wire types (k8s.io/kube-scheduler/extender/v1) have no json tags, so the JSON
keys are the Go field names: `Pod`, `Nodes`, `NodeNames`, `FailedNodes`, ...
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import aiohttp
import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from neuron_scheduler import annotations as handoff
from neuron_scheduler.allocation import (
    Decision,
    Placement,
    Policy,
    Refusal,
    allocate,
    busy_devices,
    largest_free_run,
)
from neuron_scheduler.kubeapi import ApiError, KubeAPI
from neuron_scheduler.ledger import Ledger
from neuron_scheduler.objects import (
    Node,
    NodeName,
    NodeRef,
    NodeRefList,
    Pod,
    assignment,
    neuron_request,
    node_topology,
    sent_nodes,
)
from neuron_scheduler.requests import NeuronRequest, RequestError
from neuron_scheduler.topology import format_ids
from neuron_scheduler.ultraserver.placement import UnitPlacement

log = logging.getLogger("neuron_scheduler.extender")


class ExtenderArgs(msgspec.Struct):
    Pod: Pod | None = None
    Nodes: NodeRefList | None = None
    NodeNames: list[str] | None = None


class HostPriority(msgspec.Struct, gc=False):
    """One node's score in prioritize's answer (a Struct: 500 of them encode faster than dicts).

    Not tracked by the garbage collector (a name and an int cannot form a cycle): 500 tracked
    objects per answer set off a young collection almost every request."""

    Host: str
    Score: int


class ExtenderBindingArgs(msgspec.Struct):
    PodName: str = ""
    PodNamespace: str = ""
    PodUID: str = ""
    Node: str = ""


def describe(error: BaseException) -> str:
    if isinstance(error, ApiError):
        return error.message
    return str(error) or type(error).__name__


class BadRequest(ValueError):
    """A request kube-scheduler would never send; answered with HTTP 400."""


@dataclass(slots=True)
class FilterResult:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]

    def wire(self, as_nodes: bool) -> dict[str, Any]:
        """The answer in the form the request came in: kube-scheduler with nodeCacheCapable
        sends NodeNames and reads NodeNames back; without it, sends Nodes and reads Nodes (and
        a null Nodes would then mean that no node fits). NodeNames is always explicit."""
        return {
            "Nodes": (
                {"metadata": {}, "items": list(map(NodeRef, map(NodeName, self.passed)))}
                if as_nodes
                else None
            ),
            "NodeNames": self.passed,
            "FailedNodes": self.failed,
            "FailedAndUnresolvableNodes": self.unresolvable,
            "Error": "",
        }


class Metrics:
    def __init__(self, ledger: Ledger) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "neuron_scheduler_request_seconds",
            "Time to answer kube-scheduler, by verb",
            ["verb"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
        )
        self.filter_outcomes = Counter(
            "neuron_scheduler_filter_nodes",
            "Nodes judged by filter, by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.binds = Counter(
            "neuron_scheduler_binds",
            "Bind requests, by result",
            ["result"],
            registry=self.registry,
        )
        self.rollbacks = Counter(
            "neuron_scheduler_rollbacks",
            "Binds whose reservation and annotations were rolled back after an API error",
            registry=self.registry,
        )
        self.bind_work = Histogram(
            "neuron_scheduler_bind_work_seconds",
            "Bind's own work under the node lock, excluding API round trips",
            registry=self.registry,
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01),
        )
        self.registry.register(_NodeCollector(ledger))


class _NodeCollector(Collector):
    """Per-node free devices and largest free block, computed at scrape time (not per change)."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterable[GaugeMetricFamily]:
        free = GaugeMetricFamily(
            "neuron_scheduler_node_free_devices", "Devices with no core in use", labels=["node"]
        )
        block = GaugeMetricFamily(
            "neuron_scheduler_node_largest_free_block",
            "Most devices one request could still get on the node",
            labels=["node"],
        )
        pods = GaugeMetricFamily(
            "neuron_scheduler_cached_pods", "Pods holding Neuron resources in the cache"
        )
        for name, entry in list(self.ledger.nodes.items()):
            busy = busy_devices(entry.topology, self.ledger.state(name).used_cores)
            free.add_metric([name], entry.topology.devices - busy.bit_count())
            block.add_metric([name], largest_free_run(entry.topology, busy))
        pods.add_metric([], self.ledger.pod_count)
        yield free
        yield block
        yield pods


class Extender:
    def __init__(
        self, ledger: Ledger, api: KubeAPI | None, policy: Policy = Policy.BEST_FIT
    ) -> None:
        self.ledger = ledger
        self.api = api
        self.policy = policy
        self.metrics = Metrics(ledger)
        self.ready = asyncio.Event()
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._background: set[asyncio.Task[None]] = set()
        self.ultraserver = UnitPlacement(ledger.ultraservers)  # MPI workers: one unit per job

    # --- filter and prioritize ---------------------------------------------------------------

    @staticmethod
    def _names(args: ExtenderArgs, body: bytes | None) -> list[str]:
        if args.NodeNames is not None:
            return args.NodeNames
        if args.Nodes is not None:
            if body is None:  # a caller's mistake, not the client's: nodes would go unread
                raise TypeError("a request with a NodeList needs its JSON body as well")
            return [node.metadata.name for node in args.Nodes.items]
        raise BadRequest("request has neither NodeNames nor Nodes")

    def _stranger_judge(
        self, args: ExtenderArgs, request: NeuronRequest, body: bytes | None
    ) -> Callable[[str], Decision | str | None]:
        """Judges nodes the cache does not know: from the request's own copy of the node when
        kube-scheduler sent one (None: it has no Neuron resources), else a reason to wait.
        `body` is the request's JSON, read again in full only when such a node turns up."""
        nodes: dict[str, Node | str] | None = None

        def judge(name: str) -> Decision | str | None:
            nonlocal nodes
            if nodes is None:
                nodes = sent_nodes(body) if args.Nodes is not None and body else {}
            node = nodes.get(name)
            if node is None:
                return "node is not in neuron-scheduler's cache yet"
            if isinstance(node, str):
                return Refusal(node, True)
            try:
                resolved = node_topology(node, self.ledger.catalog)
            except RequestError as error:
                return Refusal(f"cannot read the node's labels or capacity: {error}", True)
            if resolved is None:
                return None
            return allocate(resolved.topology, self.ledger.state(name), request, self.policy)

        return judge

    @staticmethod
    def _request(args: ExtenderArgs) -> tuple[Pod, NeuronRequest | None]:
        if args.Pod is None:
            raise BadRequest("request has no Pod")
        return args.Pod, neuron_request(args.Pod)

    def filter(self, args: ExtenderArgs, body: bytes | None = None) -> FilterResult:
        """`body`: the request's JSON, needed when it sends a NodeList (`args.Nodes` holds only
        names; a node the cache has not seen is read from the body)."""
        names = self._names(args, body)
        try:
            pod, request = self._request(args)
        except RequestError as error:
            self.metrics.filter_outcomes.labels("invalid_request").inc(len(names))
            reason = str(error)
            log.info("POD %s cannot be placed: %s", args.Pod.key if args.Pod else "?", reason)
            return FilterResult([], {}, dict.fromkeys(names, reason))
        if request is None:
            self.metrics.filter_outcomes.labels("no_neuron_request").inc(len(names))
            return FilterResult(list(names), {}, {})
        verdicts = self.ledger.verdicts(request, self.policy)
        fits = verdicts.fits
        outcomes: defaultdict[str, int] = defaultdict(int)
        if fits.issuperset(names):
            # Every node is known to fit: the usual answer, from one set check that runs in C
            # (500 names in ~15 us; deciding node by node in Python took four times that).
            result = FilterResult(list(names), {}, {})
            outcomes["fits"] = len(names)
        else:
            self.ledger.judge(names, request, self.policy)
            result = FilterResult([name for name in names if name in fits], {}, {})
            outcomes["fits"] = len(result.passed)
        if len(result.passed) < len(names):
            # The slow path, only for nodes that do not fit (or that the cache does not know).
            late_fits = set()
            decisions = verdicts.decisions
            stranger = self._stranger_judge(args, request, body)
            for name in names:
                if name in fits:
                    continue
                decision = decisions.get(name) or stranger(name)
                if isinstance(decision, str):
                    result.failed[name] = decision
                    outcomes["not_in_cache"] += 1
                elif decision is None:
                    result.unresolvable[name] = "node advertises no Neuron resources"
                    outcomes["no_neuron_node"] += 1
                elif isinstance(decision, Placement):
                    late_fits.add(name)
                    outcomes["fits"] += 1
                elif decision.unresolvable:
                    result.unresolvable[name] = decision.reason
                    outcomes["unresolvable"] += 1
                else:
                    result.failed[name] = decision.reason
                    outcomes["no_fit"] += 1
            if late_fits:
                result.passed = [name for name in names if name in fits or name in late_fits]
        result.passed, narrowed = self.ultraserver.filter(pod, result.passed, time.monotonic())
        if narrowed:  # UltraServer workers: see neuron_scheduler.ultraserver.placement
            result.failed.update(narrowed)
            outcomes["fits"] -= len(narrowed)
            outcomes["ultraserver_unit"] += len(narrowed)
        for outcome, count in outcomes.items():
            self.metrics.filter_outcomes.labels(outcome).inc(count)
        self._log_filter(pod, request, result)
        return result

    @staticmethod
    def _log_filter(pod: Pod, request: NeuronRequest, result: FilterResult) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        for name in result.passed[:5]:
            log.info("POD %s fits in Node:%s", pod.key, name)
        shown = result.passed[:20]
        more = f" ... and {len(result.passed) - 20} more" if len(result.passed) > 20 else ""
        log.info(
            "Filtered nodes for POD %s (%s): [%s]%s",
            pod.key,
            request.describe(),
            " ".join(shown),
            more,
        )
        failed = {**result.failed, **result.unresolvable}
        if failed:
            items = list(failed.items())[:10]
            text = " ".join(f"{name}:{reason}" for name, reason in items)
            more = f" ... and {len(failed) - 10} more" if len(failed) > 10 else ""
            log.info("Failed nodes for POD %s: map[%s]%s", pod.key, text, more)

    def prioritize(self, args: ExtenderArgs, body: bytes | None = None) -> list[HostPriority]:
        names = self._names(args, body)
        try:
            _, request = self._request(args)
        except RequestError:
            request = None
        if request is None:
            return list(map(HostPriority, names, repeat(0)))
        scores = self.ledger.verdicts(request, self.policy).scores
        try:  # usually every node has a kept score (filter just asked about the same nodes)
            return list(map(HostPriority, names, map(scores.__getitem__, names)))
        except KeyError:
            pass
        self.ledger.judge(names, request, self.policy)
        try:
            return list(map(HostPriority, names, map(scores.__getitem__, names)))
        except KeyError:  # a node the cache has not seen
            pass
        stranger = self._stranger_judge(args, request, body)
        answer = []
        for name in names:
            score = scores.get(name)
            if score is None:
                decision = stranger(name)
                score = decision.score if isinstance(decision, Placement) else 0
            answer.append(HostPriority(name, score))
        return answer

    # --- bind --------------------------------------------------------------------------------

    async def bind(self, args: ExtenderBindingArgs) -> str:
        """Empty string on success, else the error kube-scheduler shows and retries on."""
        if not (args.PodName and args.PodNamespace and args.PodUID and args.Node):
            raise BadRequest("bind needs PodName, PodNamespace, PodUID and Node")
        if self.api is None:
            raise RuntimeError("bind needs an API client")
        if not self.ready.is_set():
            self.metrics.binds.labels("not_ready").inc()
            return "neuron-scheduler is starting: its cache of pods and nodes is not synced yet"
        key = f"{args.PodNamespace}/{args.PodName}"
        try:
            pod = msgspec.json.decode(
                await self.api.get(f"/api/v1/namespaces/{args.PodNamespace}/pods/{args.PodName}"),
                type=Pod,
            )
        except (ApiError, aiohttp.ClientError, TimeoutError, OSError) as error:
            self.metrics.binds.labels("failure").inc()
            return f"cannot read pod {key}: {describe(error)}"
        if pod.metadata.uid != args.PodUID:
            self.metrics.binds.labels("failure").inc()
            return (
                f"pod {key} has UID {pod.metadata.uid}, not {args.PodUID}: it was deleted "
                "and created again; not binding"
            )
        if pod.spec.nodeName:
            return self._already_bound(pod, args.Node)
        try:
            request = neuron_request(pod)
        except RequestError as error:
            self.metrics.binds.labels("failure").inc()
            return str(error)
        if request is None:
            return await self._plain_bind(pod, args.Node)

        start = time.perf_counter()
        async with self._locks[args.Node]:
            entry = self.ledger.nodes.get(args.Node)
            if entry is None:
                self.metrics.binds.labels("failure").inc()
                return f"node {args.Node} is not a Neuron node in neuron-scheduler's cache"
            self.ledger.release(pod.metadata.uid)  # a leftover from an earlier failed attempt
            decision = allocate(entry.topology, self.ledger.state(args.Node), request, self.policy)
            if isinstance(decision, Refusal):
                self.metrics.binds.labels("failure").inc()
                self._event(pod, "FailedNeuronAllocation", f"{args.Node}: {decision.reason}", True)
                return f"node {args.Node}: {decision.reason}"
            # Held from here on, so concurrent filters and binds on this node see it taken
            # while the API calls below are in flight (outside the lock).
            self.ledger.reserve(pod.metadata.uid, key, args.Node, decision.core_mask)
            # An MPI worker counts on its node from here too: kube-scheduler asks about the next
            # worker of the job before this binding is visible in the watch.
            self.ledger.ultraservers.apply_pod(
                msgspec.structs.replace(
                    pod, spec=msgspec.structs.replace(pod.spec, nodeName=args.Node)
                )
            )
            values = handoff.encode(
                args.Node, request, decision, pod.container_names, time.time_ns()
            )
        self.metrics.bind_work.observe(time.perf_counter() - start)
        return await self._write(pod, args.Node, request, decision, values)

    async def _write(
        self,
        pod: Pod,
        node: str,
        request: NeuronRequest,
        placement: Placement,
        values: dict[str, str],
    ) -> str:
        assert self.api is not None
        meta = pod.metadata
        try:
            await self.api.patch_pod_annotations(meta.namespace, meta.name, meta.uid, dict(values))
            await self.api.bind(meta.namespace, meta.name, meta.uid, node)
        except (ApiError, aiohttp.ClientError, TimeoutError, OSError) as error:
            if await self._bound_anyway(pod, node):
                # The binding went through although its answer was an error (a timeout, a
                # retried request): the pod holds these ids now, so keep them.
                log.warning(
                    "bind of %s to %s reported %s, but the pod is bound; keeping ids",
                    pod.key,
                    node,
                    error,
                )
            else:
                await self._rollback(pod, error)
                return f"binding {pod.key} to {node} failed: {describe(error)}"
        ids = values[handoff.IDS]
        log.info("Allocated ids for POD %s are: %s", pod.key, ids)
        log.info(
            "Bound POD %s to Node:%s (%s; devices %s, cores %s)",
            pod.key,
            node,
            request.describe(),
            format_ids(placement.devices),
            format_ids(placement.cores),
        )
        self.metrics.binds.labels("success").inc()
        self._event(
            pod,
            "NeuronAllocated",
            f"Bound to {node} with {request.resource} ids {ids} (devices {values[handoff.DEVS]})",
            False,
        )
        return ""

    async def _bound_anyway(self, pod: Pod, node: str) -> bool:
        assert self.api is not None
        try:
            fresh = msgspec.json.decode(
                await self.api.get(
                    f"/api/v1/namespaces/{pod.metadata.namespace}/pods/{pod.metadata.name}"
                ),
                type=Pod,
            )
        except (ApiError, aiohttp.ClientError, TimeoutError, OSError):
            return False
        return fresh.metadata.uid == pod.metadata.uid and fresh.spec.nodeName == node

    async def _rollback(self, pod: Pod, error: Exception) -> None:
        assert self.api is not None
        self.ledger.release(pod.metadata.uid)
        self.ledger.ultraservers.remove_pod(pod.metadata.uid)  # not bound after all
        self.metrics.rollbacks.inc()
        self.metrics.binds.labels("failure").inc()
        log.warning("bind of %s failed (%s); rolled back its reservation", pod.key, error)
        try:
            await self.api.patch_pod_annotations(
                pod.metadata.namespace,
                pod.metadata.name,
                pod.metadata.uid,
                dict(handoff.removal()),
            )
        except (ApiError, aiohttp.ClientError, TimeoutError, OSError) as cleanup:
            # Harmless if it stays: ids only count on a pod bound to the annotated node.
            log.warning("could not remove annotations from %s: %s", pod.key, cleanup)
        self._event(pod, "FailedNeuronAllocation", f"binding failed: {error}", True)

    def _already_bound(self, pod: Pod, node: str) -> str:
        entry = self.ledger.nodes.get(node)
        if pod.spec.nodeName == node:
            try:
                ours = assignment(pod, entry.topology.cores_per_device if entry else None)
            except handoff.AnnotationError:
                ours = None
            if ours is not None or neuron_request(pod) is None:
                # kube-scheduler retries a bind whose answer it did not get; it already happened.
                self.metrics.binds.labels("already_bound").inc()
                log.info("POD %s is already bound to Node:%s; nothing to do", pod.key, node)
                return ""
        self.metrics.binds.labels("failure").inc()
        return f"pod {pod.key} is already bound to {pod.spec.nodeName}"

    async def _plain_bind(self, pod: Pod, node: str) -> str:
        assert self.api is not None
        try:
            await self.api.bind(pod.metadata.namespace, pod.metadata.name, pod.metadata.uid, node)
        except (ApiError, aiohttp.ClientError, TimeoutError, OSError) as error:
            self.metrics.binds.labels("failure").inc()
            return f"binding {pod.key} to {node} failed: {describe(error)}"
        self.metrics.binds.labels("success").inc()
        return ""

    def _event(self, pod: Pod, reason: str, message: str, warning: bool) -> None:
        if self.api is None:
            return
        api = self.api
        meta = pod.metadata

        async def send() -> None:
            try:
                await api.create_event(
                    meta.namespace, meta.name, meta.uid, reason, message, warning
                )
            except (ApiError, aiohttp.ClientError, TimeoutError, OSError) as error:
                log.debug("event for %s not recorded: %s", pod.key, error)

        task = asyncio.get_running_loop().create_task(send())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
