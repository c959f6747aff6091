"""UltraServer node configs, label and sysfs names, runtime modes. Pure."""

from __future__ import annotations

from collections.abc import Iterable

ENV_NODE_CONFIG = "NEURON_ULTRASERVER_NODE_CONFIG"
NODE_CONFIGS = (4, 2, 1)
DEFAULT_NODE_CONFIG = 4
UNIT_SIZE = 4  # trn2u.48xlarge nodes in one UltraServer

LABEL_PREFIX = "neuron.amazonaws.com/ultraserver-"
MODE_LABEL = LABEL_PREFIX + "mode"  # e.g. "1_2_4"
INSTANCE_TYPE = "trn2u.48xlarge"

SYSFS_DIR = "/sys/class/neuron_device"
MODE_FILE = "ultraserver_mode"  # e.g. "1,2,4", or "busy"

DEFAULT_SERVER_ID = "0" * 16  # what the driver reports when busy, and upstream's default
DEFAULT_NODE_ID = -1

# Values of NEURON_RT_ULTRASERVER_MODE.
MODE_X4 = 1  # 4 nodes
MODE_X2H = 2  # 2 nodes, horizontal links
MODE_X2V = 3  # 2 nodes, vertical links
MODE_X1 = 4  # standalone

JOB_NAME_LABEL = "training.kubeflow.org/job-name"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"
WORKER_ROLE = "worker"
# Where the extender reads a worker pod's node config: this annotation, else a label of the same
# name, else DEFAULT_NODE_CONFIG.
NODE_CONFIG_KEY = "neuron.amazonaws.com/ultraserver-node-config"


class NodeConfigError(ValueError):
    """A bad node config or option value; the message says which values are valid."""


def parse_node_config(value: str | int | None, source: str = ENV_NODE_CONFIG) -> int:
    """4, 2 or 1; None or an empty string is the default (4)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return DEFAULT_NODE_CONFIG
    text = str(value).strip().strip('"')
    if text in ("4", "2", "1"):
        return int(text)
    raise NodeConfigError(
        f"{source}={value!r} is not a valid UltraServer node config; valid values are 4, 2 and 1"
    )


def server_id_label(config: int) -> str:
    return f"{LABEL_PREFIX}server-id-{config}"


def node_id_label(config: int) -> str:
    return f"{LABEL_PREFIX}node-id-{config}"


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
