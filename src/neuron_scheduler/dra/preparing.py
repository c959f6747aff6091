"""NodePrepareResources and NodeUnprepareResources: from a claim the scheduler allocated to the CDI
spec the runtime applies, re-checked with the allocator's rules first.

kubelet names a claim (namespace, name, uid) and nothing else, so Prepare reads the claim, maps
each allocated device to its physical Neuron devices and cores (a device set holds every core of
its devices, a core window its own) and refuses a set that is not legal, shares a core with
another prepared claim or touches an unhealthy device (a device given with admin access, for
monitoring, holds no cores and may reach cores others hold, as the scheduler treats it). Both
calls are idempotent: a claim prepared before (by this process or, through the checkpoint, an
earlier one) gets the same answer again; unpreparing an unknown claim succeeds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from neuron_scheduler.core.allocation import is_valid_core_set, is_valid_device_set
from neuron_scheduler.core.ids import format_ids, mask_ids
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.resources import Unit
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra import cdi
from neuron_scheduler.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from neuron_scheduler.dra.claims import (
    ClaimError,
    NeuronConfig,
    ResourceClaim,
    Result,
    our_results,
    request_configs,
)
from neuron_scheduler.dra.shapes import Shape, shapes_by_name
from neuron_scheduler.kube.errors import READ_ERRORS, NotFound, error_text

log = logging.getLogger(__name__)

LNC_PHYSICAL_CORES = 8  # Logical NeuronCore settings exist on devices with 8 cores (Trn2 on)


class ClaimReader(Protocol):
    async def __call__(self, namespace: str, name: str) -> ResourceClaim:
        """The claim as the API server has it; raises kube.errors errors."""
        ...


@dataclass(frozen=True, slots=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str


@dataclass(slots=True)
class NodeDevices:
    """The node's devices as the driver sees them now; health changes while it runs."""

    topology: Topology
    physical_cores: int | None  # per device, from sysfs
    unhealthy: dict[int, str] = field(default_factory=dict)

    @property
    def unhealthy_mask(self) -> int:
        mask = 0
        for d in self.unhealthy:
            mask |= 1 << d
        return mask


def plan(
    topology: Topology,
    results: Sequence[Result],
    held_elsewhere: int,
    unhealthy: Mapping[int, str],
) -> list[tuple[Result, Shape]]:
    """Each allocated device's shape, after the allocator's checks; ClaimError otherwise.

    held_elsewhere: the cores (mask) other prepared claims hold; a device given with admin
    access is not checked against them, nor holds any."""
    published = shapes_by_name(topology)
    planned: list[tuple[Result, Shape]] = []
    by_request: dict[str, list[Shape]] = {}
    claimed = 0  # cores
    for result in results:
        shape = published.get(result.device)
        if shape is None:
            raise ClaimError(
                f"device {result.device[:80]!r} is not one this driver publishes for "
                f"{topology.instance_type}"
            )
        if not result.adminAccess:
            if shape.core_mask & claimed:
                raise ClaimError(f"device {shape.name} overlaps another device of the same claim")
            claimed |= shape.core_mask
        by_request.setdefault(result.base_request, []).append(shape)
        planned.append((result, shape))
    for request, shapes in by_request.items():
        _check_request(topology, request[:64], shapes)
    if claimed & held_elsewhere:
        taken = mask_ids(claimed & held_elsewhere)
        raise ClaimError(f"cores {format_ids(taken)} are in use by another prepared claim")
    sick = [d for d in mask_ids(_devices_of(planned)) if d in unhealthy]
    if sick:
        raise ClaimError(
            "unhealthy devices: " + "; ".join(f"neuron{d}: {unhealthy[d]}" for d in sick[:4])
        )
    return planned


def _devices_of(planned: Sequence[tuple[Result, Shape]]) -> int:
    mask = 0
    for _, shape in planned:
        mask |= shape.mask
    return mask


def _check_request(topology: Topology, request: str, shapes: Sequence[Shape]) -> None:
    """What one request was given must be one legal set: of devices, or of cores."""
    units = {shape.unit for shape in shapes}
    if len(units) > 1:
        raise ClaimError(
            f"request {request!r} was given both device sets and core windows; ask for count: 1 "
            "of one class"
        )
    cores = 0
    devices = 0
    for shape in shapes:
        cores |= shape.core_mask
        devices |= shape.mask
    if Unit.CORE in units:
        if not is_valid_core_set(topology, mask_ids(cores)):
            raise ClaimError(
                f"request {request!r} was given cores {format_ids(mask_ids(cores))}, which are "
                f"not one window of connected cores on {topology.instance_type}; ask for "
                "count: 1 of a core count's device class"
            )
        return
    ids = mask_ids(devices)
    if not is_valid_device_set(topology, ids):
        raise ClaimError(
            f"request {request!r} was given devices {format_ids(ids)}, which are not "
            f"directly connected on {topology.instance_type}; ask for count: 1 of a "
            "size's device class"
        )


