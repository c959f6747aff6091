"""Answers kubelet's GetPreferredAllocation and Allocate from the scheduler's pod annotations, and
marks pods allocated. Shared by the three resource endpoints, because a core and the device that
owns it are the same silicon whichever resource kubelet asks through.

Each call reads this node's pods from the API server and kubelet's pod resources (which pod it is
admitting, `admission`); a container given other ids than its annotated ones because kubelet did
not offer those is remembered in `withheld`, for the correction's event."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from neuron_scheduler.core import handoff as keys
from neuron_scheduler.core.catalog import CapacityError, Catalog
from neuron_scheduler.core.ids import (
    comma_ids,
    cores_of_devices,
    devices_of_cores,
    format_ids,
    ids_mask,
)
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.resources import RESOURCE_UNITS, Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.deviceplugin.admission import KubeletView, Withheld, WithheldCause
from neuron_scheduler.deviceplugin.devicewatch import DeviceState
from neuron_scheduler.deviceplugin.holdings import HoldingsError, HoldingsReader, kubelet_view
from neuron_scheduler.deviceplugin.matching import (
    ALLOCATED_CONTAINERS,
    AnnotatedPod,
    Matched,
    NodeView,
    Rejected,
    Slot,
    Unclaimed,
    cores_of,
    decide_allocation,
    failed_among,
    held_elsewhere,
    kubelet_ids,
    node_view,
    preferred_ids,
)
from neuron_scheduler.deviceplugin.pods import NodePods
from neuron_scheduler.deviceplugin.v1beta1 import api_pb2
from neuron_scheduler.kube.backoff import Backoff
from neuron_scheduler.kube.errors import API_ERRORS, Conflict
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.tasks import BackgroundTasks

log = logging.getLogger(__name__)

VISIBLE_CORES = "NEURON_RT_VISIBLE_CORES"
VISIBLE_DEVICES = "AWS_NEURON_VISIBLE_DEVICES"


class AllocationError(Exception):
    """Allocate must fail; the message is what kubelet shows on the pod."""


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    available: tuple[str, ...]
    must_include: tuple[str, ...]
    size: int


def container_response(
    unit: Unit, ids: Sequence[int], cores_per_device: int
) -> api_pb2.ContainerAllocateResponse:
    """The device files and environment for one container's ids."""
    if unit is Unit.CORE:
        cores: Sequence[int] = sorted(ids)
        devices: Sequence[int] = devices_of_cores(cores, cores_per_device)
    else:
        devices = sorted(ids)
        cores = cores_of_devices(devices, cores_per_device)
    envs = {VISIBLE_CORES: comma_ids(cores)}
    if unit is Unit.DEVICE:
        envs[VISIBLE_DEVICES] = comma_ids(devices)
    # Host paths are kubelet's view, always /dev: --dev-root only says where this process sees it.
    specs = [
        api_pb2.DeviceSpec(
            container_path=f"/dev/neuron{d}", host_path=f"/dev/neuron{d}", permissions="rw"
        )
        for d in devices
    ]
    return api_pb2.ContainerAllocateResponse(envs=envs, devices=specs)


