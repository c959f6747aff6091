"""Device and core ids: bit masks, the id-list text format, and which cores a device owns. Pure.

Device d owns the global cores d*c .. d*c+c-1, where c is the node's cores per device; this module
is the one place that rule is written. Sets of ids are int bit masks (bit i = id i) wherever they
are compared often.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache


def mask_ids(mask: int) -> list[int]:
    """The ids of a mask, lowest first."""
    ids = []
    while mask:  # one step per set bit
        lowest = mask & -mask
        ids.append(lowest.bit_length() - 1)
        mask ^= lowest
    return ids


def ids_mask(ids: Iterable[int]) -> int:
    mask = 0
    for i in ids:
        mask |= 1 << i
    return mask


def comma_ids(ids: Iterable[int]) -> str:
    """`0,1,5`: the plain form the annotations and kubelet's environment use."""
    return ",".join(map(str, ids))


def format_ids(ids: list[int] | tuple[int, ...]) -> str:
    """`0,1,5` for short lists, runs of three or more as ranges: `0-5,10`; `none` when empty.
    For people (logs, refusal reasons, the CLI)."""
    if not ids:
        return "none"
    ordered = sorted(ids)
    parts: list[str] = []
    start = prev = ordered[0]
    for i in [*ordered[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        if prev - start >= 2:
            parts.append(f"{start}-{prev}")
        else:
            parts.extend(str(x) for x in range(start, prev + 1))
        if i is not None:
            start = prev = i
    return ",".join(parts)


def parse_id_ranges(text: str) -> list[int]:
    """Inverse of `format_ids`; also accepts plain comma lists. Raises ValueError on bad input."""
    text = text.strip()
    if not text or text == "none":
        return []
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            low_text, high_text = part.split("-", 1)
            low, high = int(low_text), int(high_text)
            if low < 0 or high < low:
                raise ValueError(f"bad id range {part!r}")
            ids.extend(range(low, high + 1))
        else:
            value = int(part)
            if value < 0:
                raise ValueError(f"negative id {part!r}")
            ids.append(value)
    return ids


def cores_of_devices(devices: Iterable[int], cores_per_device: int) -> tuple[int, ...]:
    """The global core ids the devices own, device by device in the given order."""
    return tuple(d * cores_per_device + i for d in devices for i in range(cores_per_device))


def devices_of_cores(cores: Iterable[int], cores_per_device: int) -> tuple[int, ...]:
    """The devices that own these cores, ascending."""
    return tuple(sorted({c // cores_per_device for c in cores}))


@lru_cache(maxsize=1024)
def core_mask_of_devices(devices: int, cores_per_device: int) -> int:
    """The cores (mask) owned by a set of devices (mask)."""
    per_device = (1 << cores_per_device) - 1
    mask = 0
    for d in mask_ids(devices):
        mask |= per_device << (d * cores_per_device)
    return mask


@lru_cache(maxsize=1 << 14)
def devices_touched(cores: int, cores_per_device: int, devices: int) -> int:
    """The devices (mask) among the first `devices` with at least one of these cores."""
    per_device = (1 << cores_per_device) - 1
    busy = 0
    for d in range(devices):
        if (cores >> (d * cores_per_device)) & per_device:
            busy |= 1 << d
    return busy
