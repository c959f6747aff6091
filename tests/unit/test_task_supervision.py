"""A watch or loop of the extender that raises stops the extender, loudly (serve.stop_on_failure):
a restarted extender lists everything again, where a dead task left a cache that no longer
followed the cluster."""

from __future__ import annotations

import asyncio

import pytest

from neuron_scheduler.extender.serve import stop_on_failure


async def test_a_task_that_raises_stops_the_extender_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stops: list[str] = []

    async def broken() -> None:
        raise RuntimeError("an object the watch could not take")

    async def done_quietly() -> None:
        return None  # (a resource the API server does not serve: its watch ends)

    async def running() -> None:
        await asyncio.sleep(3600)

    loop = asyncio.get_running_loop()
    quiet = loop.create_task(done_quietly(), name="the DRA watch")
    alive = loop.create_task(running(), name="the waker")
    stop_on_failure([quiet, alive], lambda: stops.append("stop"))
    await asyncio.sleep(0.01)
    assert stops == []  # ended on its own, or still running: nothing to stop for
    failing = loop.create_task(broken(), name="the pod watch")
    stop_on_failure([failing], lambda: stops.append("stop"))
    await asyncio.gather(failing, return_exceptions=True)
    await asyncio.sleep(0)  # (done callbacks run on the next turn of the loop)
    assert stops == ["stop"]
    assert "the pod watch failed; stopping the extender" in caplog.text
    assert "RuntimeError: an object the watch could not take" in caplog.text
    alive.cancel()  # as shutdown cancels every task: quiet
    await asyncio.gather(alive, return_exceptions=True)
    await asyncio.sleep(0)
    assert stops == ["stop"]
