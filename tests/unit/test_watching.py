"""The list/watch loop against an API server that expires versions, fails and goes silent."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import msgspec
import pytest
from aiohttp import web

from neuron_scheduler.kube import client
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.config import KubeConfig
from neuron_scheduler.kube.errors import TooLarge
from neuron_scheduler.kube.watching import Watch


class Item(msgspec.Struct):
    metadata: dict[str, Any]


class FakeServer:
    """Serves /items: lists from `self.items`; each watch plays the next script in `watches`."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.version = 10
        self.watches: list[list[Any]] = []
        self.list_calls: list[dict[str, str]] = []
        self.watch_calls: list[dict[str, str]] = []
        self.fail_next_list = 0
        self.closing = asyncio.Event()

    def obj(self, name: str) -> dict[str, Any]:
        self.version += 1
        return {"metadata": {"name": name, "resourceVersion": str(self.version)}}

    async def handle(self, request: web.Request) -> web.StreamResponse:
        params = dict(request.query)
        if params.get("watch") != "1":
            self.list_calls.append(params)
            if self.fail_next_list:
                self.fail_next_list -= 1
                return web.json_response({"message": "etcd unhappy"}, status=500)
            # Two pages, to exercise `continue`.
            start = int(params.get("continue") or 0)
            page = self.items[start : start + 2]
            meta: dict[str, str] = {"resourceVersion": str(self.version)}
            if start + 2 < len(self.items):
                meta["continue"] = str(start + 2)
            return web.json_response({"metadata": meta, "items": page})
        self.watch_calls.append(params)
        response = web.StreamResponse()
        await response.prepare(request)
        script = self.watches.pop(0) if self.watches else [("sleep", 60)]
        for step in script:
            if step[0] == "sleep":
                # Ends early when the test stops, so teardown never waits out a long watch.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.closing.wait(), step[1])
                continue
            await response.write(json.dumps({"type": step[0], "object": step[1]}).encode() + b"\n")
        return response


