"""Which devices of a node have failed, as its device plugin publishes them. Pure.

The kubelet learns each device's health from the device plugin, but shows the scheduler only a
count: allocatable drops below capacity, never saying which ids. So the device plugin also writes
the unhealthy device indexes on its own Node, in one annotation (`UNHEALTHY_DEVICES`: "5", "3,5";
absent while every device is healthy). Only the plugin on that node may write it: the chart's
admission policy checks the writer's node (docs/security.md).

Read as untrusted, like every annotation: bounded in length, ids within the node's devices.
"""

from __future__ import annotations

from collections.abc import Iterable

from neuron_scheduler.core.ids import comma_ids, format_ids, ids_mask, mask_ids
from neuron_scheduler.core.topology import MAX_DEVICES

UNHEALTHY_DEVICES = "neuron-scheduler.io/unhealthy-devices"

_MAX_TEXT = MAX_DEVICES * 3  # "63," per device


class HealthError(ValueError):
    """The annotation cannot be read as this node's device ids."""


def encode(devices: Iterable[int]) -> str | None:
    """The annotation's value for these unhealthy devices; None (no annotation) for none."""
    ids = sorted(set(devices))
    return comma_ids(ids) if ids else None


def decode(text: str | None, devices: int) -> int:
    """The unhealthy devices (a mask) of a node with `devices` devices; 0 without the
    annotation. HealthError when it is not a list of that node's device ids."""
    if text is None or not text.strip():
        return 0
    shown = repr(text) if len(text) <= 40 else repr(text[:37] + "...")
    if len(text) > _MAX_TEXT:
        raise HealthError(f"{UNHEALTHY_DEVICES} is {len(text)} characters long")
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise HealthError(f"{UNHEALTHY_DEVICES}={shown} is not a list of device ids") from None
    outside = [i for i in ids if not 0 <= i < devices]
    if outside:
        raise HealthError(f"{UNHEALTHY_DEVICES}={shown} names devices beyond the node's {devices}")
    return ids_mask(ids)


def unhealthy_taint_key(driver: str) -> str:
    """On the DRA path the same fact is a NoSchedule taint `<driver>/unhealthy=neuronN` on every
    published device set that contains failed device N (dra/slices)."""
    return f"{driver}/unhealthy"


def tainted_device(value: str) -> int | None:
    """The failed device an unhealthy taint's value (`neuronN`) names; None when it names none
    (read as untrusted: bounded)."""
    digits = value.removeprefix("neuron")
    if not digits.isdigit() or len(digits) > 3 or int(digits) >= MAX_DEVICES:
        return None
    return int(digits)


def describe(mask: int) -> str:
    """ "device 5", "devices 3,5"."""
    ids = mask_ids(mask)
    return f"device{'s' if len(ids) != 1 else ''} {format_ids(ids)}"
