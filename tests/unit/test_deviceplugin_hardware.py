"""Discovery and health from a fake /dev and /sys tree, and what each resource advertises."""

from __future__ import annotations

from pathlib import Path

import pytest

from neuron_scheduler.core.resources import Unit
from neuron_scheduler.deviceplugin.hardware import (
    DeviceReading,
    Scan,
    SysfsHardware,
    read_logical_nc_config,
)
from neuron_scheduler.deviceplugin.inventory import (
    advertised,
    cores_per_device,
    device_health,
)


def tree(root: Path, devices: int, cores: int) -> SysfsHardware:
    (root / "dev").mkdir(parents=True)
    for d in range(devices):
        (root / "dev" / f"neuron{d}").touch()
        entry = root / "sys/class/neuron_device" / f"neuron{d}"
        entry.mkdir(parents=True)
        (entry / "core_count").write_text(f"{cores}\n")
    return SysfsHardware(root / "dev", root / "sys")


def test_scan_reads_devices_and_core_counts(tmp_path: Path) -> None:
    hardware = tree(tmp_path, 3, 2)
    (tmp_path / "dev" / "neuron-extra").touch()  # not a device node name
    scan = hardware.scan()
    assert [(r.index, r.dev_present, r.core_count, r.problem) for r in scan.devices] == [
        (0, True, 2, None),
        (1, True, 2, None),
        (2, True, 2, None),
    ]
    assert scan.problems == ()


def test_scan_reports_each_problem_without_raising(tmp_path: Path) -> None:
    hardware = tree(tmp_path, 4, 2)
    (tmp_path / "dev/neuron1").unlink()
    (tmp_path / "sys/class/neuron_device/neuron2/core_count").write_text("lots\n")
    (tmp_path / "sys/class/neuron_device/neuron3/core_count").unlink()
    readings = {r.index: r for r in hardware.scan().devices}
    assert readings[0].problem is None
    assert "neuron1 is missing" in (readings[1].problem or "")
    assert "is not a number" in (readings[2].problem or "")
    assert "core_count is missing" in (readings[3].problem or "")


def test_scan_of_a_missing_tree_names_what_is_missing(tmp_path: Path) -> None:
    scan = SysfsHardware(tmp_path / "nodev", tmp_path / "nosys").scan()
    assert scan.devices == ()
    assert any("nodev does not exist" in p for p in scan.problems)


@pytest.mark.parametrize(
    ("content", "factor", "warns"),
    [(None, 1, False), ("2\n", 2, False), ("NEURON_LOGICAL_NC_CONFIG=1", 1, False), ("x", 1, True)],
)
def test_logical_nc_config(tmp_path: Path, content: str | None, factor: int, warns: bool) -> None:
    path = tmp_path / "logical_nc_config"
    if content is not None:
        path.write_text(content)
    got, warning = read_logical_nc_config(path)
    assert got == factor
    assert (warning is not None) == warns


def scan_of(*counts: int | None) -> Scan:
    return Scan(tuple(DeviceReading(i, True, c) for i, c in enumerate(counts)))


def test_cores_per_device_trn2_at_lnc2_and_override() -> None:
    assert cores_per_device(scan_of(8, 8), lnc=2, override=None) == (4, None)
    assert cores_per_device(scan_of(8, 8), lnc=1, override=None) == (8, None)
    assert cores_per_device(scan_of(2, 2), lnc=1, override=4) == (4, None)
    assert cores_per_device(scan_of(None, None), lnc=1, override=None) == (None, None)
    cores, warning = cores_per_device(scan_of(3), lnc=2, override=None)
    assert cores == 3 and warning is not None


def test_vanished_and_odd_devices_are_unhealthy() -> None:
    before = device_health(scan_of(2, 2, 2), (), 2)
    assert all(h.healthy for h in before.values())
    odd = Scan((DeviceReading(0, True, 2), DeviceReading(1, True, 4)))
    after = device_health(odd, before, 2)
    assert after[0].healthy
    assert not after[1].healthy and "4 cores" in (after[1].problem or "")
    assert not after[2].healthy and "no longer present" in (after[2].problem or "")


def test_advertised_ids_per_unit() -> None:
    health = device_health(
        Scan((DeviceReading(0, True, 2), DeviceReading(1, False, 2, "gone"))), (), 2
    )
    assert advertised(health, Unit.DEVICE, 2) == (("0", True), ("1", False))
    assert advertised(health, Unit.CORE, 2) == (
        ("0", True),
        ("1", True),
        ("2", False),
        ("3", False),
    )
