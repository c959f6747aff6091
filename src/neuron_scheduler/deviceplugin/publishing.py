"""Publishes which of this node's devices failed on its Node (core/health), so that the extender
never plans for them.

The kubelet shows the scheduler only how many devices are healthy (allocatable below capacity),
never which: the extender would keep annotating a failed device. So every health change the
kubelet hears of (ListAndWatch) is also written to one annotation of this node's Node, and
written once at start (a value left by a plugin that died while a device was failed is replaced).
A write that fails is retried with backoff until it lands or the health changes again; the
latest health is always what gets written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from neuron_scheduler.core import health
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.deviceplugin.devicewatch import DeviceState
from neuron_scheduler.kube.backoff import Backoff
from neuron_scheduler.kube.errors import API_ERRORS

log = logging.getLogger(__name__)


class HealthSink(Protocol):
    async def publish_unhealthy(self, value: str | None) -> None:
        """Set this node's annotation to `value` (None: remove it)."""
        ...


_UNWRITTEN = object()


class HealthPublisher:
    def __init__(
        self, sink: HealthSink, state: DeviceState, backoff: Backoff | None = None
    ) -> None:
        self.sink = sink
        self.state = state
        self.backoff = backoff or Backoff(initial=1.0, maximum=30.0, jitter=0.2)
        self.written: object = _UNWRITTEN  # the value the Node has, as far as we know

    def wanted(self) -> str | None:
        return health.encode(i for i, h in self.state.health.items() if not h.healthy)

    async def publish(self) -> float | None:
        """Write the current health if the Node does not have it yet; when the write failed,
        the seconds until the next try."""
        value = self.wanted()
        if value == self.written:
            return None
        try:
            await self.sink.publish_unhealthy(value)
        except API_ERRORS as error:
            delay = self.backoff.failed()
            if self.backoff.should_log:
                log.warning(
                    "cannot publish this node's failed devices (%s) on its Node: %s; the "
                    "extender may place pods on them until this succeeds (retrying)",
                    value or "none",
                    loggable(error),
                )
            return delay
        if self.backoff.failures:
            log.info("published this node's failed devices after %d tries", self.backoff.failures)
        self.backoff.succeeded()
        self.written = value
        log.info(
            "published on the Node: %s",
            f"{health.UNHEALTHY_DEVICES}={value}" if value else "every device is healthy",
        )
        return None

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            version = self.state.version
            delay = await self.publish()  # None: wait for the next change only
            waits: list[asyncio.Future[object]] = [
                asyncio.ensure_future(stop.wait()),
                asyncio.ensure_future(self.state.wait_newer(version)),
            ]
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED), delay
                    )
            finally:
                for task in waits:
                    task.cancel()
