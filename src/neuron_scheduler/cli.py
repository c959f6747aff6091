"""The `neuron-scheduler` command: thin entry points over the packages that do the work."""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from neuron_scheduler.allocation import NodeState, Placement, Policy, allocate
from neuron_scheduler.catalog import Catalog, CatalogError
from neuron_scheduler.deviceplugin.command import register as register_device_plugin
from neuron_scheduler.requests import NeuronRequest, RequestError, Unit, resource_name
from neuron_scheduler.scenario import ScenarioError, load_fleet, load_workload
from neuron_scheduler.simulation import (
    SimResult,
    Simulation,
    default_fleet,
    generate_workload,
)
from neuron_scheduler.topology import format_ids, ids_mask, parse_ids
from neuron_scheduler.ultraserver.command import register as register_ultraserver

app = typer.Typer(
    help="Topology-aware scheduling for AWS Neuron devices on Kubernetes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

TopologyFile = Annotated[
    Path | None,
    typer.Option("--topology-file", help="YAML file adding or overriding instance types."),
]


class UsageError(ValueError):
    """Bad command-line input, reported as one line."""


def fail(message: str, code: int = 2) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


@contextmanager
def user_errors() -> Iterator[None]:
    """Errors a person can fix become one line on stderr and exit code 2, never a traceback."""
    try:
        yield
    except (CatalogError, RequestError, ScenarioError, UsageError) as error:
        fail(str(error))


def _ids(text: str | None, option: str, limit: int, unit: str) -> list[int]:
    if not text:
        return []
    try:
        ids = parse_ids(text)
    except ValueError:
        raise UsageError(f"{option}: expected ids like 0,1,4-7, got {text!r}") from None
    beyond = [i for i in ids if i >= limit]
    if beyond:
        raise UsageError(
            f"{option}: {unit} {format_ids(beyond)} do not exist (ids run 0-{limit - 1})"
        )
    return ids


@app.command()
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
    with user_errors():
        catalog = Catalog.load(topology_file)
        if not catalog.knows(instance_type):
            raise UsageError(
                f"unknown instance type {instance_type!r}; known: "
                + ", ".join(catalog.instance_types)
                + " (add others with --topology-file)"
            )
        if neuroncore_capacity is not None and neuroncore_capacity < 1:
            raise UsageError("--neuroncore-capacity must be at least 1")
        topology = catalog.resolve(instance_type, None, neuroncore_capacity).topology
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


@app.command()
def simulate(
    cluster: Annotated[Path | None, typer.Option(help="fleet YAML (default: built-in mix)")] = None,
    workload: Annotated[
        Path | None, typer.Option(help="workload YAML (default: built-in seeded stream)")
    ] = None,
    policy: Annotated[Policy, typer.Option(help="placement policy")] = Policy.BEST_FIT,
    report: Annotated[
        Path | None, typer.Option(help="write pictures and summary.json here")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="seed for a generated workload")] = None,
    compare: Annotated[bool, typer.Option(help="run best-fit and first-fit, side by side")] = False,
    topology_file: TopologyFile = None,
) -> None:
    """Run a fleet and a stream of pods through the extender's placement code, in memory."""
    from neuron_scheduler.report import summary, write_report

    with user_errors():
        catalog = Catalog.load(topology_file)
        fleet = load_fleet(cluster, catalog) if cluster else default_fleet()
        if workload:
            events = load_workload(workload, seed)
        else:
            events = generate_workload(seed=7 if seed is None else seed)
    policies = [Policy.BEST_FIT, Policy.FIRST_FIT] if compare else [policy]
    results: list[SimResult] = []
    for chosen in policies:
        simulation = Simulation(fleet, catalog, chosen)
        with Progress(
            TextColumn(f"simulating ({chosen.value})"),
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

            results.append(simulation.run(events, advance))
    _print_results(results)
    if report is not None:
        for result in results:
            label = result.policy.value if compare else ""
            try:
                written = write_report(result, report, label)
            except OSError as error:
                fail(f"cannot write the report to {report}: {error.strerror or error}")
            out.print(f"wrote {len(written)} files to {report}/ ({label or result.policy.value})")
        if compare:
            (report / "compare.json").write_text(
                json.dumps([summary(r) for r in results], indent=2) + "\n"
            )


@app.command()
def extender(
    kubeconfig: Annotated[
        Path | None, typer.Option(help="kubeconfig file (default: in-cluster service account)")
    ] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="port kube-scheduler calls")] = 12345,
    tls_cert: Annotated[Path | None, typer.Option(help="serve HTTPS with this certificate")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="key for --tls-cert")] = None,
    topology_file: TopologyFile = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
    body_limit: Annotated[int, typer.Option(help="largest request body in bytes")] = 64 << 20,
    leader_elect: Annotated[
        bool,
        typer.Option(help="take a Lease; only the leader is ready and binds (for >1 replica)"),
    ] = False,
    lease_name: Annotated[str, typer.Option(help="the Lease's name")] = "k8s-neuron-scheduler",
    lease_namespace: Annotated[
        str | None, typer.Option(help="Lease namespace (default: $POD_NAMESPACE or kube-system)")
    ] = None,
    lease_identity: Annotated[
        str | None, typer.Option(help="this replica's name in the Lease (default: $POD_NAME)")
    ] = None,
    lease_duration: Annotated[
        float, typer.Option(help="seconds a standby waits before taking over a silent leader")
    ] = 15.0,
    renew_deadline: Annotated[
        float, typer.Option(help="seconds the leader keeps leading without a renewal")
    ] = 10.0,
    retry_period: Annotated[float, typer.Option(help="seconds between Lease rounds")] = 2.0,
) -> None:
    """Serve kube-scheduler's extender calls: POST /filter, /prioritize, /bind."""
    from neuron_scheduler.election import ElectionConfig, default_identity, default_namespace
    from neuron_scheduler.kubeapi import ConfigError
    from neuron_scheduler.server import ExtenderOptions, run

    with user_errors():
        if (tls_cert is None) != (tls_key is None):
            raise UsageError("--tls-cert and --tls-key go together")
        for path in (tls_cert, tls_key):
            if path is not None and not path.is_file():
                raise UsageError(f"{path}: no such file")
        if log_level.lower() not in ("debug", "info", "warning", "error"):
            raise UsageError(f"--log-level {log_level!r}: use debug, info, warning or error")
        if not 0 < port < 65536:
            raise UsageError(f"--port {port} is not a TCP port")
        Catalog.load(topology_file)  # fail now, with the file's name, not inside the server
        election = None
        if leader_elect:
            try:
                election = ElectionConfig(
                    lease_name,
                    lease_namespace or default_namespace(),
                    lease_identity or default_identity(),
                    lease_duration,
                    renew_deadline,
                    retry_period,
                )
            except ValueError as error:
                raise UsageError(str(error)) from error
        options = ExtenderOptions(
            kubeconfig, host, port, tls_cert, tls_key, topology_file, log_level, body_limit
        )
        options.election = election
        try:
            run(options)
        except ConfigError as error:
            raise UsageError(str(error)) from error