async def start(fake: FakeServer) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_get("/items", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


class View:
    def __init__(self) -> None:
        self.names: set[str] = set()
        self.lists = 0

    def on_list(self, items: list[Item]) -> None:
        self.lists += 1
        self.names = {i.metadata["name"] for i in items}

    def on_change(self, item: Item) -> None:
        self.names.add(item.metadata["name"])

    def on_delete(self, item: Item) -> None:
        self.names.discard(item.metadata["name"])


async def until(check: Any, seconds: float = 10) -> None:
    for _ in range(int(seconds / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def run_watch(fake: FakeServer, view: View, **overrides: Any) -> tuple[Watch[Item], Any]:
    runner, url = await start(fake)
    api = KubeAPI(KubeConfig(server=url))
    watch: Watch[Item] = Watch(
        api,
        "/items",
        Item,
        on_list=view.on_list,
        on_change=view.on_change,
        on_delete=view.on_delete,
    )
    for name, value in overrides.items():
        setattr(watch, name, value)
    task = asyncio.get_running_loop().create_task(watch.run())

    async def stop() -> None:
        fake.closing.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await api.close()
        await runner.cleanup()

    return watch, stop


async def test_list_pages_then_watch_events_and_bookmarks() -> None:
    fake = FakeServer()
    fake.items = [fake.obj(n) for n in ("a", "b", "c")]
    listed_version = str(fake.version)
    fake.watches = [
        [
            ("ADDED", {"metadata": {"name": "d", "resourceVersion": "40"}}),
            ("DELETED", {"metadata": {"name": "a", "resourceVersion": "50"}}),
            ("BOOKMARK", {"metadata": {"resourceVersion": "77"}}),
            ("sleep", 60),
        ]
    ]
    view = View()
    watch, stop = await run_watch(fake, view)
    try:
        await until(lambda: watch.resource_version == "77")
        assert view.names == {"b", "c", "d"}
        assert len(fake.list_calls) == 2  # two pages
        assert fake.watch_calls[0]["resourceVersion"] == listed_version
        assert fake.watch_calls[0]["allowWatchBookmarks"] == "true"
        assert watch.synced.is_set()
    finally:
        await stop()


async def test_each_change_is_timed_and_bookmarks_are_not() -> None:
    fake = FakeServer()
    fake.watches = [
        [
            ("ADDED", {"metadata": {"name": "d", "resourceVersion": "40"}}),
            ("BOOKMARK", {"metadata": {"resourceVersion": "41"}}),
            ("DELETED", {"metadata": {"name": "d", "resourceVersion": "50"}}),
            ("sleep", 60),
        ]
    ]
    timed: list[float] = []
    watch, stop = await run_watch(fake, View(), timer=timed.append)
    try:
        await until(lambda: watch.resource_version == "50")
        assert len(timed) == 2 and all(0 <= seconds < 60 for seconds in timed)
    finally:
        await stop()


async def test_410_relists_and_drops_what_vanished() -> None:
    fake = FakeServer()
    fake.items = [fake.obj("a"), fake.obj("b")]
    gone = {"kind": "Status", "code": 410, "message": "too old resource version"}
    fake.watches = [[("sleep", 0.5), ("ERROR", gone)], [("sleep", 60)]]
    view = View()
    _, stop = await run_watch(fake, view)
    try:
        await until(lambda: view.lists == 1)
        fake.items = [fake.obj("b"), fake.obj("c")]  # `a` was deleted while we were not watching
        await until(lambda: view.lists == 2)
        assert view.names == {"b", "c"}
        assert len(fake.watch_calls) >= 1
    finally:
        await stop()


async def test_failed_list_is_retried_with_backoff() -> None:
    fake = FakeServer()
    fake.items = [fake.obj("a")]
    fake.fail_next_list = 2
    view = View()
    _, stop = await run_watch(fake, view)
    try:
        await until(lambda: view.lists == 1, seconds=20)
        assert len(fake.list_calls) == 3
        assert view.names == {"a"}
    finally:
        await stop()


async def test_silent_watch_is_abandoned_and_resumed() -> None:
    fake = FakeServer()
    fake.items = [fake.obj("a")]
    fake.watches = [[("sleep", 60)], [("ADDED", fake.obj("late")), ("sleep", 60)]]
    view = View()
    _, stop = await run_watch(fake, view, IDLE_SECONDS=0.3)
    try:
        await until(lambda: "late" in view.names)
        assert len(fake.watch_calls) >= 2
    finally:
        await stop()


async def test_an_event_bigger_than_aiohttps_line_limit_is_read() -> None:
    """A pod may carry up to 256 KiB of annotations, and etcd keeps objects up to 1.5 MiB: its
    watch event is one line far over aiohttp's default 128 KiB line limit."""
    fake = FakeServer()
    fake.items = [fake.obj("a")]
    big = {
        "metadata": {"name": "big", "resourceVersion": "40", "annotations": {"x": "y" * 1_400_000}}
    }
    fake.watches = [
        [
            ("ADDED", big),
            ("ADDED", {"metadata": {"name": "after", "resourceVersion": "41"}}),
            ("sleep", 60),
        ]
    ]
    view = View()
    watch, stop = await run_watch(fake, view)
    try:
        await until(lambda: "after" in view.names)
        assert view.names == {"a", "big", "after"}
        assert watch.resource_version == "41"
    finally:
        await stop()


async def test_an_answer_over_the_size_limit_is_refused_whole(monkeypatch: Any) -> None:
    monkeypatch.setattr(client, "MAX_ANSWER_BYTES", 1000)
    fake = FakeServer()
    fake.items = [
        {"metadata": {"name": f"n{i}", "annotations": {"x": "y" * 700}}} for i in range(3)
    ]
    runner, url = await start(fake)
    api = KubeAPI(KubeConfig(server=url))
    try:
        with pytest.raises(TooLarge, match="larger than 1000 bytes"):
            await api.request("GET", "/items")
        fake.items = fake.items[:1]
        assert b'"n0"' in await api.request("GET", "/items")
    finally:
        await api.close()
        await runner.cleanup()
