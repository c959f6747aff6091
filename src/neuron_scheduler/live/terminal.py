"""What a person reads from `status` and `why`: rich renderables, built from the pure views.

Every string that came from the cluster (names, instance types, reasons) goes through `shown`:
control characters cannot reach the terminal and a long name cannot push everything else off
the screen. Nothing from the cluster is ever parsed as rich markup.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from collections.abc import Iterator

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from neuron_scheduler.core.ids import format_ids, mask_ids
from neuron_scheduler.core.planrecord import PlanKind
from neuron_scheduler.core.resources import NeuronRequest, Unit
from neuron_scheduler.live.consolidation import ConsolidationView
from neuron_scheduler.live.devicemap import (
    FAILED,
    FAILED_COLOUR,
    HELD,
    HELD_COLOUR,
    HELD_LABEL,
    USED,
    draw,
    pod_colours,
)
from neuron_scheduler.live.diagnosis import (
    Diagnosis,
    Freeing,
    NodeDiagnosis,
    Verdict,
    freeing_text,
)
from neuron_scheduler.live.fleet import Fleet, NodeView
from neuron_scheduler.live.gated import GatedPods
from neuron_scheduler.live.ultraservers import UltraServers

NAME_LIMIT = 120
REASON_LIMIT = 400
MAX_MAPS = 48  # node maps drawn in one status; more are listed (use --node for one)
MAX_PODS_LISTED = 64  # per node, in the legend
MAX_NODES_EXPLAINED = 25  # per why; the rest are counted by verdict


def shown(text: str, limit: int = NAME_LIMIT) -> str:
    """Text from the cluster, safe to print: no control or format characters, bounded."""
    clean = "".join("?" if unicodedata.category(c)[0] == "C" else c for c in text[: limit + 1])
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"


def _units(count: int, unit: Unit) -> str:
    return f"{count} {unit.value}{'s' if count != 1 else ''}"


def _request_text(request: NeuronRequest) -> str:
    return f"{_units(request.count, request.unit)} ({request.resource})"


# --- status ----------------------------------------------------------------------------------


def node_header(node: NodeView) -> Text:
    topology = node.topology
    text = Text.assemble(
        (shown(node.name), "bold"),
        "  ",
        shown(topology.instance_type),
        f"  {topology.kind.value}, {topology.devices} devices x {topology.cores_per_device} cores",
    )
    text.append(
        f"\n  free: {node.free_devices} of {topology.devices} devices (largest block "
        f"{node.largest_free_block}), {node.free_cores} of {topology.total_cores} cores"
    )
    if node.unattributed_cores:
        text.append(f"; {node.unattributed_cores} cores held with ids unknown")
        if node.withheld_cores:
            text.append(f" ({node.withheld_cores} not offered by the node)")
        if node.failed_cores_requested:
            text.append(
                f" ({node.failed_cores_requested} of failed devices that running pods still "
                "request: counted against the node until they end)"
            )
    if node.unhealthy_devices:
        failed = mask_ids(node.unhealthy_devices)
        text.append(
            f"\n  {FAILED} failed: device{'s' if len(failed) != 1 else ''} {format_ids(failed)}"
            f" (its device plugin reports {'it' if len(failed) == 1 else 'them'} unhealthy;"
            " never placed on)",
            FAILED_COLOUR,
        )
    return text


def node_block(node: NodeView) -> RenderableType:
    """A node's header, map and legend."""
    first_cores = {p.pod: p.cores[0] for p in node.pods if p.cores}
    if node.held_cores:
        first_cores[HELD_LABEL] = (node.held_cores & -node.held_cores).bit_length() - 1
    colours = pod_colours(first_cores)
    owners = {core: p.pod for p in node.pods for core in p.cores}
    parts: list[RenderableType] = [node_header(node)]
    parts.extend(
        Text("  ") + line
        for line in draw(node.topology, owners, colours, node.held_cores, node.unhealthy_devices)
    )
    for p in node.pods[:MAX_PODS_LISTED]:
        line = Text.assemble(
            "  ",
            (USED, colours.get(p.pod, "")),
            " ",
            shown(p.pod),
            f"  devices {format_ids(list(p.devices))}  cores {format_ids(list(p.cores))}",
        )
        if p.priority:
            line.append(f"  priority {p.priority}")
        if p.terminating:
            line.append("  terminating", "italic")
        if p.failed:
            line.append(f"  runs on failed device {format_ids(list(p.failed))}", FAILED_COLOUR)
        parts.append(line)
    if len(node.pods) > MAX_PODS_LISTED:
        parts.append(Text(f"  ... and {len(node.pods) - MAX_PODS_LISTED} more pods"))
    for u in node.unknown[:MAX_PODS_LISTED]:
        parts.append(
            Text.assemble(
                "  ? ",
                shown(u.pod),
                f"  {_units(u.count, u.unit)}, ids unknown (placed without neuron-scheduler, "
                "or annotations that could not be its own)",
            )
        )
    if node.held_cores:
        held = mask_ids(node.held_cores)
        line = Text.assemble("  ", (HELD, HELD_COLOUR), f" cores {format_ids(held)} held")
        for holders, why in (
            (node.nominated, "nominated here by preemption"),
            (node.planned, "by consolidation"),
        ):
            if holders:
                names = ", ".join(shown(n) for n in holders[:5])
                more = f" and {len(holders) - 5} more" if len(holders) > 5 else ""
                line.append(f" for {names}{more} ({why})")
        if not node.nominated and not node.planned:
            line.append(" for a bind in flight")
        parts.append(line)
    if node.warning:
        parts.append(Text.assemble("  ", ("warning:", "yellow"), " ", shown(node.warning)))
    return Group(*parts)


