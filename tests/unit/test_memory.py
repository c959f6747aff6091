"""The extender gives freed heap back after a burst (issue 15's hostile requests)."""

from __future__ import annotations

from neuron_scheduler.extender.memory import MemoryReturner, malloc_trim, rss_bytes

MB = 1 << 20


def test_trims_once_per_growth_and_never_while_idle() -> None:
    rss = [100 * MB]
    trims: list[int] = []

    def trim() -> None:
        trims.append(rss[0])
        rss[0] -= 40 * MB  # what the heap held free

    returner = MemoryReturner(growth=32 * MB, rss=lambda: rss[0], trim=trim)
    assert not returner.check()
    rss[0] = 120 * MB  # grew, but less than `growth`
    assert not returner.check()
    rss[0] = 150 * MB
    assert returner.check() and trims == [150 * MB]
    assert returner.floor == 110 * MB
    for _ in range(5):  # idle: nothing to give back
        assert not returner.check()
    rss[0] = 90 * MB  # shrank on its own: the floor follows it down
    returner.check()
    assert returner.floor == 90 * MB and len(trims) == 1


def test_without_malloc_trim_nothing_is_trimmed() -> None:
    returner = MemoryReturner(growth=1, rss=iter(range(0, 10**9, MB)).__next__, trim=None)
    assert not returner.check() and returner.trims == 0


def test_the_real_trim_and_rss_work_here() -> None:
    trim = malloc_trim()
    assert trim is not None  # glibc (the image is Debian's)
    before = rss_bytes()
    assert before > 0
    trim()
