"""Giving freed memory back to the system after a burst.

glibc keeps what the process frees in its heap for reuse: after a burst of TLS connections (each
holds OpenSSL buffers) or one very large request, the extender's RSS stayed at its high-water
mark although most of it was free (issue 15's hostile requests: +57 MB after 500 concurrent
connections and 100,000-node filters; `malloc_trim` gave back all but 4 MB of it). A pod's memory
limit counts RSS, so bursts could ratchet the extender towards it. The process's RSS is read
every few seconds (one small file read) and, when it grew by `growth` since the last look that
trimmed, the heap is trimmed: at most one trim per `growth` bytes of growth, none while idle.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

GROWTH = 16 * 1024 * 1024
INTERVAL_SECONDS = 5.0


def malloc_trim() -> Callable[[], None] | None:
    """glibc's malloc_trim(0); None where the C library has none (musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def trim_heap() -> None:
        trim(0)

    return trim_heap


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc has none)."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryReturner:
    def __init__(
        self,
        growth: int = GROWTH,
        rss: Callable[[], int] = rss_bytes,
        trim: Callable[[], None] | None = None,
    ) -> None:
        self.growth = growth
        self.rss = rss
        self.trim = trim
        self.floor = rss()
        self.trims = 0

    def check(self) -> bool:
        """Trims when RSS grew by `growth` since the floor; True when it did."""
        now = self.rss()
        if self.trim is None or now - self.floor < self.growth:
            self.floor = min(self.floor, now) if now else self.floor
            return False
        self.trim()
        self.trims += 1
        self.floor = self.rss()
        log.debug("returned freed memory: RSS %d -> %d MiB", now >> 20, self.floor >> 20)
        return True

    async def run(self, interval: float = INTERVAL_SECONDS) -> None:
        while True:
            await asyncio.sleep(interval)
            self.check()