@app.command()
def cluster(
    workdir: Annotated[Path, typer.Option(help="keys, kubeconfigs, logs")] = Path(".cluster"),
    node_cache_capable: Annotated[
        bool, typer.Option(help="kube-scheduler sends node names only (else full nodes)")
    ] = True,
) -> None:
    """Start a local control plane with the extender and my-scheduler, for trying it by hand."""
    import signal
    import threading

    from neuron_scheduler.testbed import ControlPlane, Stack, fake_neuron_node, find_kubebin
    from neuron_scheduler.testbed.stack import REPO

    nodes = [
        ("inf1-6xlarge-0", "inf1.6xlarge", 4, 16),
        ("inf2-48xlarge-0", "inf2.48xlarge", 12, 24),
        ("trn1-32xlarge-0", "trn1.32xlarge", 16, 32),
        ("trn2-48xlarge-0", "trn2.48xlarge", 16, 64),
    ]
    kubebin = find_kubebin(REPO)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with ControlPlane(kubebin, workdir) as cp:
        stack = Stack(cp)
        stack.use_scheduler(node_cache_capable)
        for name, instance_type, devices, cores in nodes:
            cp.request(
                "POST", "/api/v1/nodes", fake_neuron_node(name, instance_type, devices, cores)
            )
        kubectl = f"{kubebin} kubectl --kubeconfig {cp.kubeconfig_path}"
        out.print(
            f"[bold]cluster ready[/] in {cp.startup_seconds:.1f}s; nodes: "
            + ", ".join(n[0] for n in nodes)
        )
        out.print(f"kubeconfig: {cp.kubeconfig_path}")
        out.print(f"kubectl:    {kubectl}")
        out.print(f"extender:   {stack.extender.url} (log {stack.extender.process.log_path})")
        out.print(f"logs:       {cp.log_dir}/")
        out.print(
            "try:        " + kubectl + " run nrt --image=x --restart=Never "
            '--overrides=\'{"spec":{"schedulerName":"my-scheduler","containers":'
            '[{"name":"nrt","image":"x","resources":{"limits":'
            '{"aws.amazon.com/neuroncore":"9"}}}]}}\''
        )
        out.print("Ctrl-C stops everything.")
        try:
            while not stop.wait(1):
                pass
        except KeyboardInterrupt:
            pass
        stack.stop()


def _print_results(results: list[SimResult]) -> None:
    table = Table(title="Simulation", show_lines=False)
    table.add_column("")
    for result in results:
        table.add_column(result.policy.value, justify="right")
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
    ]
    for name, values in rows:
        table.add_row(name, *values)
    out.print(table)

    first = results[0]
    by_type = Table(title=f"Nodes by instance type ({first.policy.value})")
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
        pending = Table(title=f"Pending at end ({result.policy.value}), by reason")
        pending.add_column("pods", justify="right")
        pending.add_column("reason")
        for reason, count in reasons.most_common(5):
            pending.add_row(str(count), reason)
        out.print(pending)


register_device_plugin(app)
register_ultraserver(app)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