class Assigner:
    LIST_ATTEMPTS = 4  # inside one Allocate: about 7 s of backoff before giving up
    NODE_RETRY_SECONDS = 30.0

    def __init__(
        self,
        pods: NodePods,
        node: str,
        state: DeviceState,
        catalog: Catalog | None = None,
        *,
        on_allocate: Callable[[], None] | None = None,
        kubelet: HoldingsReader | None = None,
    ) -> None:
        self.pods = pods
        # kubelet's pod resources: which pod it is admitting while it asks (None: never read).
        self.kubelet = kubelet
        # Told when an Allocate begins and ends (the annotations' corrector waits for quiet).
        self.on_allocate = on_allocate
        self.node = node
        self.state = state
        self.catalog = catalog or Catalog.builtin()
        self._lock = asyncio.Lock()
        self._instance_type: str | None = None
        self._node_checked = float("-inf")
        self._warned: set[str] = set()
        # (pod uid, container) given ids by this process, until the pod's annotation shows it.
        self._handed_out: set[tuple[str, str]] = set()
        self._retries = BackgroundTasks()  # annotation patches retried after an API error
        # Pods bound when this process saw kubelet start: its first batch (uids).
        self._batch: frozenset[str] = frozenset()
        # (pod uid, container) -> how many ids kubelet offered when it did not offer the
        # annotated ones, of how many (from GetPreferredAllocation, for the Allocate after it).
        self._offers: dict[tuple[str, str], tuple[int, int]] = {}
        # (pod uid, container) -> given other ids because kubelet did not offer the annotated
        # ones; read by the corrector for its event, forgotten when the pod is gone.
        self.withheld: dict[tuple[str, str], Withheld] = {}

    # --- reading the node -----------------------------------------------------------------

    def _warn_once(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            log.warning("%s", loggable(text))

    async def topology(self) -> Topology:
        now = time.monotonic()
        if self._instance_type is None and now - self._node_checked >= self.NODE_RETRY_SECONDS:
            self._node_checked = now
            try:
                node = await self.pods.get_node()
            except API_ERRORS as error:
                log.warning(
                    "cannot read node %s for its instance type: %s", self.node, loggable(error)
                )
            else:
                if node is None:
                    self._warn_once(f"node {self.node} does not exist in the API")
                elif node.instance_type:
                    self._instance_type = node.instance_type
                else:
                    self._warn_once(f"node {self.node} has no node.kubernetes.io/instance-type")
        devices = self.state.device_count
        cores = devices * self.state.cores_per_device
        try:
            resolved = self.catalog.resolve(self._instance_type or "", devices, cores)
        except CapacityError as error:
            # The devices found here are the truth; the label's type does not match them.
            self._warn_once(
                f"node {self.node} ({self._instance_type}): {error}; treating its devices as "
                "an instance type the catalog does not know"
            )
            try:
                resolved = self.catalog.resolve("", devices, cores)
            except CapacityError as beyond:
                raise AllocationError(f"node {self.node}: {beyond}") from beyond
        if resolved.warning:
            self._warn_once(resolved.warning)
        return resolved.topology

    async def _pods(self, attempts: int) -> list[Pod]:
        backoff = Backoff(initial=0.5, maximum=4.0)
        while True:
            try:
                return await self.pods.list_pods()
            except API_ERRORS as error:
                if backoff.failures + 1 >= attempts:
                    raise AllocationError(
                        f"cannot read the pods of node {self.node} from the Kubernetes API "
                        f"({error}); refusing to guess which pod kubelet is starting"
                    ) from error
                delay = backoff.failed()
                log.warning(
                    "listing pods on %s failed (%s); retrying in %.1fs",
                    self.node,
                    loggable(error),
                    delay,
                )
                await asyncio.sleep(delay)

    def _view(self, pods: list[Pod], topology: Topology) -> NodeView:
        view = node_view(pods, self.node, topology)
        for problem in view.unreadable:
            self._warn_once(f"ignoring unreadable Neuron annotations of {problem}")
        # Forget hand-outs the annotations now show, or whose pod is gone or done.
        shown = {
            (h.uid, name)
            for h in view.holdings
            if h.pending
            for name in h.slot_names - h.allocated_containers
        }
        self._handed_out &= shown
        live = {h.uid for h in view.holdings}
        for memo in (self._offers, self.withheld):
            for key in [k for k in memo if k[0] not in live]:
                del memo[key]
        return view

    async def _kubelet_view(self) -> KubeletView:
        """kubelet's pod resources now, read while it waits for this call's answer."""
        if self.kubelet is None:
            return KubeletView(None, self._batch)
        try:
            held = await self.kubelet.read()
        except HoldingsError as error:
            self._warn_once(
                f"cannot ask kubelet which pod it is admitting ({error}); predicting from its "
                "admission order"
            )
            return KubeletView(None, self._batch)
        return kubelet_view(held, self._batch)

    async def kubelet_started(self) -> None:
        """A new kubelet registered: the pods bound now reach it in one batch, in its own order."""
        try:
            pods = await self._pods(attempts=1)
            topology = await self.topology()
        except AllocationError as error:
            log.warning("kubelet restarted; cannot read the pods it will admit first: %s", error)
            self._batch = frozenset()
            return
        view = node_view(pods, self.node, topology)
        self._batch = frozenset(h.uid for h in view.holdings if h.pending)
        if self._batch:
            log.info(
                "kubelet started; %d pods bound here wait for it, in its start batch",
                len(self._batch),
            )

    # --- GetPreferredAllocation -----------------------------------------------------------

    async def preferred(
        self, resource: str, requests: Sequence[ContainerRequest]
    ) -> list[list[str]]:
        unit = RESOURCE_UNITS[resource]
        topology = await self.topology()
        try:
            view = self._view(await self._pods(attempts=1), topology)
        except AllocationError as error:
            # A preference is only advice; kubelet still gets an answer it can use.
            log.warning(
                "GetPreferredAllocation without the scheduler's choices: %s", loggable(error)
            )
            view = NodeView(())
        kubelet = await self._kubelet_view()
        answers: list[list[str]] = []
        taken: list[tuple[str, str]] = list(self._handed_out)
        for request in requests:
            available = kubelet_ids(request.available)
            must = kubelet_ids(request.must_include)
            if available is None or must is None:
                log.warning(
                    "GetPreferredAllocation with ids that are not ours: %s", loggable(request)
                )
                answers.append(list(request.must_include))
                continue
            choice = preferred_ids(
                view,
                unit,
                available,
                must,
                request.size,
                self.state.cores_per_device,
                topology,
                taken,
                kubelet,
                resource,
            )
            ids, slot = choice.ids, choice.slot
            if slot is not None and choice.withheld:
                taken.append((slot.uid, slot.container))
                total = len(self.state.advertised(unit))
                held = set(slot.ids) <= set(available)  # offered: another pod holds them
                if not held:
                    self._offers[(slot.uid, slot.container)] = (len(available), total)
                log.warning(
                    "kubelet is admitting %s container %s but %s its annotated %s %s (%s); "
                    "preferring %s",
                    slot.pod,
                    slot.container,
                    "offers another pod's cores as" if held else "did not offer",
                    unit.value,
                    format_ids(list(slot.ids)),
                    "held through another Neuron resource"
                    if held
                    else f"it offered {len(available)} of {total}",
                    format_ids(list(ids)),
                )
            elif slot is not None:
                taken.append((slot.uid, slot.container))
                log.info(
                    "preferring %s %s for %s container %s (size %d)",
                    unit.value,
                    format_ids(list(ids)),
                    loggable(slot.pod),
                    loggable(slot.container),
                    request.size,
                )
            else:
                log.info(
                    "no pending pod on %s has %d %ss among the %d offered; preferring %s",
                    self.node,
                    request.size,
                    unit.value,
                    len(available),
                    format_ids(list(ids)),
                )
            answers.append([str(i) for i in ids])
        return answers

    # --- Allocate -------------------------------------------------------------------------

    async def allocate(
        self, resource: str, unit: Unit, requests: Sequence[Sequence[str]]
    ) -> list[api_pb2.ContainerAllocateResponse]:
        if self.on_allocate is not None:
            self.on_allocate()
        try:
            return await self._allocate(resource, unit, requests)
        finally:
            if self.on_allocate is not None:
                self.on_allocate()

    async def _allocate(
        self, resource: str, unit: Unit, requests: Sequence[Sequence[str]]
    ) -> list[api_pb2.ContainerAllocateResponse]:
        async with self._lock:
            pods = await self._pods(attempts=self.LIST_ATTEMPTS)
            topology = await self.topology()
            view = self._view(pods, topology)
            kubelet = await self._kubelet_view()
            by_uid = {p.metadata.uid: p for p in pods}
            responses: list[api_pb2.ContainerAllocateResponse] = []
            marks: list[AnnotatedPod] = []
            for raw in requests:
                ids = kubelet_ids(raw)
                if ids is None or not ids:
                    raise AllocationError(
                        f"kubelet asked {resource} for ids {list(raw)!r}, which this plugin "
                        "never advertised"
                    )
                decision = decide_allocation(
                    view,
                    unit,
                    ids,
                    self.state.cores_per_device,
                    topology,
                    frozenset(self._handed_out),
                    kubelet,
                    self.unhealthy_devices(),
                    resource,
                )
                if isinstance(decision, Rejected):
                    log.warning("Allocate refused: %s", loggable(decision.message))
                    raise AllocationError(decision.message)
                response = container_response(unit, ids, self.state.cores_per_device)
                visible = response.envs[VISIBLE_CORES]
                if isinstance(decision, Unclaimed):
                    log.warning("%s: %s", resource, loggable(decision.note))
                elif isinstance(decision, Matched):
                    slot = decision.slot
                    log.info(
                        "%s %s -> %s container %s: %s, %s=%s",
                        resource,
                        format_ids(sorted(ids)),
                        loggable(slot.pod),
                        loggable(slot.container),
                        ",".join(d.host_path for d in response.devices),
                        VISIBLE_CORES,
                        visible,
                    )
                    if decision.substitute:
                        self._substituted(resource, slot, ids, kubelet)
                    if not decision.again:
                        self._handed_out.add((slot.uid, slot.container))
                        marks.append(decision.holding)
                responses.append(response)
            for holding in marks:
                pod = by_uid.get(holding.uid)
                if pod is not None:
                    await self._mark(pod, holding)
            return responses

    def unhealthy_devices(self) -> int:
        """The devices (mask) this plugin reports failed to kubelet now."""
        return ids_mask(i for i, h in self.state.health.items() if not h.healthy)

    def _substituted(
        self, resource: str, slot: Slot, ids: Sequence[int], kubelet: KubeletView
    ) -> None:
        unit = RESOURCE_UNITS[resource]
        key = (slot.uid, slot.container)
        offered, total = self._offers.pop(key, (None, None))
        per_device = self.state.cores_per_device
        failed = failed_among(unit, slot.ids, self.unhealthy_devices(), per_device)
        annotated = cores_of(unit, slot.ids, per_device)
        if failed:
            cause = WithheldCause.FAILED
            why = f"kubelet did not offer them: device {format_ids(list(failed))} failed"
        elif held_elsewhere(kubelet, slot, per_device, resource, across=True) & annotated:
            cause = WithheldCause.HELD_ELSEWHERE
            why = "another pod's containers hold them through another Neuron resource"
        elif slot.uid in self._batch:
            cause = WithheldCause.RESTART
            why = "kubelet did not offer them: the restarted kubelet still counted them in use"
        else:
            cause, why = WithheldCause.IN_USE, "kubelet did not offer them: it counted them in use"
        self.withheld[key] = Withheld(tuple(slot.ids), offered, total, cause, failed)
        log.warning(
            "%s container %s gets %s %s instead of its annotated %s (%s); the annotations will "
            "be corrected from kubelet's pod resources",
            slot.pod,
            slot.container,
            unit.value,
            format_ids(sorted(ids)),
            format_ids(list(slot.ids)),
            why,
        )

    def _done(self, pod: Pod, uid: str) -> set[str]:
        raw = pod.metadata.annotations.get(ALLOCATED_CONTAINERS, "")
        done = {name for name in raw.split(",") if name}
        done |= {name for pod_uid, name in self._handed_out if pod_uid == uid}
        return done

    def _patch(self, pod: Pod, holding: AnnotatedPod) -> dict[str, str | None]:
        names = holding.slot_names
        if len(names) <= 1:
            return {keys.ALLOCATED: "true"}
        done = self._done(pod, holding.uid)
        values: dict[str, str | None] = {ALLOCATED_CONTAINERS: ",".join(sorted(done & names))}
        if names <= done:
            values[keys.ALLOCATED] = "true"
        return values

    async def _mark(self, pod: Pod, holding: AnnotatedPod) -> None:
        """NEURON_ALLOCATED=true once all the pod's Neuron containers have their ids; retried in
        the background when the API is unreachable (the hand-out itself has already happened)."""
        try:
            await self._mark_once(pod, holding)
        except API_ERRORS as error:
            log.warning(
                "could not mark %s allocated (%s); retrying in the background",
                loggable(holding.pod),
                loggable(error),
            )
            self._retries.spawn(self._mark_later(pod, holding))

    async def _mark_once(self, pod: Pod, holding: AnnotatedPod) -> None:
        multi = len(holding.slot_names) > 1
        for _ in range(5):
            values = self._patch(pod, holding)
            try:
                await self.pods.patch_annotations(pod, values, resource_version=multi)
            except Conflict:
                fresh = await self.pods.get_pod(pod.metadata.namespace, pod.metadata.name)
                if fresh is None or fresh.metadata.uid != holding.uid:
                    log.info("%s is gone; nothing to mark", loggable(holding.pod))
                    return
                pod = fresh
                continue
            if values.get(keys.ALLOCATED) == "true":
                log.info("marked %s %s=true", loggable(holding.pod), keys.ALLOCATED)
            return
        log.warning("gave up marking %s allocated after repeated conflicts", loggable(holding.pod))

    async def _mark_later(self, pod: Pod, holding: AnnotatedPod) -> None:
        backoff = Backoff(initial=1.0, maximum=30.0)
        while True:
            await asyncio.sleep(backoff.failed())
            try:
                fresh = await self.pods.get_pod(pod.metadata.namespace, pod.metadata.name)
                if fresh is None or fresh.metadata.uid != holding.uid:
                    return
                await self._mark_once(fresh, holding)
                return
            except API_ERRORS as error:
                if backoff.should_log:
                    log.warning(
                        "still cannot mark %s allocated: %s", loggable(holding.pod), loggable(error)
                    )

    async def close(self) -> None:
        await self._retries.close()
