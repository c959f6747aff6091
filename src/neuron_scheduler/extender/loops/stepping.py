"""How a leader's loop runs its steps: one now, then one each `seconds` or as soon as it is
signalled, whichever comes first; a step that fails (a bug) is logged and the next one tries
again, so the loop never ends while the extender runs."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from neuron_scheduler.core.logtext import loggable


async def step_forever(
    step: Callable[[], Awaitable[None]],
    signal: asyncio.Event,
    seconds: float,
    log: logging.Logger,
    what: str,
) -> None:
    while True:
        try:
            await step()
        except Exception as error:  # a bug: logged, and the next step tries again
            log.exception("%s step failed: %s", what, loggable(error))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(signal.wait(), seconds)
        signal.clear()
