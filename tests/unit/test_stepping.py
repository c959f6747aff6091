"""The one way a leader's loop steps (extender/loops/stepping): a bug in a step does not end it,
a signal starts the next step early, and a cancellation ends it even when it comes as the
signal is set (Python 3.11's `asyncio.wait_for` swallowed that one)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from neuron_scheduler.extender.loops.stepping import run_steps

log = logging.getLogger("test")


async def test_a_failing_step_does_not_end_the_loop_and_a_signal_starts_the_next() -> None:
    signal = asyncio.Event()
    steps: list[int] = []

    async def step() -> None:
        steps.append(len(steps))
        if len(steps) == 1:
            raise RuntimeError("a bug")

    task = asyncio.create_task(run_steps(step, signal, 3600, "test", log))
    for _ in range(3):
        await asyncio.sleep(0.01)
        signal.set()  # not the hour: the signal
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(steps) >= 3


async def test_a_cancel_that_comes_as_the_signal_is_set_still_ends_the_loop() -> None:
    signal = asyncio.Event()
    steps = 0

    async def step() -> None:
        nonlocal steps
        steps += 1

    task = asyncio.create_task(run_steps(step, signal, 3600, "test", log))
    await asyncio.sleep(0.01)  # the first step has run; the loop waits
    signal.set()
    task.cancel()
    done, _ = await asyncio.wait((task,), timeout=5)
    assert done, "the loop outlived its cancellation"
    assert task.cancelled() and steps == 1
