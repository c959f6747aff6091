"""Validate the workers of one MPI job and give each its UltraServer topology id. Pure.

Order and checks follow the upstream init script: workers sorted by (server id, node id, FQDN);
the index is NEURON_GLOBAL_TOPOID. For configs 2 and 4 every server id must be set (not the
all-zero default), shared by exactly `config` workers, with unique node ids.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

from neuron_scheduler.jobs.units import DEFAULT_SERVER_ID, node_id_label, server_id_label
from neuron_scheduler.ultraserver.labels import (
    DEFAULT_NODE_ID,
    MODE_X1,
    MODE_X2H,
    MODE_X2V,
    MODE_X4,
    normalize_server_id,
    parse_modes,
    runtime_mode,
)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What one worker reports (sysfs over ssh) or what its node's labels say."""

    worker: str  # the host name in the MPI hostfile
    fqdn: str
    node: str | None  # the Kubernetes node, when the source knows it
    modes: frozenset[int] | None  # supported runtime modes; None: not an UltraServer node
    server_id: str = DEFAULT_SERVER_ID
    node_id: int = DEFAULT_NODE_ID
    problem: str | None = None  # the source could not read this worker at all


@dataclass(frozen=True, slots=True)
class FactNames:
    """How a source names its facts in a worker's problem text (sysfs paths, or node labels)."""

    no_modes: str  # the whole problem when the supported-modes fact is missing
    modes: str  # e.g. "<dir>/ultraserver_mode says" or "<label> is"
    node_id: str  # e.g. "<dir>/node_id_4" or "<label>"


def read_worker(
    worker: str,
    fqdn: str,
    node: str | None,
    facts: dict[str, str],
    keys: tuple[str, str, str],
    names: FactNames,
) -> WorkerInfo:
    """A worker's facts from one source: `keys` name its supported modes, server id and node id
    in `facts` (sysfs file names, or node labels)."""
    modes_key, server_id_key, node_id_key = keys
    mode_text = facts.get(modes_key)
    modes = parse_modes(mode_text) if mode_text is not None else None
    problem = None
    if mode_text is None:
        problem = names.no_modes
    elif modes is None:
        problem = f"{names.modes} {mode_text!r}: the UltraServer is not available"
    node_id = DEFAULT_NODE_ID
    raw = facts.get(node_id_key)
    if raw is not None:
        try:
            node_id = int(raw)
        except ValueError:
            problem = problem or f"{names.node_id} is {raw!r}, not a number"
    return WorkerInfo(
        worker=worker,
        fqdn=fqdn,
        node=node,
        modes=modes,
        server_id=normalize_server_id(facts.get(server_id_key, "")),
        node_id=node_id,
        problem=problem,
    )


@dataclass(frozen=True, slots=True)
class Placed:
    """One worker's place in the job: its topology id and the values the runtime needs."""

    topo_id: int
    info: WorkerInfo
    mode: int

    def environment(self, leader_fqdn: str) -> dict[str, str]:
        return {
            "NEURON_GLOBAL_TOPOID": str(self.topo_id),
            "NEURON_GLOBAL_TOPOID0_HOST": leader_fqdn,
            "NEURON_RT_ULTRASERVER_MODE": str(self.mode),
            "NEURON_RT_ULTRASERVER_SERVER_ID": self.info.server_id,
            "NEURON_RT_ULTRASERVER_NODE_ID": str(self.info.node_id),
        }


