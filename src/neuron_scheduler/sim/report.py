"""Pictures and a JSON summary of a simulation: what a person looks at to trust the placements."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Circle, Wedge

from neuron_scheduler.core.topology import TopologyKind
from neuron_scheduler.sim.simulation import SimNode, SimResult

# Enough for the built-in fleet; bigger fleets get the first ones and a line saying so.
MAX_NODE_PICTURES = 48
FREE = "#eeeeee"
PALETTE: list[Any] = list(plt.get_cmap("tab20")(range(20)))


def device_positions(node: SimNode) -> list[tuple[float, float]]:
    n = node.topology.devices
    kind = node.topology.kind
    if kind is TopologyKind.TORUS:
        side = math.isqrt(n)
        return [(float(d % side), float(-(d // side))) for d in range(n)]
    if kind in (TopologyKind.RING, TopologyKind.CHAIN) and n > 2:
        radius = n / (2 * math.pi) * 1.3
        # Device 0 at the top, clockwise, so a chain reads like a clock face with a gap at 12.
        return [
            (radius * math.sin(2 * math.pi * d / n), radius * math.cos(2 * math.pi * d / n))
            for d in range(n)
        ]
    return [(float(d), 0.0) for d in range(n)]


def _links(node: SimNode) -> list[tuple[int, int, bool]]:
    """(a, b, wraps) for every direct link drawn between devices."""
    n = node.topology.devices
    kind = node.topology.kind
    if kind is TopologyKind.TORUS:
        side = math.isqrt(n)
        links = []
        for d in range(n):
            row, col = divmod(d, side)
            links.append((d, row * side + (col + 1) % side, col == side - 1))
            links.append((d, ((row + 1) % side) * side + col, row == side - 1))
        return links
    if kind is TopologyKind.CHAIN:
        return [(d, d + 1, False) for d in range(n - 1)]
    if kind is TopologyKind.RING:
        return [(d, (d + 1) % n, False) for d in range(n)]
    return []


def draw_node(ax: Axes, node: SimNode) -> None:
    topology = node.topology
    positions = device_positions(node)
    owner: dict[int, str] = {}
    for pod, placement in node.pods.items():
        for core in placement.cores:
            owner[core] = pod
    colors = {
        pod: PALETTE[i % len(PALETTE)]
        for i, pod in enumerate(sorted(node.pods, key=lambda p: node.pods[p].cores[0]))
    }
    for a, b, wraps in _links(node):
        (xa, ya), (xb, yb) = positions[a], positions[b]
        if wraps:
            # A wrap-around link leaves the grid on one side and comes back on the other: draw
            # both ends as dashed stubs rather than a line across the whole grid.
            dx, dy = (0.75, 0.0) if ya == yb else (0.0, -0.75)
            for x, y, sign in ((xa, ya, 1), (xb, yb, -1)):
                ax.plot(
                    [x, x + sign * dx], [y, y + sign * dy], color="#999999", lw=1, ls="--", zorder=1
                )
        else:
            ax.plot([xa, xb], [ya, yb], color="#777777", lw=1.2, zorder=1)
    if topology.kind is TopologyKind.SWITCH:
        ax.plot([p[0] for p in positions], [-0.8] * len(positions), color="#777777", lw=3)
    per_device = topology.cores_per_device
    for d, (x, y) in enumerate(positions):
        for i in range(per_device):
            core = d * per_device + i
            pod = owner.get(core, "")
            start = 90 - 360 * (i + 1) / per_device
            ax.add_patch(
                Wedge(
                    (x, y),
                    0.38,
                    start,
                    start + 360 / per_device,
                    facecolor=colors[pod] if pod else FREE,
                    edgecolor="white",
                    lw=0.6,
                    zorder=2,
                )
            )
        ax.add_patch(Circle((x, y), 0.38, fill=False, edgecolor="#444444", lw=1, zorder=3))
        ax.text(x, y, str(d), ha="center", va="center", fontsize=7, zorder=4)
    xs = [p[0] for p in positions]
    ys = [p[1] for p in positions]
    ax.set_xlim(min(xs) - 1.2, max(xs) + 1.2)
    ax.set_ylim(min(ys) - 1.2, max(ys) + 1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    used = sum(1 for _ in owner)
    ax.set_title(
        f"{node.name}\n{topology.kind.value} · {used}/{topology.total_cores} cores · "
        f"{len(node.pods)} pods",
        fontsize=7,
    )


def write_device_maps(
    nodes: Sequence[SimNode],
    nodes_dir: Path,
    overview: Path,
    title: str,
    file_name: Callable[[str], str] = str,
) -> list[Path]:
    """One picture per node in `nodes_dir` (named by `file_name` of the node's name) and all of
    them in `overview`; shared with `status --report`, which draws the live fleet."""
    nodes_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for node in nodes:
        fig, ax = plt.subplots(figsize=(3.2, 3.4))
        draw_node(ax, node)
        path = nodes_dir / f"{file_name(node.name)}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append(path)
    if not nodes:
        return written
    columns = min(5, len(nodes))
    rows = math.ceil(len(nodes) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(3.0 * columns, 3.2 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, node in zip(axes.flat, nodes, strict=False):
        draw_node(ax, node)
    fig.suptitle(title, fontsize=11)
    fig.savefig(overview, dpi=100, bbox_inches="tight")
    plt.close(fig)
    written.append(overview)
    return written


def write_report(result: SimResult, directory: Path, label: str = "") -> list[Path]:
    """PNG device maps (one per node and an overview), a utilization plot and summary.json."""
    directory.mkdir(parents=True, exist_ok=True)
    prefix = f"{label}-" if label else ""
    written: list[Path] = []
    written += write_device_maps(
        result.nodes[:MAX_NODE_PICTURES],
        directory / f"{prefix}nodes",
        directory / f"{prefix}device-maps.png",
        f"Device maps at the end of the run ({result.policy.value}); colour = pod",
    )

    fig, ax = plt.subplots(figsize=(8, 3.5))
    times = [s.time for s in result.samples]
    ax.plot(times, [100 * s.device_utilization for s in result.samples], label="devices in use %")
    ax.plot(times, [100 * s.core_utilization for s in result.samples], label="cores in use %")
    ax.set_ylim(0, 105)
    ax.set_xlabel("time")
    ax.set_ylabel("% of fleet")
    pending = ax.twinx()
    pending.plot(
        times, [s.pending for s in result.samples], color="tab:red", lw=0.8, label="pending pods"
    )
    pending.set_ylabel("pending pods")
    lines = ax.get_legend_handles_labels()
    more = pending.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    ax.set_title(f"Utilization over time ({result.policy.value})")
    path = directory / f"{prefix}utilization.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    written.append(path)

    path = directory / f"{prefix}summary.json"
    path.write_text(json.dumps(summary(result), indent=2) + "\n")
    written.append(path)
    return written


def summary(result: SimResult) -> dict[str, Any]:
    return {
        "label": result.label,
        "policy": result.policy.value,
        "profile": result.profile,
        "nodes": len(result.nodes),
        "arrivals": result.arrivals,
        "placed": result.placed,
        "departed": result.departed,
        "pending_at_end": len(result.pending),
        "never_placed": result.never_placed,
        "device_utilization_at_end": round(result.device_utilization, 4),
        "core_utilization_at_end": round(result.core_utilization, 4),
        "mean_device_utilization": round(result.mean_device_utilization, 4),
        "fragmentation_at_end": round(result.fragmentation, 4),
        "utilization_at_first_fragmentation": (
            None
            if result.utilization_at_first_fragmentation is None
            else round(result.utilization_at_first_fragmentation, 4)
        ),
        "fragmentation_refusals": result.fragmentation_refusals,
        "large_pods_placed": len(result.large_waits),
        "large_pods_waiting_at_end": len(result.large_pending_waits),
        "large_wait_mean": round(result.large_wait_mean(), 3),
        "large_wait_p95": round(result.large_wait_p95(), 3),
        "preemption": result.preemption.value,
        "placed_by_preemption": result.preempted,
        "evictions": result.evictions,
        "evictions_for_nothing": result.evictions_for_nothing,
        "pending_reasons": dict(result.pending_reasons().most_common(10)),
        "pictures_capped_at": MAX_NODE_PICTURES if len(result.nodes) > MAX_NODE_PICTURES else None,
    }
