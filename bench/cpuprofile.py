"""Runs a Python program under a sampler of CPU time: the stacks of what the process was running
each time it had used another 5 ms of CPU (SIGPROF), as collapsed stacks. SIGUSR1 starts the
count over, SIGUSR2 writes it out (servers such as uvicorn end on a signal, without atexit).

py-spy samples threads by wall clock and counts one that waits for a CPU as busy: on a saturated
2-core machine most of its "busy" samples of the extender were waits after a write that woke the
peer (kube-scheduler, the API server), filed under the write. SIGPROF ticks only while the
process runs, so these shares are CPU time. Time in C code (TLS in uvloop, syscalls) lands on the
next Python frame that runs, which is usually the caller. bench/throughput.py --profiler cpu uses
it for the extender; bench/profile_summary.py reads the output.

Run: python bench/cpuprofile.py OUTPUT (-m MODULE | SCRIPT) [ARGS...]
"""

from __future__ import annotations

import atexit
import collections
import runpy
import signal
import sys
from pathlib import Path
from types import FrameType

INTERVAL = 0.005  # seconds of CPU time between samples


def main() -> None:
    if len(sys.argv) < 3 or (sys.argv[2] == "-m" and len(sys.argv) < 4):
        raise SystemExit(__doc__)
    output = Path(sys.argv[1])
    stacks: collections.Counter[str] = collections.Counter()
    names: dict[object, str] = {}

    def name(frame: FrameType) -> str:
        code = frame.f_code
        known = names.get(code)
        if known is None:
            path = code.co_filename
            for marker in ("site-packages/", "/src/", "/lib/python3"):
                if marker in path:
                    path = path.split(marker, 1)[1]
                    break
            known = names[code] = f"{code.co_qualname} ({path})"
        return known

    def sample(_: int, frame: FrameType | None) -> None:
        frames = []
        while frame is not None:
            frames.append(name(frame))
            frame = frame.f_back
        stacks[";".join(reversed(frames))] += 1

    def dump(*_: object) -> None:
        output.write_text("".join(f"{stack} {count}\n" for stack, count in stacks.items()))

    atexit.register(dump)
    signal.signal(signal.SIGUSR1, lambda *_: stacks.clear())
    signal.signal(signal.SIGUSR2, dump)
    signal.signal(signal.SIGPROF, sample)
    signal.setitimer(signal.ITIMER_PROF, INTERVAL, INTERVAL)
    if sys.argv[2] == "-m":
        sys.argv = [sys.argv[3], *sys.argv[4:]]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[2:]
        sys.path.insert(0, str(Path(sys.argv[0]).resolve().parent))
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
