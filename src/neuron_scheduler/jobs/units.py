"""How a node's unit is read: the UltraServer labels, and a member's node config. Pure.

A training job's members are placed in whole units (jobs/placement.py). On nodes that carry the
UltraServer labels (`neuron.amazonaws.com/ultraserver-mode`) a unit is the set of nodes sharing
`neuron.amazonaws.com/ultraserver-server-id-<config>` for the job's node config (4, 2 or 1 nodes);
any other Neuron node is a unit of its own.
"""

from __future__ import annotations

from neuron_scheduler.kube.objects import Pod

ENV_NODE_CONFIG = "NEURON_ULTRASERVER_NODE_CONFIG"
NODE_CONFIGS = (4, 2, 1)
DEFAULT_NODE_CONFIG = 4
UNIT_SIZE = 4  # trn2u.48xlarge nodes in one UltraServer

LABEL_PREFIX = "neuron.amazonaws.com/ultraserver-"
MODE_LABEL = LABEL_PREFIX + "mode"  # e.g. "1_2_4": the node is an UltraServer node
DEFAULT_SERVER_ID = "0" * 16  # what the driver reports when busy, and upstream's default
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


def pod_node_config(pod: Pod) -> int:
    """The member's node config; NodeConfigError names the annotation or label when it is bad."""
    annotations, labels = pod.metadata.annotations, pod.metadata.labels
    if NODE_CONFIG_KEY in annotations:
        return parse_node_config(annotations[NODE_CONFIG_KEY], f"annotation {NODE_CONFIG_KEY}")
    if NODE_CONFIG_KEY in labels:
        return parse_node_config(labels[NODE_CONFIG_KEY], f"label {NODE_CONFIG_KEY}")
    return DEFAULT_NODE_CONFIG