def fleet_summary(fleet: Fleet) -> RenderableType:
    devices = sum(n.topology.devices for n in fleet.nodes)
    free = sum(n.free_devices for n in fleet.nodes)
    cores = sum(n.topology.total_cores for n in fleet.nodes)
    free_cores = sum(n.free_cores for n in fleet.nodes)
    failed = sum(n.unhealthy_devices.bit_count() for n in fleet.nodes)
    on_failed = sum(1 for n in fleet.nodes for p in n.pods if p.failed)
    line = Text.assemble(
        ("Fleet: ", "bold"),
        f"{len(fleet.nodes)} Neuron nodes",
        f" ({len(fleet.unusable)} unusable)" if fleet.unusable else "",
        f", {fleet.other_nodes} without Neuron resources" if fleet.other_nodes else "",
        (f"; {failed} failed devices ({on_failed} pods run on one)", FAILED_COLOUR)
        if failed
        else "",
        f"; {free} of {devices} devices free, {free_cores} of {cores} cores; "
        f"fragmentation {100 * fleet.fragmentation:.1f}% (free devices outside their node's "
        "largest free block)",
    )
    table = Table(title="Nodes that could take one request now", title_justify="left")
    table.add_column("request")
    table.add_column("nodes now", justify="right")
    table.add_column("nodes allowing the size", justify="right")
    for c in fleet.capacity:
        table.add_row(Text(_request_text(c.request)), Text(str(c.now)), Text(str(c.allowed)))
    parts: list[RenderableType] = [line, table]
    if fleet.unusable:
        unusable = Table(title="Unusable nodes (left out of placement)", title_justify="left")
        unusable.add_column("node")
        unusable.add_column("reason")
        for name, problem in fleet.unusable:
            unusable.add_row(Text(shown(name)), Text(shown(problem.reason, REASON_LIMIT)))
        parts.append(unusable)
    return Group(*parts)


def consolidation_block(view: ConsolidationView) -> RenderableType:
    """Plans in flight and the eviction budget (docs/consolidation.md)."""
    head = Text.assemble(("Consolidation: ", "bold"), f"{len(view.plans)} plans in flight")
    if view.left is not None:
        head.append(f"; {view.left} of {view.per_hour} evictions left this hour")
    elif view.budget.problem:
        head.append(f"; eviction budget unknown: {shown(view.budget.problem, REASON_LIMIT)}")
    else:
        head.append("; no eviction spent yet (no budget Lease)")
    if view.budget.lease:
        head.append(f" (Lease {shown(view.budget.lease)})")
    parts: list[RenderableType] = [head]
    for plan in view.plans:
        if plan.kind is PlanKind.CAPACITY:
            parts.append(
                Text(
                    f"  {shown(plan.pod)}: {shown(plan.node)} devices "
                    f"{format_ids(list(plan.devices))} held (a node added at a capacity "
                    f"request); {plan.seconds_left:.0f}s left"
                )
            )
            continue
        moved = ", ".join(shown(m) for m in plan.moved[:5])
        more = f" and {len(plan.moved) - 5} more" if len(plan.moved) > 5 else ""
        parts.append(
            Text(
                f"  {shown(plan.pod)}: {shown(plan.node)} devices "
                f"{format_ids(list(plan.devices))} freed by moving {moved}{more}; "
                f"{plan.places_held} replacement places held; "
                f"{plan.seconds_left:.0f}s left"
            )
        )
    if view.requests:
        parts.append(
            Text.assemble(
                ("Capacity requests: ", "bold"),
                f"{len(view.requests)} placeholders waiting for a node (docs/autoscaling.md)",
            )
        )
    for request in view.requests:
        what = shown(request.instance_type) if request.instance_type else "an unreadable request"
        parts.append(
            Text(
                f"  {shown(request.pod) or '?'}: {what} (placeholder {shown(request.placeholder)}),"
                f" asked {request.seconds_asked:.0f}s ago, {request.seconds_left:.0f}s left"
            )
        )
    return Group(*parts)