def cores_per_device(devices: NodeDevices, config: NeuronConfig, shape: Shape) -> int:
    """Logical cores per device for a claim: the node's own, or the claim's LNC setting (device
    sets only: a core window's ids are the node's logical cores)."""
    lnc = config.logical_neuron_core
    if lnc is None:
        return devices.topology.cores_per_device
    physical = devices.physical_cores
    if shape.unit is Unit.CORE:
        node_lnc = physical // devices.topology.cores_per_device if physical else None
        if lnc != node_lnc:
            raise ClaimError(
                f"logicalNeuronCore {lnc} cannot apply to core window {shape.name}: its cores "
                f"are the node's logical cores (LNC {node_lnc or 'unknown'}); set "
                "logicalNeuronCore on device claims, or leave it out"
            )
        return devices.topology.cores_per_device
    if physical is None or physical % lnc:
        raise ClaimError(f"logicalNeuronCore {lnc} does not divide the devices' cores")
    if lnc != 1 and physical != LNC_PHYSICAL_CORES:
        raise ClaimError(
            f"logicalNeuronCore {lnc} needs devices with {LNC_PHYSICAL_CORES} physical "
            f"NeuronCores (Trn2 and later); {devices.topology.instance_type} has {physical}"
        )
    return physical // lnc


def _described(device: PreparedDevice) -> str:
    if device.cores:
        return f"{device.device} = cores {format_ids(list(device.cores))}"
    return f"{device.device} = neuron {format_ids(list(device.members))}"


