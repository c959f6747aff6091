"""UltraServer sysfs names and runtime modes, for the MPI launcher's init step and the worker
affinity. Pure. (The labels a node's unit is read from live with the training jobs:
jobs/units.py.)"""

from __future__ import annotations

from collections.abc import Iterable

from neuron_scheduler.jobs.units import DEFAULT_SERVER_ID, server_id_label

INSTANCE_TYPE = "trn2u.48xlarge"

SYSFS_DIR = "/sys/class/neuron_device"
MODE_FILE = "ultraserver_mode"  # e.g. "1,2,4", or "busy"

DEFAULT_NODE_ID = -1

# Values of NEURON_RT_ULTRASERVER_MODE.
MODE_X4 = 1  # 4 nodes
MODE_X2H = 2  # 2 nodes, horizontal links
MODE_X2V = 3  # 2 nodes, vertical links
MODE_X1 = 4  # standalone


def server_id_file(config: int) -> str:
    return f"server_id_{config}"


def node_id_file(config: int) -> str:
    return f"node_id_{config}"


def topology_key(config: int) -> str:
    """The node label grouping one unit of `config` nodes (config 1: the node itself)."""
    return server_id_label(config) if config > 1 else "kubernetes.io/hostname"


def parse_modes(text: str) -> frozenset[int] | None:
    """Supported runtime modes from sysfs ("1,2,4") or the label ("1_2_4"); None when the
    value is not a list of modes (e.g. "busy")."""
    parts = [p for p in text.strip().replace("_", ",").replace(" ", ",").split(",") if p]
    if not parts or not all(p.isdigit() for p in parts):
        return None
    return frozenset(int(p) for p in parts)


def runtime_mode(config: int, supported: Iterable[int]) -> int:
    """NEURON_RT_ULTRASERVER_MODE for a node config: 4 -> X4, 2 -> X2V if supported else X2H,
    1 -> X1."""
    if config == 4:
        return MODE_X4
    if config == 2:
        return MODE_X2V if MODE_X2V in set(supported) else MODE_X2H
    return MODE_X1


def normalize_server_id(text: str) -> str:
    """A server id as read (sysfs prints %016llx; labels hold 16 characters); empty is the
    all-zero default."""
    value = text.strip().lower()
    return value or DEFAULT_SERVER_ID
