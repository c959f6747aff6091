"""Keeps the device list current: discovery at start, then a health poll that wakes ListAndWatch
streams only when something changed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from neuron_scheduler.core.resources import Unit
from neuron_scheduler.deviceplugin.hardware import Hardware, Scan, read_logical_nc_config
from neuron_scheduler.deviceplugin.inventory import (
    DeviceHealth,
    advertised,
    common_core_count,
    cores_per_device,
    device_health,
)
from neuron_scheduler.kube.backoff import Backoff

log = logging.getLogger(__name__)


class DeviceState:
    """The current health of every device, with a version that streams wait on."""

    def __init__(self, cores_per_device: int, health: dict[int, DeviceHealth]) -> None:
        self.cores_per_device = cores_per_device
        self._health = dict(health)
        self.version = 0
        self._changed = asyncio.Event()

    @property
    def health(self) -> dict[int, DeviceHealth]:
        return dict(self._health)

    @property
    def device_count(self) -> int:
        return max(self._health, default=-1) + 1

    def advertised(self, unit: Unit) -> tuple[tuple[str, bool], ...]:
        return advertised(self._health, unit, self.cores_per_device)

    def update(self, health: dict[int, DeviceHealth]) -> bool:
        if health == self._health:
            return False
        self._health = dict(health)
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        return True

    async def wait_newer(self, version: int) -> int:
        while self.version == version:
            await self._changed.wait()
        return self.version


def _describe(scan: Scan) -> str:
    return "; ".join(scan.problems) or "no neuronN entries"


class DeviceWatch:
    def __init__(
        self,
        hardware: Hardware,
        logical_nc_config: Path,
        cores_per_device_override: int | None,
        interval: float,
    ) -> None:
        self.hardware = hardware
        self.logical_nc_config = logical_nc_config
        self.override = cores_per_device_override
        self.interval = interval
        self._expected_core_count: int | None = None

    async def _scan(self) -> Scan:
        # sysfs reads can block on a wedged driver; keep the event loop serving meanwhile.
        return await asyncio.to_thread(self.hardware.scan)

    async def discover(self, stop: asyncio.Event) -> DeviceState | None:
        """The first device list; waits (and says why) while there is none. None when stopped."""
        backoff = Backoff(initial=1.0, maximum=60.0)
        while not stop.is_set():
            scan = await self._scan()
            lnc, lnc_warning = read_logical_nc_config(self.logical_nc_config)
            cores, warning = cores_per_device(scan, lnc, self.override)
            if scan.devices and cores:
                for text in (lnc_warning, warning):
                    if text:
                        log.warning("%s", text)
                if not self.override:
                    # From now on a device reporting another count is suspect, not the norm.
                    self._expected_core_count = common_core_count(scan)
                health = device_health(scan, (), self._expected_core_count)
                healthy = sum(h.healthy for h in health.values())
                log.info(
                    "found %d Neuron devices (%d healthy), %d cores per device%s",
                    len(health),
                    healthy,
                    cores,
                    f" (Logical NeuronCore factor {lnc})" if lnc > 1 and not self.override else "",
                )
                self._log_problems({}, health)
                return DeviceState(cores, health)
            delay = backoff.failed()
            if backoff.should_log:
                if not scan.devices:
                    what = (
                        f"no Neuron devices in {self.hardware.where()} ({_describe(scan)}); "
                        "is the Neuron driver loaded?"
                    )
                else:
                    what = (
                        f"found {len(scan.devices)} Neuron devices but none reports its core "
                        f"count ({'; '.join(r.problem or '' for r in scan.devices[:3])}); pass "
                        "--cores-per-device to run without sysfs"
                    )
                log.warning("%s Retrying in %.0fs.", what, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        return None

    async def run(self, state: DeviceState, stop: asyncio.Event) -> None:
        """Poll health until stopped; every change goes to the ListAndWatch streams."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
            if stop.is_set():
                return
            try:
                scan = await self._scan()
            except Exception:  # a reader bug must not stop health reporting for good
                log.exception("reading the Neuron devices failed; retrying")
                continue
            before = state.health
            after = device_health(scan, before, self._expected_core_count)
            if state.update(after):
                self._log_problems(before, after)

    @staticmethod
    def _log_problems(before: dict[int, DeviceHealth], after: dict[int, DeviceHealth]) -> None:
        for index, now in sorted(after.items()):
            was = before.get(index)
            if now.healthy and was is not None and not was.healthy:
                log.info("neuron%d is healthy again", index)
            elif not now.healthy and (was is None or was.healthy or was.problem != now.problem):
                log.warning("neuron%d is unhealthy: %s", index, now.problem)
            elif was is None and now.healthy and before:
                log.info("neuron%d appeared", index)
