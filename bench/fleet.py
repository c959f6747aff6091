"""What the extender and throughput benchmarks share: the node types of their fake fleet."""

from __future__ import annotations

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
