"""What the extender and throughput benchmarks share: the node types of their fake fleet."""

from __future__ import annotations

import os
from pathlib import Path

# (instance type, devices, cores) as real nodes advertise them; node i has type i % len(TYPES).
TYPES = [
    ("inf2.48xlarge", 12, 24),
    ("trn1.32xlarge", 16, 32),
    ("trn2.48xlarge", 16, 64),
    ("inf1.24xlarge", 16, 64),
    ("inf2.24xlarge", 6, 12),
]
CORE = "aws.amazon.com/neuroncore"
NEURON = "aws.amazon.com/neuron"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> tuple[int, int]:
    """(steal, total) ticks of the whole machine so far, from /proc/stat. Steal is time the
    hypervisor gave this VM's vCPUs to someone else: the neighbours' share of a slow run."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])
