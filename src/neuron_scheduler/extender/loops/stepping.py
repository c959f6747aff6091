"""How a leader's loop runs its steps: one after another for as long as the process lives, each
after a signal or at the latest after a period, and never ended by a bug in a step (a loop that
stopped would leave its holds, plans or failures untended until a restart)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from neuron_scheduler.core.logtext import loggable


async def run_steps(
    step: Callable[[], Awaitable[None]],
    signal: asyncio.Event,
    seconds: float,
    what: str,
    log: logging.Logger,
) -> None:
    while True:
        try:
            await step()
        except Exception as error:  # a bug: logged, and the next step tries again
            log.exception("%s step failed: %s", what, loggable(error))
        await wait_signal(signal, seconds)
        signal.clear()


async def wait_signal(signal: asyncio.Event, seconds: float) -> None:
    """Until the signal or the period, whichever comes first. Not `asyncio.wait_for`: on Python
    3.11 it can swallow a cancellation that arrives as the signal is set, and the loop would
    then outlive the shutdown that cancelled it."""
    waiter = asyncio.ensure_future(signal.wait())
    try:
        await asyncio.wait((waiter,), timeout=seconds)
    finally:
        waiter.cancel()
