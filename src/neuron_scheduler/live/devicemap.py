"""A node's devices as lines of coloured text: a ring drawn as a ring (a loop of two rows), a chain
as the same loop left open, a torus as its grid with wrap-around stubs at every edge, a switch as
rows on one bus. Each device shows its id and one mark per core: the colour of the pod holding
it, a hatch for a block held for a nominated pod, a hollow square when free. Pure (rich's Text
is only a value here; printing is the caller's).

Colours follow the simulator's pictures (matplotlib's tab20, pods in order of their first core),
so a node's map in the terminal and in `--report` agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rich.text import Text

from neuron_scheduler.core.topology import Topology, TopologyKind

TAB20 = (
    "#1f77b4",
    "#aec7e8",
    "#ff7f0e",
    "#ffbb78",
    "#2ca02c",
    "#98df8a",
    "#d62728",
    "#ff9896",
    "#9467bd",
    "#c5b0d5",
    "#8c564b",
    "#c49c94",
    "#e377c2",
    "#f7b6d2",
    "#7f7f7f",
    "#c7c7c7",
    "#bcbd22",
    "#dbdb8d",
    "#17becf",
    "#9edae5",
)
HELD_COLOUR = "grey50"
HELD_LABEL = "(held for a nominated pod)"  # the held block's name in the pictures' legend
HELD = "▨"
FREE = "□"
USED = "■"
FAILED = "✗"  # a core of a failed device, in its pod's colour if a pod still holds it
FAILED_COLOUR = "red"
LINK_STYLE = "grey50"
GAP = 3  # columns between two cells: the link
SWITCH_COLUMNS = 8


@dataclass(frozen=True, slots=True)
class Layout:
    cells: dict[int, tuple[int, int]]  # device -> (row, column)
    links: tuple[tuple[int, int], ...]  # direct links drawn between devices
    wraps: bool  # a torus: every row and column continues on the other side
    bus: bool  # a switch: every device on one bus

    @property
    def rows(self) -> int:
        return max(r for r, _ in self.cells.values()) + 1

    @property
    def columns(self) -> int:
        return max(c for _, c in self.cells.values()) + 1


def layout(topology: Topology) -> Layout:
    n = topology.devices
    kind = topology.kind
    if kind is TopologyKind.TORUS:
        side = max(math.isqrt(n), 1)
        cells = {d: divmod(d, side) for d in range(n)}
        links = [(d, d + 1) for d in range(n - 1) if (d + 1) % side]
        links += [(d, d + side) for d in range(n - side)]
        return Layout(cells, tuple(links), wraps=True, bus=False)
    if kind is TopologyKind.SWITCH:
        cells = {d: divmod(d, SWITCH_COLUMNS) for d in range(n)}
        return Layout(cells, (), wraps=False, bus=True)
    if n <= 2:
        return Layout({d: (0, d) for d in range(n)}, ((0, 1),) if n == 2 else (), False, False)
    # Rings and chains: a loop of two rows, 0 .. top-1 left to right, then back along the bottom.
    top = (n + 1) // 2
    cells = {d: (0, d) for d in range(top)}
    cells |= {top + j: (1, top - 1 - j) for j in range(n - top)}
    links = [(d, d + 1) for d in range(n - 1)]
    if kind is TopologyKind.RING:
        links.append((n - 1, 0))
    return Layout(cells, tuple(links), wraps=False, bus=False)


def pod_colours(first_cores: Mapping[str, int]) -> dict[str, str]:
    """A colour per pod (and per held block, HELD_LABEL), in the simulator's order: by first
    core. The picture colours a held block like a pod; the map draws it hatched instead."""
    ordered = sorted(first_cores, key=lambda pod: (first_cores[pod], pod))
    return {pod: TAB20[i % len(TAB20)] for i, pod in enumerate(ordered)}


class _Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.cells = [[(" ", "")] * width for _ in range(height)]

    def put(self, x: int, y: int, text: str, style: str = "") -> None:
        row = self.cells[y]
        for i, char in enumerate(text):
            if 0 <= x + i < len(row):
                row[x + i] = (char, style)

    def lines(self) -> list[Text]:
        lines = []
        for row in self.cells:
            line = Text()
            for char, style in row:
                line.append(char, style)
            line.rstrip()
            lines.append(line)
        return lines


def draw(
    topology: Topology,
    owners: Mapping[int, str],
    colours: Mapping[str, str],
    held: int = 0,
    failed: int = 0,
) -> list[Text]:
    """The node's map. `owners`: core id -> pod; `held`: mask of cores in use by no pod shown
    (blocks held for nominated pods); `failed`: mask of the devices its plugin reports failed."""
    shape = layout(topology)
    per_device = topology.cores_per_device
    label = len(str(topology.devices - 1))
    width = label + 1 + per_device
    margin_x = 2 if shape.wraps else 0
    margin_y = 1 if shape.wraps else 0

    def x(column: int) -> int:
        return margin_x + column * (width + GAP)

    def y(row: int) -> int:
        return margin_y + row * 2

    total_width = x(shape.columns - 1) + width + margin_x
    height = y(shape.rows - 1) + 1 + margin_y + (1 if shape.bus else 0)
    canvas = _Canvas(total_width, height)
    for a, b in shape.links:
        _link(canvas, shape.cells[a], shape.cells[b], x, y, width)
    if shape.wraps:
        for row in range(shape.rows):
            canvas.put(0, y(row), "╌╌", LINK_STYLE)
            canvas.put(x(shape.columns - 1) + width, y(row), "╌╌", LINK_STYLE)
        for column in range(shape.columns):
            canvas.put(x(column) + width // 2, 0, "╎", LINK_STYLE)
            canvas.put(x(column) + width // 2, height - 1, "╎", LINK_STYLE)
    if shape.bus:
        canvas.put(0, height - 1, "═" * total_width, LINK_STYLE)
    for device, (row, column) in shape.cells.items():
        cores = range(device * per_device, (device + 1) * per_device)
        busy = any(c in owners or held >> c & 1 for c in cores)
        canvas.put(x(column), y(row), f"{device:>{label}} ", "bold" if busy else "")
        for i, core in enumerate(cores):
            pod = owners.get(core)
            if failed >> device & 1:
                mark, style = FAILED, colours.get(pod, "") if pod is not None else FAILED_COLOUR
            elif pod is not None:
                mark, style = USED, colours.get(pod, "")
            elif held >> core & 1:
                mark, style = HELD, HELD_COLOUR
            else:
                mark, style = FREE, "grey50"
            canvas.put(x(column) + label + 1 + i, y(row), mark, style)
    return canvas.lines()


def _link(
    canvas: _Canvas,
    a: tuple[int, int],
    b: tuple[int, int],
    x: Callable[[int], int],
    y: Callable[[int], int],
    width: int,
) -> None:
    """A straight line between neighbours in a row or a column; otherwise down from the upper
    cell and across to the lower one (a ring with an odd number of devices closes that way)."""
    (row_a, column_a), (row_b, column_b) = sorted([a, b])
    if row_a == row_b:
        left, right = sorted([column_a, column_b])
        start = x(left) + width
        canvas.put(start, y(row_a), "─" * (x(right) - start), LINK_STYLE)
        return
    middle = x(column_a) + width // 2
    for line in range(y(row_a) + 1, y(row_b)):
        canvas.put(middle, line, "│", LINK_STYLE)
    if column_a == column_b:
        return
    if column_b > column_a:
        canvas.put(middle, y(row_b), "╰" + "─" * (x(column_b) - middle - 1), LINK_STYLE)
    else:
        end = x(column_b) + width
        canvas.put(end, y(row_b), "─" * (middle - end) + "╯", LINK_STYLE)
