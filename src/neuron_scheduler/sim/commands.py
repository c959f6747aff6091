"""The `explain` and `simulate` commands: the placement code on one node or an in-memory fleet.
`register(app)` adds them to a typer app (the project CLI does)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from neuron_scheduler.commandline import UsageError, err, fail, out, user_errors
from neuron_scheduler.core.allocation import NodeState, Placement, Policy, allocate
from neuron_scheduler.core.catalog import CapacityError, Catalog, CatalogError
from neuron_scheduler.core.ids import format_ids, ids_mask, parse_id_ranges
from neuron_scheduler.core.resources import NeuronRequest, RequestError, Unit, resource_name
from neuron_scheduler.sim.contenders import FIRST_FIT, NEURON_SCHEDULER, NO_TOPOLOGY, Contender
from neuron_scheduler.sim.kubescheduler import PROFILES
from neuron_scheduler.sim.preemption import Preemption
from neuron_scheduler.sim.scenario import ScenarioError, load_fleet, load_workload
from neuron_scheduler.sim.simulation import SimResult
from neuron_scheduler.sim.workloads import default_fleet, generate_workload

TopologyFile = Annotated[
    Path | None,
    typer.Option("--topology-file", help="YAML file adding or overriding instance types."),
]
USER_ERRORS = (CapacityError, CatalogError, RequestError, ScenarioError)


def _ids(text: str | None, option: str, limit: int, unit: str) -> list[int]:
    if not text:
        return []
    try:
        ids = parse_id_ranges(text)
    except ValueError:
        raise UsageError(f"{option}: expected ids like 0,1,4-7, got {text!r}") from None
    beyond = [i for i in ids if i >= limit]
    if beyond:
        raise UsageError(
            f"{option}: {unit} {format_ids(beyond)} do not exist (ids run 0-{limit - 1})"
        )
    return ids


def explain(
    instance_type: Annotated[str, typer.Option(help="e.g. trn1.32xlarge")],
    resource: Annotated[str, typer.Option(help="neuron, neuroncore or neurondevice")],
    count: Annotated[int, typer.Option(help="how many devices or cores the pod requests")],
    used_devices: Annotated[str | None, typer.Option(help="devices already in use: 0,1")] = None,
    used_cores: Annotated[str | None, typer.Option(help="cores already in use: 4,5")] = None,
    neuroncore_capacity: Annotated[
        int | None, typer.Option(help="the node's aws.amazon.com/neuroncore (sets cores/device)")
    ] = None,
    policy: Annotated[Policy, typer.Option(help="placement policy")] = Policy.BEST_FIT,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    topology_file: TopologyFile = None,
) -> None:
    """Show which devices and cores a request gets on one node, or why it cannot fit."""
    with user_errors(*USER_ERRORS):
        catalog = Catalog.load(topology_file)
        if not catalog.knows(instance_type):
            raise UsageError(
                f"unknown instance type {instance_type!r}; known: "
                + ", ".join(catalog.instance_types)
                + " (add others with --topology-file)"
            )
        if neuroncore_capacity is not None and neuroncore_capacity < 1:
            raise UsageError("--neuroncore-capacity must be at least 1")
        try:
            topology = catalog.resolve(instance_type, None, neuroncore_capacity).topology
        except CapacityError as error:
            raise UsageError(f"--neuroncore-capacity {neuroncore_capacity}: {error}") from error
        request = NeuronRequest(resource_name(resource), count)
        limit = topology.devices if request.unit is Unit.DEVICE else topology.total_cores
        if count > limit:
            raise UsageError(
                f"--count {count} is more than {instance_type} has ({limit} {request.unit.value}s)"
            )
        devices = _ids(used_devices, "--used-devices", topology.devices, "devices")
        cores = _ids(used_cores, "--used-cores", topology.total_cores, "cores")
        used = topology.core_mask_of_devices(ids_mask(devices)) | ids_mask(cores)
        decision = allocate(topology, NodeState(used), request, policy)

    if isinstance(decision, Placement):
        if as_json:
            print(json.dumps({"devices": list(decision.devices), "cores": list(decision.cores)}))
            return
        ids = decision.devices if request.unit is Unit.DEVICE else decision.cores
        out.print(
            f"[bold]{instance_type}[/] ({topology.kind.value}, {topology.devices} devices x "
            f"{topology.cores_per_device} cores), {policy.value}: {request.describe()}"
        )
        out.print(f"  devices: {','.join(map(str, decision.devices))}")
        out.print(f"  cores:   {','.join(map(str, decision.cores))}")
        out.print(f"  AWS_NEURON_IDS={','.join(map(str, ids))}")
        out.print(f"  fit score: {decision.score}/10")
        return
    if as_json:
        print(json.dumps({"error": decision.reason}))
    else:
        out.print(decision.reason)
    raise typer.Exit(1)


def simulate(
    cluster: Annotated[Path | None, typer.Option(help="fleet YAML (default: built-in mix)")] = None,
    workload: Annotated[
        Path | None, typer.Option(help="workload YAML (default: built-in seeded stream)")
    ] = None,
    policy: Annotated[Policy, typer.Option(help="placement policy")] = Policy.BEST_FIT,
    profile: Annotated[
        str,
        typer.Option(
            help="kube-scheduler profile: chart (the chart's my-scheduler), default "
            "(kube-scheduler defaults, extender weight 1) or filter-only (no prioritize)"
        ),
    ] = "chart",
    report: Annotated[
        Path | None, typer.Option(help="write pictures and summary.json here")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="seed for a generated workload")] = None,
    compare: Annotated[
        bool,
        typer.Option(
            help="run neuron-scheduler, first-fit (as AWS's extension places) and the "
            "no-topology bound side by side (and, when pods have priorities, each without the "
            "preempt verb too)"
        ),
    ] = False,
    preemption: Annotated[
        Preemption,
        typer.Option(
            help="verb: kube-scheduler asks the extender for victims; count: kube-scheduler "
            "alone picks them by counting"
        ),
    ] = Preemption.VERB,
    topology_file: TopologyFile = None,
) -> None:
    """Run a fleet and a stream of pods through the extender's placement code, in memory."""
    with user_errors(*USER_ERRORS):
        if profile not in PROFILES:
            raise UsageError(f"--profile {profile!r}: choose one of {', '.join(PROFILES)}")
        catalog = Catalog.load(topology_file)
        fleet = load_fleet(cluster, catalog) if cluster else default_fleet()
        if workload:
            events = load_workload(workload, seed)
        else:
            events = generate_workload(seed=7 if seed is None else seed)
    chosen = Contender(policy.value, policy, PROFILES[profile], preemption=preemption)
    contenders = [chosen]
    if compare:
        contenders = [NEURON_SCHEDULER, FIRST_FIT, NO_TOPOLOGY]
        if any(event.priority for event in events):
            contenders = [run for c in contenders for run in (c, c.without_verb())]
    results: list[SimResult] = []
    for contender in contenders:
        with Progress(
            TextColumn(f"simulating ({contender.label})"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} events"),
            TimeRemainingColumn(),
            console=err,
            transient=True,
            disable=len(events) < 20_000,
        ) as progress:
            task = progress.add_task("run", total=len(events))

            def advance(done: int, task: TaskID = task) -> None:
                progress.update(task, completed=done)

            results.append(contender.run(fleet, catalog, events, seed or 0, advance))
    _print_results(results)
    if report is not None:
        try:
            from neuron_scheduler.sim.report import summary, write_report
        except ImportError as error:  # matplotlib is the `sim` extra, not in the server image
            fail(f"--report needs matplotlib ({error}); install neuron-scheduler[sim]")
        for result in results:
            # A file name prefix: first-fit-no-verb-...
            prefix = result.label.replace(", ", "-").replace(" ", "-") if compare else ""
            try:
                written = write_report(result, report, prefix)
            except OSError as error:
                fail(f"cannot write the report to {report}: {error.strerror or error}")
            out.print(f"wrote {len(written)} files to {report}/ ({result.label})")
        if compare:
            (report / "compare.json").write_text(
                json.dumps([summary(r) for r in results], indent=2) + "\n"
            )