def status_view(fleet: Fleet) -> Iterator[RenderableType]:
    for node in fleet.nodes[:MAX_MAPS]:
        yield node_block(node)
        yield Text()
    if len(fleet.nodes) > MAX_MAPS:
        rest = Table(title=f"{len(fleet.nodes) - MAX_MAPS} more nodes (maps: --node NAME)")
        for column in ("node", "instance type", "free devices", "largest block", "free cores"):
            rest.add_column(
                column, justify="left" if column in ("node", "instance type") else "right"
            )
        for node in fleet.nodes[MAX_MAPS:]:
            rest.add_row(
                Text(shown(node.name)),
                Text(shown(node.topology.instance_type)),
                Text(str(node.free_devices)),
                Text(str(node.largest_free_block)),
                Text(str(node.free_cores)),
            )
        yield rest
    yield fleet_summary(fleet)


def ultraserver_tables(view: UltraServers) -> Iterator[RenderableType]:
    """UltraServers, node by node (who claims it, whose members run there), and the claims."""
    if view.unread:
        yield Text(f"job claims not read: {shown(view.unread, REASON_LIMIT)}", "yellow")
    if view.units:
        units = Table(title="UltraServers")
        for column in ("UltraServer", "node", "claimed for", "members of"):
            units.add_column(column)
        for unit in view.units:
            for row in unit.nodes:
                units.add_row(
                    Text(shown(unit.server)),
                    Text(shown(row.node)),
                    Text(shown(row.claimed_by) or "-"),
                    Text(", ".join(shown(j) for j in row.members) or "-"),
                )
        yield units
    if view.claims:
        claims = Table(title="Training jobs' claims (kubectl get ultraserverclaims)")
        for column in ("job", "phase", "members bound", "units of", "nodes", "ends in"):
            claims.add_column(column, justify="right" if column == "ends in" else "left")
        for claim in view.claims:
            claims.add_row(
                Text(shown(claim.job)),
                Text(claim.phase),
                Text(f"{claim.bound} of {claim.size}"),
                Text(str(claim.config)),
                Text(shown(", ".join(claim.nodes), REASON_LIMIT)),
                Text("-" if claim.ends_in is None else f"{claim.ends_in:.0f}s"),
            )
        yield claims
    for claim in view.claims:
        if claim.progress:
            leaving = (
                f"; {claim.victims} pods evicted for it still leaving" if claim.victims else ""
            )
            yield Text(f"{shown(claim.progress, REASON_LIMIT)}{leaving}")
    for job, reason in view.waiting:
        yield Text(f"job {shown(job)} waits: {shown(reason, REASON_LIMIT)}")


def gated_lines(view: GatedPods) -> Iterator[RenderableType]:
    """Pending pods held back by scheduling gates, by Workload (Kueue's) or gates."""
    if not view.pods:
        return
    yield Text(
        f"{view.pods} pending Neuron pods held back by scheduling gates (nothing is reserved "
        "for them until the gates are removed):"
    )
    for group in view.groups:
        yield Text(f"  {shown(group.text, REASON_LIMIT)}")
        for line in group.workload.lines if group.workload else ():
            yield Text(f"    {shown(line, REASON_LIMIT)}")
    if view.more_groups:
        yield Text(f"  ... and {view.more_groups} more")


# --- why -------------------------------------------------------------------------------------


VERDICT_STYLES = {
    Verdict.FITS: "green",
    Verdict.UNIT_RULE: "magenta",
    Verdict.BLOCKED: "yellow",
    Verdict.NEVER: "red",
    Verdict.EXCLUDED: "grey50",
    Verdict.UNUSABLE: "red",
}


def _freeing_line(label: str, freeing: Freeing) -> Text:
    return Text(f"      {label}: {freeing_text(freeing, shown)}")


