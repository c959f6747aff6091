"""What the DRA driver reads from the host: /dev/neuronN, sysfs core counts, the Logical NeuronCore
setting and the node's EFA devices. Reading never raises: problems become per-device reasons.

The device plugin reads the same files for itself (deviceplugin.hardware); the two deployables
are kept independent, so this is the driver's own small reader.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

_NEURON = re.compile(r"neuron(\d+)")
_BDF = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-9a-fA-F]")
NEURON_CLASS = Path("class/neuron_device")
EFA_DRIVER = Path("bus/pci/drivers/efa")
MAX_DEVICES_READ = 256  # more entries than any node has: the rest are ignored, not trusted


@dataclass(frozen=True, slots=True)
class HostDevices:
    """One reading of the node's Neuron and EFA devices."""

    # device index -> why it cannot be used (absent: healthy)
    problems: dict[int, str] = field(default_factory=dict)
    devices: tuple[int, ...] = ()
    physical_cores: int | None = None  # per device, what most devices report
    efa_bdfs: frozenset[str] = frozenset()

    @property
    def count(self) -> int:
        """Devices the node has: ids run from 0 to the highest seen."""
        return max(self.devices) + 1 if self.devices else 0


def _indexes(directory: Path) -> set[int]:
    try:
        names = [entry.name for entry in islice(directory.iterdir(), MAX_DEVICES_READ)]
    except OSError:
        return set()
    return {int(m.group(1)) for name in names if (m := _NEURON.fullmatch(name))}


def read_host(dev_root: Path, sys_root: Path) -> HostDevices:
    dev = _indexes(dev_root)
    sysfs = sys_root / NEURON_CLASS
    listed = _indexes(sysfs)
    indexes = sorted(dev | listed)
    counts: dict[int, int | None] = {}
    problems: dict[int, str] = {}
    for index in indexes:
        path = sysfs / f"neuron{index}" / "core_count"
        try:
            reported: int | None = int(path.read_text().strip()[:16])
        except (OSError, ValueError):
            reported = None
        if reported is None or reported < 1:
            reported = None
            problems[index] = f"{path} is missing or not a positive number"
        counts[index] = reported
        if index not in dev:
            problems[index] = f"{dev_root / f'neuron{index}'} is missing"
    common = Counter(c for c in counts.values() if c)
    physical = common.most_common(1)[0][0] if common else None
    for index, count in counts.items():
        if count and physical and count != physical and index not in problems:
            problems[index] = f"neuron{index} reports {count} cores, the others {physical}"
    for index in range(max(indexes) + 1 if indexes else 0):
        if index not in counts:
            problems[index] = f"neuron{index} is not present"
    return HostDevices(problems, tuple(indexes), physical, _efa(sys_root))


def _efa(sys_root: Path) -> frozenset[str]:
    try:
        names = [e.name for e in islice((sys_root / EFA_DRIVER).iterdir(), MAX_DEVICES_READ)]
    except OSError:
        return frozenset()
    return frozenset(name.lower() for name in names if _BDF.fullmatch(name))


def read_logical_nc(path: Path) -> tuple[int, str | None]:
    """The node's Logical NeuronCore factor and a warning; no file means 1."""
    try:
        text = path.read_text()[:256]
    except FileNotFoundError:
        return 1, None
    except OSError as error:
        return 1, f"cannot read {path} ({error.strerror or error}); assuming LNC=1"
    match = re.search(r"\d+", text)
    if match is None or int(match.group()) < 1:
        return 1, f"{path} holds no Logical NeuronCore factor; assuming 1"
    return int(match.group()), None
