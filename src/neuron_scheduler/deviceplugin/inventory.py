"""From driver readings to what each resource advertises: ids and their health. Pure.

Device ids are device indexes; core ids are global: device d owns cores d*c .. d*c+c-1, where c is
the number of (logical) cores per device, the numbering the scheduler uses too.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from neuron_scheduler.core.resources import Unit
from neuron_scheduler.deviceplugin.hardware import Scan

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


@dataclass(frozen=True, slots=True)
class DeviceHealth:
    index: int
    healthy: bool
    problem: str | None = None


def common_core_count(scan: Scan) -> int | None:
    """The physical core count most devices report; None when none can be read."""
    counts = Counter(r.core_count for r in scan.devices if r.core_count)
    return counts.most_common(1)[0][0] if counts else None


def cores_per_device(scan: Scan, lnc: int, override: int | None) -> tuple[int | None, str | None]:
    """Logical cores per device, and a warning; None while no device says how many it has."""
    if override:
        return override, None
    physical = common_core_count(scan)
    if physical is None:
        return None, None
    if physical % lnc:
        return physical, (
            f"devices have {physical} cores, not a multiple of the Logical NeuronCore factor "
            f"{lnc}; advertising {physical} cores per device"
        )
    return physical // lnc, None


def device_health(
    scan: Scan,
    known: Iterable[int],
    expected_core_count: int | None,
) -> dict[int, DeviceHealth]:
    """Health of every device seen now or before (a device that vanished stays, Unhealthy, so its
    ids do not silently disappear from kubelet's view).

    expected_core_count: the physical count every device must report, None to accept any.
    """
    readings = {r.index: r for r in scan.devices}
    health: dict[int, DeviceHealth] = {}
    for index in sorted({*known, *readings}):
        reading = readings.get(index)
        if reading is None:
            health[index] = DeviceHealth(index, False, f"neuron{index} is no longer present")
        elif reading.problem:
            health[index] = DeviceHealth(index, False, reading.problem)
        elif expected_core_count and reading.core_count != expected_core_count:
            health[index] = DeviceHealth(
                index,
                False,
                f"neuron{index} reports {reading.core_count} cores, the others "
                f"{expected_core_count}",
            )
        else:
            health[index] = DeviceHealth(index, True)
    return health


def advertised(
    health: Mapping[int, DeviceHealth], unit: Unit, cores_per_device: int
) -> tuple[tuple[str, bool], ...]:
    """(id, healthy) for one resource, in id order."""
    items: list[tuple[str, bool]] = []
    for index in sorted(health):
        ok = health[index].healthy
        if unit is Unit.DEVICE:
            items.append((str(index), ok))
        else:
            first = index * cores_per_device
            items.extend((str(core), ok) for core in range(first, first + cores_per_device))
    return tuple(items)
