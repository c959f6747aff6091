"""Pods that run on a device that failed: told, and evicted when the operator asks for it.

The kubelet never gives a failed device to a new container, and leaves a running one on it
(kubernetes#60388): the pod keeps running without that device. The extender's ledger knows
which devices failed (core/health) and which pods hold them; the leader, once per pod and
failure, records a warning event on the pod naming the device, and in mode `evict` asks the
Eviction API to move it, so its controller recreates it on healthy devices. Eviction respects
PodDisruptionBudgets (a 429 is tried again later); pods no controller recreates, and pods opted
out with `neuron-scheduler.io/do-not-disrupt: "true"`, are only told. What to do is the
operator's choice (docs/operations.md, "When a device fails"); the default only reports.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from neuron_scheduler.core import health
from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.extender.loops.stepping import run_steps
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.state.movability import Movability
from neuron_scheduler.kube.errors import (
    READ_ERRORS,
    Conflict,
    Forbidden,
    NotFound,
    TooManyRequests,
    error_text,
)
from neuron_scheduler.kube.events import Report
from neuron_scheduler.kube.objects import ObjectRef

log = logging.getLogger("neuron_scheduler.extender.devicefailures")

STEP_SECONDS = 2.0  # how often the leader looks (at most): a failure is told within that
RETRY_SECONDS = 30.0  # before an eviction a budget refused, or that failed, is asked again
FAILED = "NeuronDeviceFailed"
RECOVERED = "NeuronDeviceRecovered"


class Action(StrEnum):
    REPORT = "report"  # an event on the pod, a metric; the pod keeps running
    EVICT = "evict"  # and an eviction, when its controller recreates it and budgets allow


class Evictor(Protocol):
    async def evict(self, namespace: str, name: str, uid: str) -> None: ...


@dataclass(slots=True)
class _Told:
    node: str
    devices: int  # the failed devices (mask) the pod was told of
    evict_after: float = 0.0  # monotonic: when an eviction may be asked (again)
    evicted: bool = False


class DeviceFailures:
    def __init__(
        self,
        ledger: Ledger,
        movability: Movability,
        api: Evictor,
        report: Report | None,
        action: Action = Action.REPORT,
        clock: Callable[[], float] = time.monotonic,
        is_leader: Callable[[], bool] = lambda: True,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        """`on_evict(result)`: evicted, refused (a budget), gone, failed."""
        self.ledger = ledger
        self.movability = movability
        self.api = api
        self.report = report
        self.action = action
        self.clock = clock
        self.is_leader = is_leader
        self.on_evict = on_evict
        self._told: dict[str, _Told] = {}  # pod uid -> what it was told
        self._signal = asyncio.Event()

    def changed(self) -> None:
        """A node's failed devices changed (the ledger says): look now, not at the next step."""
        self._signal.set()

    async def run(self) -> None:
        await run_steps(self.step, self._signal, STEP_SECONDS, "device failure", log)

    async def step(self) -> None:
        if not self.is_leader():
            self._told.clear()  # a new leader tells again: events are cheap, silence is not
            return
        now = self.clock()
        current = {uid: (node, devices) for uid, node, devices in self.ledger.on_failed_devices()}
        for uid in [u for u in self._told if u not in current]:
            gone = self._told.pop(uid)
            if not gone.evicted and self.ledger.holding(uid) is not None:
                self._tell(uid, gone.node, gone.devices, recovered=True)
        for uid, (node, devices) in current.items():
            told = self._told.get(uid)
            if told is None or told.devices != devices or told.node != node:
                told = self._told[uid] = _Told(node, devices)
                self._tell(uid, node, devices)
            if self.action is Action.EVICT and not told.evicted and now >= told.evict_after:
                await self._evict(uid, told, now)

    def _evictable(self, uid: str) -> str:
        """Why the pod is not evicted, or ""."""
        facts = self.movability.pods.get(uid)
        if facts is None:
            return "it is not known yet"
        if not facts.owner:
            return "no controller would recreate it"
        if facts.opted_out:
            return "it opted out (neuron-scheduler.io/do-not-disrupt)"
        return ""

    def _tell(self, uid: str, node: str, devices: int, recovered: bool = False) -> None:
        key = self.ledger.pod_key(uid)
        what = health.describe(devices)
        if recovered:
            message = f"{what} of node {node}, among this pod's devices, is healthy again"
            log.info("%s: %s", loggable(key), message)
        else:
            message = (
                f"{what} of node {node}, among this pod's devices, failed (its device plugin "
                "reports it unhealthy): the pod runs on without it, and no new pod gets it"
            )
            if self.action is Action.EVICT:
                why_not = self._evictable(uid)
                message += (
                    f"; not evicted: {why_not}" if why_not else "; evicting it (Eviction API)"
                )
            else:
                message += (
                    "; neuron-scheduler only reports it (scheduler.deviceFailure.podAction: "
                    "report): docs/operations.md, 'When a device fails'"
                )
            log.warning("%s: %s", loggable(key), message)
        if self.report is not None:
            namespace, _, name = key.partition("/")
            ref = ObjectRef("Pod", namespace, name, uid)
            self.report(ref, RECOVERED if recovered else FAILED, message, not recovered)

    async def _evict(self, uid: str, told: _Told, now: float) -> None:
        if uid not in self.movability.pods:  # not listed yet: asked again later
            told.evict_after = now + STEP_SECONDS
            return
        if self._evictable(uid):
            told.evicted = True  # said in the event: never asked
            return
        namespace, _, name = self.ledger.pod_key(uid).partition("/")
        try:
            await self.api.evict(namespace, name, uid)
        except (NotFound, Conflict):
            result = "gone"
            told.evicted = True
        except TooManyRequests as error:
            result = "refused"
            told.evict_after = now + RETRY_SECONDS
            log.info(
                "%s/%s on failed %s: eviction refused (%s); asked again in %.0fs",
                loggable(namespace),
                loggable(name),
                health.describe(told.devices),
                loggable(error_text(error)),
                RETRY_SECONDS,
            )
        except READ_ERRORS as error:
            result = "failed"
            told.evict_after = now + RETRY_SECONDS
            kind = (
                "forbidden: the extender's ClusterRole needs create on pods/eviction "
                "(scheduler.deviceFailure.podAction: evict in the chart grants it)"
                if isinstance(error, Forbidden)
                else error_text(error)
            )
            log.warning(
                "cannot evict %s/%s from failed %s: %s",
                loggable(namespace),
                loggable(name),
                health.describe(told.devices),
                loggable(kind),
            )
        else:
            result = "evicted"
            told.evicted = True
            log.info("evicted %s/%s from failed %s", loggable(namespace), loggable(name), told.node)
        if self.on_evict is not None:
            self.on_evict(result)
