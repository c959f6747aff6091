"""bind: decide again under the node's lock, hold the placement, write our annotations, create the
Binding, and undo all of it on any error. The extender's only writer to the cluster."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence

from neuron_scheduler.core import handoff
from neuron_scheduler.core.allocation import Placement, Policy, Refusal, allocate
from neuron_scheduler.core.ids import format_ids
from neuron_scheduler.core.resources import NeuronRequest, RequestError
from neuron_scheduler.extender.ledger import Ledger
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.plugins import Reserver
from neuron_scheduler.extender.wire import BadRequest, ExtenderBindingArgs
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.errors import API_ERRORS, error_text
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import assignment, neuron_request
from neuron_scheduler.kube.tasks import BackgroundTasks

log = logging.getLogger("neuron_scheduler.extender")


class Binder:
    def __init__(
        self,
        api: KubeAPI,
        ledger: Ledger,
        metrics: Metrics,
        synced: asyncio.Event,
        policy: Policy = Policy.BEST_FIT,
        reservers: Sequence[Reserver] = (),
    ) -> None:
        """`synced`: set once the watches have listed every pod and node; `reservers` hold a
        placement while its API calls are in flight (the ledger, and any plugin that counts
        bound pods itself)."""
        self.api = api
        self.ledger = ledger
        self.metrics = metrics
        self.synced = synced
        self.policy = policy
        self.reservers = tuple(reservers)
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._events = BackgroundTasks()

    async def bind(self, args: ExtenderBindingArgs) -> str:
        """Empty string on success, else the error kube-scheduler shows and retries on."""
        if not (args.PodName and args.PodNamespace and args.PodUID and args.Node):
            raise BadRequest("bind needs PodName, PodNamespace, PodUID and Node")
        if not self.synced.is_set():
            self.metrics.binds.labels("not_ready").inc()
            return "neuron-scheduler is starting: its cache of pods and nodes is not synced yet"
        key = f"{args.PodNamespace}/{args.PodName}"
        try:
            pod = await self.api.get_pod(args.PodNamespace, args.PodName)
        except API_ERRORS as error:
            self.metrics.binds.labels("failure").inc()
            return f"cannot read pod {key}: {error_text(error)}"
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
            self._unreserve(pod, args.Node)  # a leftover from an earlier failed attempt
            decision = allocate(entry.topology, self.ledger.state(args.Node), request, self.policy)
            if isinstance(decision, Refusal):
                self.metrics.binds.labels("failure").inc()
                self._event(pod, "FailedNeuronAllocation", f"{args.Node}: {decision.reason}", True)
                return f"node {args.Node}: {decision.reason}"
            # Held from here on, so concurrent filters and binds on this node see it taken
            # while the API calls below are in flight (outside the lock). A plugin such as the
            # UltraServer rule counts the pod on its node from here too: kube-scheduler asks
            # about the next MPI worker before this binding is visible in the watch.
            for reserver in self.reservers:
                reserver.reserve(pod, args.Node, decision)
            values = handoff.encode(
                args.Node, request, decision, pod.container_names, time.time_ns()
            )
        self.metrics.bind_work.observe(time.perf_counter() - start)
        return await self._write(pod, args.Node, request, decision, values)

    def _unreserve(self, pod: Pod, node: str) -> None:
        for reserver in self.reservers:
            reserver.unreserve(pod, node)

    async def _write(
        self,
        pod: Pod,
        node: str,
        request: NeuronRequest,
        placement: Placement,
        values: dict[str, str],
    ) -> str:
        meta = pod.metadata
        try:
            await self.api.patch_annotations(meta.namespace, meta.name, meta.uid, dict(values))
            await self.api.bind(meta.namespace, meta.name, meta.uid, node)
        except API_ERRORS as error:
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
                await self._rollback(pod, node, error)
                return f"binding {pod.key} to {node} failed: {error_text(error)}"
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
        try:
            fresh = await self.api.get_pod(pod.metadata.namespace, pod.metadata.name)
        except API_ERRORS:
            return False
        return fresh.metadata.uid == pod.metadata.uid and fresh.spec.nodeName == node

    async def _rollback(self, pod: Pod, node: str, error: BaseException) -> None:
        self._unreserve(pod, node)  # not bound after all
        self.metrics.rollbacks.inc()
        self.metrics.binds.labels("failure").inc()
        log.warning("bind of %s failed (%s); rolled back its reservation", pod.key, error)
        meta = pod.metadata
        try:
            await self.api.patch_annotations(
                meta.namespace, meta.name, meta.uid, dict(handoff.removal())
            )
        except API_ERRORS as cleanup:
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
        meta = pod.metadata
        try:
            await self.api.bind(meta.namespace, meta.name, meta.uid, node)
        except API_ERRORS as error:
            self.metrics.binds.labels("failure").inc()
            return f"binding {pod.key} to {node} failed: {error_text(error)}"
        self.metrics.binds.labels("success").inc()
        return ""

    def _event(self, pod: Pod, reason: str, message: str, warning: bool) -> None:
        api = self.api
        meta = pod.metadata

        async def send() -> None:
            try:
                await api.create_event(
                    meta.namespace, meta.name, meta.uid, reason, message, warning
                )
            except API_ERRORS as error:
                log.debug("event for %s not recorded: %s", pod.key, error)

        self._events.spawn(send())

    async def close(self) -> None:
        await self._events.close()
