"""Discovery and the health poll over a fake /dev and /sys tree."""

from __future__ import annotations

import asyncio
from pathlib import Path

from neuron_scheduler.core.resources import Unit
from neuron_scheduler.deviceplugin.devicewatch import DeviceWatch
from neuron_scheduler.deviceplugin.hardware import SysfsHardware


def tree(root: Path, devices: int, cores: int) -> SysfsHardware:
    (root / "dev").mkdir(parents=True, exist_ok=True)
    for d in range(devices):
        (root / "dev" / f"neuron{d}").touch()
        entry = root / "sys/class/neuron_device" / f"neuron{d}"
        entry.mkdir(parents=True, exist_ok=True)
        (entry / "core_count").write_text(f"{cores}\n")
    return SysfsHardware(root / "dev", root / "sys")


async def test_trn2_at_lnc2_advertises_four_logical_cores_per_device(tmp_path: Path) -> None:
    (tmp_path / "logical_nc_config").write_text("2\n")
    watch = DeviceWatch(tree(tmp_path, 16, 8), tmp_path / "logical_nc_config", None, 0.01)
    state = await watch.discover(asyncio.Event())
    assert state is not None
    assert state.cores_per_device == 4
    assert len(state.advertised(Unit.CORE)) == 64
    assert len(state.advertised(Unit.DEVICE)) == 16


async def test_waits_for_devices_then_reports_health_changes(tmp_path: Path) -> None:
    hardware = SysfsHardware(tmp_path / "dev", tmp_path / "sys")
    watch = DeviceWatch(hardware, tmp_path / "none", None, 0.01)
    stop = asyncio.Event()
    discovery = asyncio.create_task(watch.discover(stop))
    await asyncio.sleep(0.05)
    assert not discovery.done()  # no devices yet: it waits instead of failing
    tree(tmp_path, 2, 2)
    state = await discovery  # the next attempt, a second later, finds them
    assert state is not None and state.device_count == 2
    polling = asyncio.create_task(watch.run(state, stop))
    version = state.version
    (tmp_path / "dev/neuron1").unlink()
    await state.wait_newer(version)
    assert state.advertised(Unit.DEVICE) == (("0", True), ("1", False))
    stop.set()
    await polling


async def test_stop_ends_discovery_without_devices(tmp_path: Path) -> None:
    watch = DeviceWatch(SysfsHardware(tmp_path, tmp_path), tmp_path / "none", None, 0.01)
    stop = asyncio.Event()
    stop.set()
    assert await watch.discover(stop) is None