def _percent(value: float | None) -> str:
    return "never" if value is None else f"{100 * value:.1f}%"


def _print_results(results: list[SimResult]) -> None:
    table = Table(title="Simulation", show_lines=False)
    table.add_column("")
    for result in results:
        table.add_column(result.label, justify="right")
    rows: list[tuple[str, list[str]]] = [
        ("nodes", [str(len(r.nodes)) for r in results]),
        ("pods arrived", [str(r.arrivals) for r in results]),
        ("placed", [str(r.placed) for r in results]),
        ("pending at end", [str(len(r.pending)) for r in results]),
        ("never placed", [str(r.never_placed) for r in results]),
        ("devices in use at end", [f"{100 * r.device_utilization:.1f}%" for r in results]),
        ("cores in use at end", [f"{100 * r.core_utilization:.1f}%" for r in results]),
        (
            "mean devices in use",
            [f"{100 * r.mean_device_utilization:.1f}%" for r in results],
        ),
        ("fragmentation at end", [f"{100 * r.fragmentation:.1f}%" for r in results]),
        (
            "devices in use at 1st fragmentation refusal",
            [_percent(r.utilization_at_first_fragmentation) for r in results],
        ),
        ("large pods (8+ devices): mean wait", [f"{r.large_wait_mean():.1f}" for r in results]),
        ("placed by preemption", [str(r.preempted) for r in results]),
        ("pods evicted", [str(r.evictions) for r in results]),
        ("evicted for nothing", [str(r.evictions_for_nothing) for r in results]),
    ]
    for name, values in rows:
        table.add_row(name, *values)
    out.print(table)

    first = results[0]
    by_type = Table(title=f"Nodes by instance type ({first.label})")
    for column in ("instance type", "nodes", "topology", "devices in use", "pods"):
        by_type.add_column(column, justify="left" if column == "instance type" else "right")
    groups: dict[str, list[int]] = {}
    for node in first.nodes:
        counts = groups.setdefault(node.topology.instance_type, [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += node.topology.devices
        counts[2] += len({d for p in node.pods.values() for d in p.devices})
        counts[3] += len(node.pods)
    for instance_type, (nodes, devices, busy, pods) in sorted(groups.items()):
        kind = next(
            n.topology.kind.value for n in first.nodes if n.topology.instance_type == instance_type
        )
        by_type.add_row(instance_type, str(nodes), kind, f"{busy}/{devices}", str(pods))
    out.print(by_type)

    for result in results:
        reasons: Counter[str] = result.pending_reasons()
        if not reasons:
            continue
        pending = Table(title=f"Pending at end ({result.label}), by reason")
        pending.add_column("pods", justify="right")
        pending.add_column("reason")
        for reason, count in reasons.most_common(5):
            pending.add_row(str(count), reason)
        out.print(pending)


def register(app: typer.Typer) -> None:
    app.command("explain")(explain)
    app.command("simulate")(simulate)
