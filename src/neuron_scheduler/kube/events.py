"""Kubernetes Events: what a person sees in `kubectl describe`. Sent in the background, never
waited for, and thinned out: the same message about the same object is sent once per
`REPEAT_SECONDS`, so a node or pod that stays wrong cannot flood the API server."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.errors import API_ERRORS
from neuron_scheduler.kube.objects import ObjectRef
from neuron_scheduler.kube.tasks import BackgroundTasks

log = logging.getLogger(__name__)


class Report(Protocol):
    """What code with no I/O of its own (the ledger) is given to tell about an object. `name`:
    the event's own name, for an event that must be sent at most once ever (a second one of that
    name is refused by the API server); "" for a generated one."""

    def __call__(
        self, ref: ObjectRef, reason: str, message: str, warning: bool, name: str = ""
    ) -> None: ...


class EventRecorder:
    REPEAT_SECONDS = 600.0
    REMEMBERED = 10_000  # recent (object, reason, message) keys kept for thinning

    def __init__(self, api: KubeAPI, clock: Callable[[], float] = time.monotonic) -> None:
        self.api = api
        self.clock = clock
        self._tasks = BackgroundTasks()
        self._sent: OrderedDict[tuple[str, str, str, str], float] = OrderedDict()

    def record(
        self, ref: ObjectRef, reason: str, message: str, warning: bool = True, name: str = ""
    ) -> None:
        key = (ref.kind, ref.uid or ref.text, reason, message)
        now = self.clock()
        last = self._sent.get(key)
        if last is not None and now - last < self.REPEAT_SECONDS:
            return
        self._sent[key] = now
        self._sent.move_to_end(key)
        while len(self._sent) > self.REMEMBERED:
            self._sent.popitem(last=False)
        self._tasks.spawn(self._send(ref, reason, message, warning, name))

    async def _send(
        self, ref: ObjectRef, reason: str, message: str, warning: bool, name: str
    ) -> None:
        try:
            await self.api.create_event(ref, reason, message, warning, name)
        except API_ERRORS as error:
            log.debug(
                "event %s for %s %s not recorded: %s",
                reason,
                ref.kind,
                loggable(ref.text),
                loggable(error),
            )

    async def close(self) -> None:
        await self._tasks.close()
