"""What the node's Neuron driver shows: /dev/neuronN nodes and /sys/class/neuron_device/neuronN.

Behind the `Hardware` protocol so tests point the real reader at a fake tree of plain files.
Reading never raises: every problem becomes a per-device `problem` text that the health logic
and the logs use.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

_NAME = re.compile(r"neuron(\d+)")
SYSFS_CLASS = Path("class/neuron_device")


@dataclass(frozen=True, slots=True)
class DeviceReading:
    index: int
    dev_present: bool
    core_count: int | None  # physical cores, from sysfs; None when unreadable
    problem: str | None = None  # why the device cannot be used, for the logs


@dataclass(frozen=True, slots=True)
class Scan:
    devices: tuple[DeviceReading, ...]
    # Problems with the tree itself (directory missing or unreadable), for the logs.
    problems: tuple[str, ...] = ()


class Hardware(Protocol):
    def scan(self) -> Scan: ...

    def where(self) -> str:
        """Where devices are looked for, for log lines."""
        ...


def _indexes(directory: Path) -> tuple[set[int], str | None]:
    try:
        names = [entry.name for entry in directory.iterdir()]
    except FileNotFoundError:
        return set(), f"{directory} does not exist"
    except OSError as error:
        return set(), f"cannot list {directory}: {error.strerror or error}"
    return {int(m.group(1)) for name in names if (m := _NAME.fullmatch(name))}, None


class SysfsHardware:
    """Reads `<dev_root>/neuronN` and `<sys_root>/class/neuron_device/neuronN/core_count`."""

    def __init__(self, dev_root: Path, sys_root: Path) -> None:
        self.dev_root = dev_root
        self.sys_class = sys_root / SYSFS_CLASS

    def where(self) -> str:
        return f"{self.dev_root} and {self.sys_class}"

    def scan(self) -> Scan:
        dev, dev_problem = _indexes(self.dev_root)
        sys, sys_problem = _indexes(self.sys_class)
        readings = tuple(self._read(index, index in dev) for index in sorted(dev | sys))
        problems = tuple(p for p in (dev_problem, sys_problem) if p)
        return Scan(readings, problems)

    def _read(self, index: int, dev_present: bool) -> DeviceReading:
        path = self.sys_class / f"neuron{index}" / "core_count"
        core_count: int | None = None
        problem: str | None = None
        try:
            text = path.read_text().strip()
            core_count = int(text)
            if core_count < 1:
                core_count, problem = None, f"{path} says {text!r} cores"
        except FileNotFoundError:
            problem = f"{path} is missing"
        except OSError as error:
            problem = f"cannot read {path}: {error.strerror or error}"
        except ValueError:
            problem = f"{path} is not a number"
        if not dev_present:
            missing = f"{self.dev_root / f'neuron{index}'} is missing"
            problem = f"{missing}; {problem}" if problem else missing
        return DeviceReading(index, dev_present, core_count, problem)


def read_logical_nc_config(path: Path) -> tuple[int, str | None]:
    """The Logical NeuronCore factor (physical cores per logical core) and a warning, if any.

    No file means LNC=1, which is how every instance type but Trn2 and later runs. The file's
    exact format is not documented; the first whole number in it is taken (`2`, or `LNC=2`).
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 1, None
    except OSError as error:
        return 1, f"cannot read {path} ({error.strerror or error}); assuming LNC=1"
    match = re.search(r"\d+", text)
    if match is None or int(match.group()) < 1:
        return 1, f"{path} holds no Logical NeuronCore factor ({text.strip()[:40]!r}); assuming 1"
    return int(match.group()), None
