"""Retry pacing for conditions outside our control (no API server, no kubelet, no devices)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field


@dataclass
class Backoff:
    """Exponential delays between attempts, reset by a success.

    `jitter` spreads each delay by up to that fraction either way, so many clients that failed
    together do not retry together. Also throttles the log line that explains a lasting failure:
    `should_log` is true on the first failure and then only when the count of failures doubles, so
    a node without kubelet logs a handful of lines an hour instead of two a second.
    """

    initial: float = 0.5
    maximum: float = 30.0
    jitter: float = 0.0
    _delay: float = field(default=0.0, init=False)
    _failures: int = field(default=0, init=False)
    _next_attempt: float = field(default=0.0, init=False)

    @property
    def failures(self) -> int:
        return self._failures

    def failed(self, now: float | None = None) -> float:
        """Record a failure; the delay before the next attempt."""
        self._failures += 1
        self._delay = min(self.maximum, self._delay * 2 if self._delay else self.initial)
        delay = self._delay * random.uniform(1 - self.jitter, 1 + self.jitter)
        self._next_attempt = (time.monotonic() if now is None else now) + delay
        return delay

    async def wait(self) -> None:
        """Record a failure and sleep until the next attempt."""
        await asyncio.sleep(self.failed())

    def succeeded(self) -> None:
        self._delay = 0.0
        self._failures = 0
        self._next_attempt = 0.0

    def ready(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self._next_attempt

    @property
    def should_log(self) -> bool:
        # Failures 1, 2, 4, 8, ...: powers of two.
        return self._failures > 0 and self._failures & (self._failures - 1) == 0
