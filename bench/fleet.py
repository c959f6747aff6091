"""What the benchmarks share: the node types of their fake fleet, process figures, and the
checkout on sys.path (the testbed and the object builders live in tests/)."""

from __future__ import annotations

import contextlib
import os
import platform
import random
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from neuron_scheduler.core.resources import NEURON  # noqa: E402
from neuron_scheduler.core.resources import NEURONCORE as CORE  # noqa: E402
from neuron_scheduler.sim.workloads import STANDARD  # noqa: E402
from tests.builders import neuron_capacity  # noqa: E402

# (instance type, devices, cores) as real nodes advertise them; node i has type i % len(TYPES).
TYPES = [
    (name, *neuron_capacity(name))
    for name in (
        "inf2.48xlarge",
        "trn1.32xlarge",
        "trn2.48xlarge",
        "inf1.24xlarge",
        "inf2.24xlarge",
    )
]
__all__ = [
    "CORE",
    "NEURON",
    "ROOT",
    "TYPES",
    "cpu_seconds",
    "cpu_ticks",
    "machine_line",
    "neuron_pod",
    "rss_mb",
    "standard_pods",
]


def standard_pods(pods: int | None) -> None:
    """The standard workloads (sim/workloads.py STANDARD) with `pods` pods a seed instead of the
    thousands they are committed with, for the rest of this process (None: as committed). The
    simulator benchmarks' `--pods`: the smallest size, for a smoke run (tests/bench)."""
    if pods is None:
        return
    if pods < 1:
        raise SystemExit("--pods must be positive")
    for name, workload in STANDARD.items():
        STANDARD[name] = replace(workload, pods=pods)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _schedstat_seconds(pid: int, column: int) -> float:
    """A column of schedstat (nanoseconds), summed over the process's threads; a thread that
    ended takes its share with it. NaN where the kernel keeps no schedstat (the tables then
    show nan, not 0)."""
    total, read = 0, 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += int((task / "schedstat").read_text().split()[column])
            read += 1
    return total / 1e9 if read else float("nan")


def thread_cpu_seconds(pid: int) -> float:
    """The CPU its threads have used so far, in nanoseconds' precision (not clock ticks)."""
    return _schedstat_seconds(pid, 0)


def run_delay_seconds(pid: int) -> float:
    """How long its threads have waited, runnable, for a CPU so far."""
    return _schedstat_seconds(pid, 1)


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) ticks of the whole machine so far, from /proc/stat. Steal is time the
    hypervisor gave this VM's vCPUs to someone else: the neighbours' share of a slow run."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def machine_line() -> str:
    """The machine a figure was measured on: CPUs, their model, the load before, Python."""
    model = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs ({model}), load average at start {load}, "
        f"Python {platform.python_version()}"
    )


def neuron_pod(name: str, namespace: str, scheduler: str, rng: random.Random) -> dict[str, Any]:
    """A pod of the throughput benchmarks, as created: 70% ask for 1, 2 or 4 cores, 30% for one
    device (the draws from `rng`, so a seed gives the same pods to every configuration)."""
    limits = {CORE: str(rng.choice([1, 2, 4]))} if rng.random() < 0.7 else {NEURON: "1"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "schedulerName": scheduler,
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"limits": limits},
                }
            ],
        },
    }
