"""Prepared claims on disk, so a restarted driver knows which devices are in use and answers
kubelet's repeated Prepare and Unprepare calls the same way.

One JSON file, replaced atomically on every change. A file that cannot be read is moved aside
(never deleted) and the driver starts empty, saying so loudly.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import msgspec

from neuron_scheduler.core.ids import core_mask_of_devices, ids_mask

log = logging.getLogger(__name__)

VERSION = 1
MAX_BYTES = 8 << 20  # far above any real node's claims; a bigger file is not ours


class PreparedDevice(msgspec.Struct, frozen=True):
    request: str  # base request name
    pool: str
    device: str  # published device name
    members: tuple[int, ...]
    cdi_id: str
    cores_per_device: int  # logical, for this claim
    logical_nc: int | None = None  # the claim's own Logical NeuronCore setting, if any
    # A core window's global core ids (at the node's cores per device); empty for a device set,
    # which holds every core of its members. (Files written before core windows have none.)
    cores: tuple[int, ...] = ()
    # Given with admin access (monitoring): the scheduler counts it as holding nothing.
    admin_access: bool = False

    def core_mask(self, node_cores_per_device: int) -> int:
        """The cores it holds, counted at the node's cores per device (what other claims see)."""
        if self.admin_access:
            return 0
        if self.cores:
            return ids_mask(self.cores)
        return core_mask_of_devices(ids_mask(self.members), node_cores_per_device)


class PreparedClaim(msgspec.Struct, frozen=True):
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...] = ()

    def core_mask(self, node_cores_per_device: int) -> int:
        mask = 0
        for device in self.devices:
            mask |= device.core_mask(node_cores_per_device)
        return mask


class CheckpointFile(msgspec.Struct):
    version: int = VERSION
    driver: str = ""
    node: str = ""
    claims: dict[str, PreparedClaim] = {}


class Checkpoint:
    def __init__(self, path: Path, driver: str, node: str) -> None:
        self.path = path
        self.driver = driver
        self.node = node
        self.claims: dict[str, PreparedClaim] = {}

    def load(self) -> None:
        try:
            with open(self.path, "rb") as handle:
                data = handle.read(MAX_BYTES + 1)
        except FileNotFoundError:
            log.info("no checkpoint at %s: no prepared claims yet", self.path)
            return
        problem = None
        if len(data) > MAX_BYTES:
            problem = f"larger than {MAX_BYTES} bytes"
        else:
            try:
                stored = msgspec.json.decode(data, type=CheckpointFile)
            except msgspec.DecodeError as error:
                problem = str(error)
            else:
                if stored.version != VERSION:
                    problem = f"version {stored.version}, this driver writes {VERSION}"
                elif (stored.driver, stored.node) != (self.driver, self.node):
                    problem = f"written by {stored.driver} on {stored.node}"
        if problem is not None:
            aside = self.path.with_name(f"{self.path.name}.unreadable-{int(time.time())}")
            os.replace(self.path, aside)
            log.error(
                "checkpoint %s cannot be used (%s); moved to %s and starting with no prepared "
                "claims: devices prepared before this are not known to be in use",
                self.path,
                problem,
                aside,
            )
            return
        self.claims = dict(stored.claims)
        log.info("checkpoint %s: %d prepared claims", self.path, len(self.claims))

    def held(self, node_cores_per_device: int, *, besides: str = "") -> int:
        """Cores (mask, at the node's cores per device) of every prepared claim but `besides`."""
        mask = 0
        for uid, claim in self.claims.items():
            if uid != besides:
                mask |= claim.core_mask(node_cores_per_device)
        return mask

    def put(self, claim: PreparedClaim) -> None:
        """Saved before it counts: a claim the file does not hold was never prepared."""
        claims = {**self.claims, claim.uid: claim}
        self._save(claims)
        self.claims = claims

    def remove(self, uid: str) -> None:
        if uid in self.claims:
            claims = {k: v for k, v in self.claims.items() if k != uid}
            self._save(claims)
            self.claims = claims

    def _save(self, claims: dict[str, PreparedClaim]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = CheckpointFile(VERSION, self.driver, self.node, claims)
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        with open(temporary, "wb") as handle:
            handle.write(msgspec.json.encode(body))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.path)
