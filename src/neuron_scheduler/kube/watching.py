"""List-then-watch of one resource kind into callbacks: bookmarks, 410 re-list, backoff.

Each resource has one `Watch` task. A full list replaces the consumer's view (the consumer diffs),
then a watch streams changes from the list's resourceVersion. When the server says the version is
too old (410 Gone) we re-list at once; any other failure waits with capped exponential backoff.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.kube.backoff import Backoff
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.decoding import decode
from neuron_scheduler.kube.errors import READ_ERRORS, Gone, api_error

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Meta(msgspec.Struct):
    resourceVersion: str = ""
    # `continue` is a Python keyword: msgspec renames it.
    continue_: str = msgspec.field(default="", name="continue")


class _Status(msgspec.Struct):
    code: int = 0
    message: str = ""
    metadata: _Meta = msgspec.field(default_factory=_Meta)


class _Event(msgspec.Struct):
    type: str
    object: msgspec.Raw


class _Versioned(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)


class Watch(Generic[T]):
    PAGE = 500
    WATCH_SECONDS = 300  # the server ends each watch after about this long; we re-watch
    IDLE_SECONDS = 120.0  # bookmarks arrive about every minute: silence this long is a dead link

    def __init__(
        self,
        api: KubeAPI,
        path: str,
        kind: type[T],
        *,
        on_list: Callable[[list[T]], None],
        on_change: Callable[[T], None],
        on_delete: Callable[[T], None],
        params: dict[str, str] | None = None,
        timer: Callable[[float], None] | None = None,
    ) -> None:
        """`timer` is told how long each change took to decode and apply (seconds)."""
        self.api = api
        self.timer = timer
        self.path = path
        self.params = params or {}
        items_type: Any = list[kind]  # type: ignore[valid-type]
        self._list_type = msgspec.defstruct(
            "ListOf" + kind.__name__,
            [
                ("metadata", _Meta, msgspec.field(default_factory=_Meta)),
                ("items", items_type, msgspec.field(default_factory=list)),
            ],
        )
        self._kind = kind
        self.on_list, self.on_change, self.on_delete = on_list, on_change, on_delete
        self.synced = asyncio.Event()
        self.lists = 0  # full lists done, for metrics and tests
        # When the latest list was asked for (time.monotonic()): on_list may use it to tell
        # objects deleted before the list from ones it could not have seen yet.
        self.list_started = 0.0
        self.resource_version = ""

    async def run(self) -> None:
        backoff = Backoff(initial=0.5, maximum=30.0, jitter=0.2)
        while True:
            try:
                await self._list()
                backoff.succeeded()
                while True:
                    await self._watch()
            except Gone:
                log.info(
                    "watch %s: resourceVersion %s expired (410 Gone); listing again",
                    self.path,
                    loggable(self.resource_version),
                )
            except asyncio.CancelledError:
                raise
            except READ_ERRORS as error:
                delay = backoff.failed()
                log.warning(
                    "watch %s failed: %s; retrying in about %.1fs",
                    self.path,
                    loggable(error or type(error).__name__),
                    delay,
                )
                await asyncio.sleep(delay)

    async def _list(self) -> None:
        items: list[T] = []
        token = ""
        self.list_started = time.monotonic()
        while True:
            params = {**self.params, "limit": str(self.PAGE)}
            if token:
                params["continue"] = token
            body = await self.api.request("GET", self.path, params=params)  # 410: Gone
            page: Any = decode(body, self._list_type)
            items.extend(page.items)
            token = page.metadata.continue_
            if not token:
                self.resource_version = page.metadata.resourceVersion
                break
        self.on_list(items)
        self.lists += 1
        if not self.synced.is_set():
            log.info("watch %s: first list done (%d objects)", self.path, len(items))
        self.synced.set()

    async def _watch(self) -> None:
        params = {
            **self.params,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": self.resource_version,
            "timeoutSeconds": str(int(self.WATCH_SECONDS * random.uniform(0.8, 1.2))),
        }
        async for line in self.api.stream(self.path, params, idle_timeout=self.IDLE_SECONDS):
            start = time.perf_counter()
            event = decode(line, _Event)
            if event.type == "ERROR":
                status = decode(event.object, _Status)
                raise api_error("WATCH", self.path, status.code or 500, bytes(event.object))
            version = decode(event.object, _Versioned)
            if event.type != "BOOKMARK":
                obj = decode(event.object, self._kind)
                if event.type == "DELETED":
                    self.on_delete(obj)
                else:
                    self.on_change(obj)
                if self.timer is not None:
                    self.timer(time.perf_counter() - start)
            if version.metadata.resourceVersion:
                self.resource_version = version.metadata.resourceVersion