def node_diagnosis(node: NodeDiagnosis, priority: int) -> RenderableType:
    head = Text.assemble(
        "  ",
        (shown(node.node), "bold"),
        f" ({shown(node.instance_type)})" if node.instance_type else "",
        ": ",
        (node.verdict.value, VERDICT_STYLES[node.verdict]),
        " - ",
        shown(node.reason, REASON_LIMIT),
    )
    parts: list[RenderableType] = [head]
    if node.verdict is Verdict.BLOCKED:
        if node.blocking is None:
            parts.append(
                Text(
                    "      no set of pods frees a block: the devices in the way are held for "
                    "pods nominated by preemption, or for binds in flight"
                )
            )
        else:
            parts.append(_freeing_line("to fit", node.blocking))
            if node.preemption is None:
                parts.append(
                    Text(
                        f"      preemption (priority {priority}): no set of pods of lower "
                        "priority frees a block"
                    )
                )
            elif node.preemption.pods != node.blocking.pods:
                parts.append(_freeing_line(f"preemption (priority {priority})", node.preemption))
            else:
                parts.append(
                    Text(f"      preemption (priority {priority}) could evict exactly these")
                )
    return Group(*parts)


def why_view(diagnosis: Diagnosis) -> Iterator[RenderableType]:
    head = Text.assemble(("pod ", "bold"), (shown(diagnosis.pod), "bold"))
    if diagnosis.request is not None:
        head.append(f": {_request_text(diagnosis.request)}")
    head.append(f", priority {diagnosis.priority}, scheduler {shown(diagnosis.scheduler)}")
    if diagnosis.nominated_node:
        head.append(f", nominated to {shown(diagnosis.nominated_node)}")
    yield head
    if diagnosis.gating is not None:
        yield Text.assemble(
            ("Held back by ", "yellow"),
            shown(diagnosis.gating.text, REASON_LIMIT),
            ". kube-scheduler does not try to place it, and neuron-scheduler reserves nothing "
            "for it, until every gate is removed; below, what each node would answer then.",
        )
        if diagnosis.workload is not None:
            for line in diagnosis.workload.lines:
                yield Text(f"  {shown(line, 3 * REASON_LIMIT)}")  # (a message: 600)
    if diagnosis.request_error is not None:
        yield Text.assemble(
            ("no node can take it: ", "red"), shown(diagnosis.request_error, REASON_LIMIT)
        )
        return
    counts = Text(
        ", ".join(f"{diagnosis.count(v)} {v.value}" for v in Verdict)
        + f" (of {len(diagnosis.nodes)} Neuron nodes)"
    )
    if diagnosis.other_nodes:
        counts.append(f"; {diagnosis.other_nodes} nodes without Neuron resources")
    yield counts
    if not diagnosis.nodes:
        yield Text("no node advertises Neuron resources")
        return
    if diagnosis.stranded:
        count = len(diagnosis.stranded)
        yield Text.assemble(
            ("Stranded by fragmentation: ", "yellow"),
            f"{count} node{'s' if count != 1 else ''} have its count free but no allowed block "
            "(kube-scheduler's preemption does not act on such nodes; consolidation may: "
            "docs/consolidation.md)",
        )
    if diagnosis.job:
        yield Text(f"  training job: {shown(diagnosis.job, REASON_LIMIT)}")
    if diagnosis.consolidation:
        yield Text(f"  consolidation: {shown(diagnosis.consolidation, REASON_LIMIT)}")
    if diagnosis.capacity:
        yield Text(f"  capacity: {shown(diagnosis.capacity, REASON_LIMIT)}")
    for node in diagnosis.nodes[:MAX_NODES_EXPLAINED]:
        yield node_diagnosis(node, diagnosis.priority)
    rest = diagnosis.nodes[MAX_NODES_EXPLAINED:]
    if rest:
        by_verdict = Counter(n.verdict.value for n in rest)
        yield Text(
            f"  ... and {len(rest)} more nodes: "
            + ", ".join(f"{count} {verdict}" for verdict, count in by_verdict.items())
            + " (--json lists every one)"
        )
    if diagnosis.gating is not None:
        if diagnosis.count(Verdict.FITS) or diagnosis.count(Verdict.UNIT_RULE):
            yield Text("Its devices are free now: it waits for its scheduling gates.")
    elif diagnosis.count(Verdict.FITS):
        yield Text(
            "Its Neuron request fits now: it is pending for something else (CPU, memory, "
            "ports, taints checked by kube-scheduler, or its next scheduling attempt); "
            "see `kubectl describe pod`."
        )
