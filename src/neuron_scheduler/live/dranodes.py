"""Nodes our DRA driver serves, as `status` and `why` show them: which of their devices failed.
Pure: the slices go in, a view comes out.

On the DRA path no Node advertises Neuron resources (the device plugin stays off those nodes),
so the ledger does not model them; the driver publishes every legal device set in
ResourceSlices, and puts a NoSchedule taint `<driver>/unhealthy=neuronN` on each set that
contains a failed device N, which kube-scheduler then never allocates (docs/dra.md, "Health").
Each failed device taints its own single-device set, so the taints' values name every failed
device. Read as untrusted: only our driver's taint key, device indexes bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

from neuron_scheduler.core.health import describe, tainted_device, unhealthy_taint_key
from neuron_scheduler.core.ids import ids_mask


class _Taint(msgspec.Struct):
    key: str = ""
    value: str = ""


class _Device(msgspec.Struct):
    name: str = ""
    taints: list[_Taint] = []


class _Spec(msgspec.Struct):
    driver: str = ""
    nodeName: str = ""
    devices: list[_Device] = []


class HealthSlice(msgspec.Struct):
    """A ResourceSlice as this view reads it: its node, and its devices' taints."""

    spec: _Spec = msgspec.field(default_factory=_Spec)


@dataclass(frozen=True, slots=True)
class DraNode:
    name: str
    devices: int  # device sets published (every legal set, not devices)
    unhealthy: tuple[int, ...]  # failed devices, from the sets' taints


def dra_nodes(slices: Iterable[HealthSlice], driver: str) -> tuple[DraNode, ...]:
    """Our driver's nodes, by name."""
    key = unhealthy_taint_key(driver)
    published: dict[str, int] = {}
    failed: dict[str, set[int]] = {}
    for piece in slices:
        spec = piece.spec
        if spec.driver != driver or not spec.nodeName:
            continue
        published[spec.nodeName] = published.get(spec.nodeName, 0) + len(spec.devices)
        sick = failed.setdefault(spec.nodeName, set())
        for device in spec.devices:
            for taint in device.taints[:4]:
                index = tainted_device(taint.value) if taint.key == key else None
                if index is not None:
                    sick.add(index)
    return tuple(
        DraNode(name, published[name], tuple(sorted(failed[name]))) for name in sorted(published)
    )


def dra_json(nodes: tuple[DraNode, ...], unread: str | None, driver: str) -> dict[str, object]:
    """`status --json`'s `dra`: documented in docs/operations.md."""
    return {
        "driver": driver,
        "nodes": [
            {"name": n.name, "device_sets": n.devices, "unhealthy_devices": list(n.unhealthy)}
            for n in nodes
        ],
        "unread": unread,
    }


def dra_text(nodes: tuple[DraNode, ...]) -> str:
    """One line for people: how many nodes our driver serves, and which devices failed."""
    failed = [f"{n.name} ({describe(ids_mask(n.unhealthy))})" for n in nodes if n.unhealthy]
    text = f"{len(nodes)} nodes served by DRA"
    if failed:
        shown = "; ".join(failed[:10]) + (
            f" and {len(failed) - 10} more" if len(failed) > 10 else ""
        )
        text += f"; failed devices, never allocated (their sets are tainted): {shown}"
    return text
