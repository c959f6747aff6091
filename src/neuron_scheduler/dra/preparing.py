"""NodePrepareResources and NodeUnprepareResources: from a claim the scheduler allocated to the CDI
spec the runtime applies, re-checked with the allocator's rules first.

kubelet names a claim (namespace, name, uid) and nothing else, so Prepare reads the claim, maps
each allocated device to its physical Neuron devices and refuses a set that is not legal, overlaps
another prepared claim or holds an unhealthy device. Both calls are idempotent: a claim prepared
before (by this process or, through the checkpoint, an earlier one) gets the same answer again;
unpreparing an unknown claim succeeds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from neuron_scheduler.core.allocation import is_valid_device_set
from neuron_scheduler.core.ids import format_ids, mask_ids
from neuron_scheduler.core.logtext import loggable
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
    """Each allocated device's shape, after the allocator's checks; ClaimError otherwise."""
    published = shapes_by_name(topology)
    planned: list[tuple[Result, Shape]] = []
    by_request: dict[str, int] = {}
    claimed = 0
    for result in results:
        shape = published.get(result.device)
        if shape is None:
            raise ClaimError(
                f"device {result.device[:80]!r} is not one this driver publishes for "
                f"{topology.instance_type}"
            )
        if shape.mask & claimed:
            raise ClaimError(f"device {shape.name} overlaps another device of the same claim")
        claimed |= shape.mask
        request = result.base_request
        by_request[request] = by_request.get(request, 0) | shape.mask
        planned.append((result, shape))
    for request, mask in by_request.items():
        ids = mask_ids(mask)
        if not is_valid_device_set(topology, ids):
            raise ClaimError(
                f"request {request[:64]!r} was given devices {format_ids(ids)}, which are not "
                f"directly connected on {topology.instance_type}; ask for count: 1 of a "
                "size's device class"
            )
    if claimed & held_elsewhere:
        taken = mask_ids(claimed & held_elsewhere)
        raise ClaimError(f"devices {format_ids(taken)} are in use by another prepared claim")
    sick = [d for d in mask_ids(claimed) if d in unhealthy]
    if sick:
        raise ClaimError(
            "unhealthy devices: " + "; ".join(f"neuron{d}: {unhealthy[d]}" for d in sick[:4])
        )
    return planned


def cores_per_device(devices: NodeDevices, config: NeuronConfig) -> int:
    """Logical cores per device for a claim: the node's own, or the claim's LNC setting."""
    lnc = config.logical_neuron_core
    if lnc is None:
        return devices.topology.cores_per_device
    physical = devices.physical_cores
    if physical is None or physical % lnc:
        raise ClaimError(f"logicalNeuronCore {lnc} does not divide the devices' cores")
    if lnc != 1 and physical != LNC_PHYSICAL_CORES:
        raise ClaimError(
            f"logicalNeuronCore {lnc} needs devices with {LNC_PHYSICAL_CORES} physical "
            f"NeuronCores (Trn2 and later); {devices.topology.instance_type} has {physical}"
        )
    return physical // lnc


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
        wanted = 0
        for result in results:
            shape = shapes_by_name(topology).get(result.device)
            wanted |= shape.mask if shape is not None else 0
        if wanted & self.checkpoint.held(besides=ref.uid):
            await self._forget_deleted(wanted, besides=ref.uid)
        planned = plan(
            topology, results, self.checkpoint.held(besides=ref.uid), self.devices.unhealthy
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
                    cores_per_device(self.devices, config),
                    config.logical_neuron_core,
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
            ", ".join(f"{d.device} = neuron {format_ids(list(d.members))}" for d in devices)
            or "no devices of ours",
        )
        return prepared

    async def _forget_deleted(self, devices: int, *, besides: str) -> None:
        """Drop prepared claims holding these devices that no longer exist in the API.

        kubelet unprepares a claim before it is deleted, but a claim deleted while this driver
        was down (and kubelet's own record lost) would otherwise hold its devices for ever. A
        claim that is gone is used by no pod: the API keeps a claim until its pods are done."""
        for uid, prepared in list(self.checkpoint.claims.items()):
            if uid == besides or not prepared.mask & devices:
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
        devices = [
            cdi.CdiDevice(f"{claim.uid}-{d.device}", d.members, d.cores_per_device, d.logical_nc)
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
