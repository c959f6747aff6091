"""Our device plugin as its CLI command over a fake /dev and /sys tree, for a node in the testbed
(a real kubelet from tests/testbed/kubelet.py, or the kubelet-side peer)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from .process import ManagedProcess


def fake_tree(root: Path, devices: int, cores: int) -> tuple[Path, Path]:
    """/dev/neuronN and /sys/class/neuron_device/neuronN/core_count under root; (dev, sys)."""
    dev, sys_root = root / "dev", root / "sys"
    dev.mkdir(parents=True)
    for d in range(devices):
        (dev / f"neuron{d}").touch()
        entry = sys_root / "class/neuron_device" / f"neuron{d}"
        entry.mkdir(parents=True)
        (entry / "core_count").write_text(f"{cores}\n")
    return dev, sys_root


def device_plugin(
    node: str,
    plugin_dir: Path,
    tree: Path,
    kubeconfig: Path,
    log: Path,
    *,
    devices: int,
    cores: int,
    extra_args: Sequence[str] = (),
) -> ManagedProcess:
    """The `device-plugin` command for `node` (not started), with a fresh fake tree under
    `tree`."""
    dev, sys_root = fake_tree(tree, devices, cores)
    return ManagedProcess(
        "device-plugin",
        [
            *(sys.executable, "-m", "neuron_scheduler", "device-plugin"),
            *("--node-name", node, "--plugin-dir", str(plugin_dir)),
            *("--dev-root", str(dev), "--sys-root", str(sys_root)),
            *("--kubeconfig", str(kubeconfig)),
            *("--logical-nc-config", str(tree / "no-lnc-file")),
            *("--log-level", "debug"),
            *extra_args,
        ],
        log,
    )