class UnitError(ValueError):
    """The workers cannot run with this config; one line per problem, each naming the worker,
    its node and the reason."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


def who(info: WorkerInfo) -> str:
    return f"worker {info.worker} (node {info.node or 'unknown'})"


MODES_NEEDED = {4: (MODE_X4,), 2: (MODE_X2V, MODE_X2H), 1: (MODE_X1,)}


def order(workers: list[WorkerInfo], config: int) -> list[Placed]:
    """Validate and sort; UnitError lists every problem found."""
    problems = [f"{who(w)}: {w.problem}" for w in workers if w.problem]
    if problems:
        raise UnitError(problems)
    if not workers:
        raise UnitError(["the hostfile lists no workers"])
    if len(workers) % config:
        raise UnitError(
            [
                f"{len(workers)} workers do not split into UltraServer units of {config} "
                f"(NEURON_ULTRASERVER_NODE_CONFIG={config} needs a multiple of {config} workers)"
            ]
        )
    for w in workers:
        if w.modes is None:
            problems.append(f"{who(w)}: not an UltraServer node (no supported modes reported)")
        elif not set(MODES_NEEDED[config]) & w.modes:
            modes = ",".join(map(str, sorted(w.modes))) or "none"
            problems.append(
                f"{who(w)}: supports UltraServer modes {modes}, config {config} needs mode "
                + " or ".join(map(str, MODES_NEEDED[config]))
            )
    if config > 1:
        problems += _unit_problems(workers, config)
    if problems:
        raise UnitError(problems)
    ranked = sorted(workers, key=lambda w: (w.server_id, w.node_id, w.fqdn))
    return [Placed(i, w, runtime_mode(config, w.modes or ())) for i, w in enumerate(ranked)]


def _unit_problems(workers: list[WorkerInfo], config: int) -> list[str]:
    key = server_id_label(config)
    problems: list[str] = []
    unset = [w for w in workers if w.server_id == DEFAULT_SERVER_ID]
    for w in unset:
        problems.append(
            f"{who(w)}: {key} is unset ({DEFAULT_SERVER_ID}): not an UltraServer node, or its "
            "UltraServer is busy"
        )
    counts = Counter(w.server_id for w in workers if w.server_id != DEFAULT_SERVER_ID)
    ranked = counts.most_common(2)
    majority = None  # one unit's worth of workers where most agree: name only the odd ones
    if len(workers) == config and ranked and (len(ranked) == 1 or ranked[0][1] > ranked[1][1]):
        majority = ranked[0]
    for w in workers:
        if w.server_id == DEFAULT_SERVER_ID:
            continue
        count = counts[w.server_id]
        if count == config:
            continue
        if majority is not None:
            common, common_count = majority
            if w.server_id != common:
                problems.append(
                    f"{who(w)}: {key} {w.server_id} differs from the other {common_count} "
                    f"workers ({common}); config {config} needs all {config} in one UltraServer"
                )
            continue
        problems.append(
            f"{who(w)}: {key} {w.server_id} is shared by {count} of the {len(workers)} workers; "
            f"config {config} needs exactly {config} workers per UltraServer"
        )
    by_unit: defaultdict[tuple[str, int], list[WorkerInfo]] = defaultdict(list)
    for w in workers:
        if w.server_id != DEFAULT_SERVER_ID:
            by_unit[(w.server_id, w.node_id)].append(w)
    for (server_id, node_id), same in by_unit.items():
        if node_id < 0 or node_id >= config:
            for w in same:
                problems.append(
                    f"{who(w)}: {node_id_label(config)} is {node_id}; config {config} needs "
                    f"0..{config - 1}"
                )
        elif len(same) > 1:
            names = ", ".join(w.worker for w in same)
            for w in same:
                problems.append(
                    f"{who(w)}: {node_id_label(config)} {node_id} in UltraServer {server_id} "
                    f"is reported by {len(same)} workers ({names})"
                )
    return problems


def summary(placed: list[Placed], config: int) -> list[str]:
    """The log lines: `Using 4-node config`, a header, then one line per worker."""
    rows = [("TOPOID", "WORKER", "FQDN", "NODE", "SERVER_ID", "NODE_ID", "MODE")]
    for p in placed:
        rows.append(
            (
                str(p.topo_id),
                p.info.worker,
                p.info.fqdn,
                p.info.node or "-",
                p.info.server_id,
                str(p.info.node_id),
                str(p.mode),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"Using {config}-node config"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return lines