class Preparer:
    def __init__(
        self,
        driver: str,
        node: str,
        devices: NodeDevices,
        checkpoint: Checkpoint,
        cdi_root: Path,
        read_claim: ClaimReader,
    ) -> None:
        self.driver = driver
        self.node = node
        self.devices = devices
        self.checkpoint = checkpoint
        self.cdi_root = cdi_root
        self.read_claim = read_claim
        # One claim at a time: the overlap check must see every claim prepared before it.
        self._lock = asyncio.Lock()

    async def prepare(self, refs: Sequence[ClaimRef]) -> dict[str, PreparedClaim | str]:
        """Per claim uid: the prepared claim, or why it cannot be prepared."""
        answers: dict[str, PreparedClaim | str] = {}
        for ref in refs:
            async with self._lock:
                try:
                    answers[ref.uid] = await self._prepare(ref)
                except ClaimError as error:
                    log.warning(
                        "cannot prepare claim %s/%s: %s",
                        loggable(ref.namespace),
                        loggable(ref.name),
                        loggable(error),
                    )
                    answers[ref.uid] = str(error)
        return answers

    async def _prepare(self, ref: ClaimRef) -> PreparedClaim:
        if not cdi.UID.fullmatch(ref.uid):
            raise ClaimError(f"{ref.uid[:80]!r} is not a claim UID")
        known = self.checkpoint.claims.get(ref.uid)
        if known is not None:
            # kubelet asks again (it restarted, or a second pod shares the claim): the same
            # answer, and the spec written again in case it was lost.
            self._write_spec(known)
            return known
        claim = await self._read(ref)
        results = our_results(claim, self.driver, self.node)
        topology = self.devices.topology
        per_device = topology.cores_per_device
        wanted = 0
        for result in results:
            shape = shapes_by_name(topology).get(result.device)
            wanted |= shape.core_mask if shape is not None and not result.adminAccess else 0
        if wanted & self.checkpoint.held(per_device, besides=ref.uid):
            await self._forget_deleted(wanted, besides=ref.uid)
        planned = plan(
            topology,
            results,
            self.checkpoint.held(per_device, besides=ref.uid),
            self.devices.unhealthy,
        )
        configs = request_configs(claim, self.driver, [r.base_request for r, _ in planned])
        devices = []
        for result, shape in planned:
            config = configs[result.base_request]
            devices.append(
                PreparedDevice(
                    result.base_request,
                    result.pool,
                    shape.name,
                    shape.members,
                    cdi.device_id(self.driver, f"{ref.uid}-{shape.name}"),
                    cores_per_device(self.devices, config, shape),
                    config.logical_neuron_core,
                    shape.cores if shape.unit is Unit.CORE else (),
                    bool(result.adminAccess),
                )
            )
        prepared = PreparedClaim(ref.uid, ref.namespace, ref.name, tuple(devices))
        self._write_spec(prepared)
        try:
            self.checkpoint.put(prepared)
        except OSError as error:
            cdi.remove_spec(self.cdi_root, self.driver, ref.uid)
            raise ClaimError(f"cannot record the prepared claim: {error}") from error
        log.info(
            "prepared claim %s/%s (%s): %s",
            loggable(ref.namespace),
            loggable(ref.name),
            loggable(ref.uid),
            ", ".join(_described(d) for d in devices) or "no devices of ours",
        )
        return prepared

    async def _forget_deleted(self, cores: int, *, besides: str) -> None:
        """Drop prepared claims holding these cores that no longer exist in the API.

        kubelet unprepares a claim before it is deleted, but a claim deleted while this driver
        was down (and kubelet's own record lost) would otherwise hold its devices for ever. A
        claim that is gone is used by no pod: the API keeps a claim until its pods are done."""
        for uid, prepared in list(self.checkpoint.claims.items()):
            per_device = self.devices.topology.cores_per_device
            if uid == besides or not prepared.core_mask(per_device) & cores:
                continue
            try:
                current = await self.read_claim(prepared.namespace, prepared.name)
            except NotFound:
                current = None
            except READ_ERRORS:
                continue  # cannot tell: keep it
            if current is None or current.metadata.uid != uid:
                log.warning(
                    "forgetting prepared claim %s/%s (%s): it no longer exists",
                    loggable(prepared.namespace),
                    loggable(prepared.name),
                    loggable(uid),
                )
                self.checkpoint.remove(uid)
                cdi.remove_spec(self.cdi_root, self.driver, uid)

    async def _read(self, ref: ClaimRef) -> ResourceClaim:
        try:
            claim = await self.read_claim(ref.namespace, ref.name)
        except NotFound:
            raise ClaimError(f"claim {ref.namespace}/{ref.name} does not exist") from None
        except READ_ERRORS as error:
            raise ClaimError(
                f"cannot read claim {ref.namespace}/{ref.name}: {error_text(error)}"
            ) from None
        if claim.metadata.uid != ref.uid:
            raise ClaimError(
                f"claim {ref.namespace}/{ref.name} has uid {claim.metadata.uid[:64]}, kubelet "
                f"asked for {ref.uid}: it was deleted and created again"
            )
        return claim

    def _write_spec(self, claim: PreparedClaim) -> None:
        # kubelet gives a container every CDI device of a request, and each one's edits set the
        # same variables (the last applied wins): each names all of its request's devices and
        # cores (a request of two 1-core windows forming one window, or of two singles).
        members: dict[str, set[int]] = {}
        cores: dict[str, set[int]] = {}
        for d in claim.devices:
            members.setdefault(d.request, set()).update(d.members)
            cores.setdefault(d.request, set()).update(d.cores)
        devices = [
            cdi.CdiDevice(
                f"{claim.uid}-{d.device}",
                tuple(sorted(members[d.request])),
                d.cores_per_device,
                d.logical_nc,
                tuple(sorted(cores[d.request])),
            )
            for d in claim.devices
        ]
        if not devices:
            return  # a spec without edits makes the runtime fail; kubelet gets no CDI ids
        try:
            cdi.write_spec(self.cdi_root, self.driver, claim.uid, devices)
        except OSError as error:
            raise ClaimError(f"cannot write the CDI spec for claim {claim.uid}: {error}") from error

    async def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Per claim uid: "" when done (also for a claim never prepared), else why not."""
        answers: dict[str, str] = {}
        for ref in refs:
            async with self._lock:
                if not cdi.UID.fullmatch(ref.uid):
                    answers[ref.uid] = f"{ref.uid[:80]!r} is not a claim UID"
                    continue
                try:
                    self.checkpoint.remove(ref.uid)
                    cdi.remove_spec(self.cdi_root, self.driver, ref.uid)
                except OSError as error:
                    answers[ref.uid] = f"cannot unprepare: {error}"
                    continue
                log.info(
                    "unprepared claim %s/%s (%s)",
                    loggable(ref.namespace),
                    loggable(ref.name),
                    loggable(ref.uid),
                )
                answers[ref.uid] = ""
        return answers
