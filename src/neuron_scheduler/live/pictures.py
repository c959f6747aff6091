"""`status --report DIR`: the live fleet drawn as `simulate --report` draws a simulated one (the
simulator's `draw_node`: rings as rings, tori as 4x4 grids with wrap links, one colour per pod),
one picture per node and an overview, and `status.json` beside them.

Importing this module imports matplotlib (the `sim` extra); the command imports it only for
`--report` and turns an ImportError into one line saying what to install.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.core.ids import devices_of_cores, mask_ids
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.live.devicemap import HELD_LABEL
from neuron_scheduler.live.fleet import Fleet, NodeView, fleet_json
from neuron_scheduler.sim.report import MAX_NODE_PICTURES, write_device_maps

if TYPE_CHECKING:
    from neuron_scheduler.sim.simulation import SimNode


@dataclass(slots=True)
class DrawnNode:
    """What `draw_node` reads of a simulated node: its name, topology and pods' placements."""

    name: str
    topology: Topology
    pods: dict[str, Placement] = field(default_factory=dict)


def drawn(node: NodeView) -> DrawnNode:
    # draw_node orders pods by their first core: a pod without ids has no place in the picture.
    pods = {p.pod: Placement(p.devices, p.cores, 0) for p in node.pods if p.cores}
    if node.held_cores:
        cores = tuple(mask_ids(node.held_cores))
        devices = devices_of_cores(cores, node.topology.cores_per_device)
        pods[HELD_LABEL] = Placement(devices, cores, 0)
    return DrawnNode(node.name, node.topology, pods)


def file_name(node: str) -> str:
    """A node's name as a file name: names from the cluster never leave the directory."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", node)[:200].lstrip(".") or "_"


def write_pictures(fleet: Fleet, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    # draw_node reads only name, topology and pods of a SimNode (duck-typed here: the live view
    # has no simulation state to give it).
    nodes = [cast("SimNode", drawn(n)) for n in fleet.nodes[:MAX_NODE_PICTURES]]
    written = write_device_maps(
        nodes,
        directory / "nodes",
        directory / "device-maps.png",
        "Device maps of the live cluster; colour = pod",
        file_name,
    )
    path = directory / "status.json"
    summary = fleet_json(fleet)
    summary["pictures_capped_at"] = (
        MAX_NODE_PICTURES if len(fleet.nodes) > MAX_NODE_PICTURES else None
    )
    path.write_text(json.dumps(summary, indent=2) + "\n")
    written.append(path)
    return written
