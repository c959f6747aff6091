"""CDI specs: how the container runtime learns which /dev/neuronN nodes and environment a prepared
claim gives a container. One spec file per claim UID, so a runtime never sees a stale device.

The environment is the one our device plugin sets: for a device set NEURON_RT_VISIBLE_CORES (the
cores the devices own, ascending) and AWS_NEURON_VISIBLE_DEVICES; for a core window
NEURON_RT_VISIBLE_CORES (its cores) alone, with the device nodes of the devices it touches.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neuron_scheduler.core.ids import comma_ids, cores_of_devices

CDI_VERSION = "0.5.0"  # device names may start with a digit (claim UIDs do) from 0.5.0 on
CDI_CLASS = "neuron"
VISIBLE_CORES = "NEURON_RT_VISIBLE_CORES"
VISIBLE_DEVICES = "AWS_NEURON_VISIBLE_DEVICES"
LOGICAL_NC = "NEURON_LOGICAL_NC_CONFIG"
# Claim UIDs name files: only what a UID can look like, never a path.
UID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,62}")


@dataclass(frozen=True, slots=True)
class CdiDevice:
    name: str  # unique in the class: "<claim uid>-<published device name>"
    devices: tuple[int, ...]  # Neuron device ids
    cores_per_device: int  # logical cores per device for this claim
    logical_nc: int | None = None  # a per-claim Logical NeuronCore setting, if the claim set one
    cores: tuple[int, ...] = ()  # a core window's cores; empty: every core of `devices`


def kind(driver: str) -> str:
    return f"{driver}/{CDI_CLASS}"


def device_id(driver: str, name: str) -> str:
    """The id kubelet hands the runtime: `<vendor>/<class>=<name>`."""
    return f"{kind(driver)}={name}"


def environment(device: CdiDevice) -> list[str]:
    ids = sorted(device.devices)
    if device.cores:
        env = [f"{VISIBLE_CORES}={comma_ids(sorted(device.cores))}"]
    else:
        env = [
            f"{VISIBLE_CORES}={comma_ids(cores_of_devices(ids, device.cores_per_device))}",
            f"{VISIBLE_DEVICES}={comma_ids(ids)}",
        ]
    if device.logical_nc is not None:
        env.append(f"{LOGICAL_NC}={device.logical_nc}")
    return env


def spec(driver: str, devices: Sequence[CdiDevice]) -> dict[str, Any]:
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind(driver),
        "devices": [
            {
                "name": device.name,
                "containerEdits": {
                    "deviceNodes": [{"path": f"/dev/neuron{d}"} for d in sorted(device.devices)],
                    "env": environment(device),
                },
            }
            for device in devices
        ],
    }


def spec_path(cdi_root: Path, driver: str, claim_uid: str) -> Path:
    if not UID.fullmatch(claim_uid):
        raise ValueError(f"{claim_uid[:80]!r} is not a claim UID")
    return cdi_root / f"{driver}-{claim_uid}.json"


def write_spec(cdi_root: Path, driver: str, claim_uid: str, devices: Sequence[CdiDevice]) -> Path:
    """Atomically: a runtime reading the directory sees the old file or the new, never half."""
    path = spec_path(cdi_root, driver, claim_uid)
    cdi_root.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w") as handle:
        json.dump(spec(driver, devices), handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    return path


def remove_spec(cdi_root: Path, driver: str, claim_uid: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        spec_path(cdi_root, driver, claim_uid).unlink()
