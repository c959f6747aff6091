"""The `dra-driver` command. `register(app)` adds it to a typer app (the project CLI does)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from neuron_scheduler import commandline
from neuron_scheduler.dra import (
    DEFAULT_CDI_ROOT,
    DEFAULT_CORE_WINDOWS,
    DEFAULT_DRIVER_NAME,
    DEFAULT_LOGICAL_NC_CONFIG,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_REGISTRY_DIR,
)

CoreWindowsOption = Annotated[
    str,
    typer.Option(
        help="publish windows of NeuronCores of these counts beside the device sets, for core "
        "claims: a comma-separated list of 1 .. 32 (empty or 0: none)"
    ),
]
DEFAULT_CORE_WINDOWS_TEXT = ",".join(map(str, DEFAULT_CORE_WINDOWS))


def core_window_option(text: str) -> tuple[int, ...]:
    """--core-windows, checked: the counts as published, or a UsageError naming the option."""
    from neuron_scheduler.dra.shapes import MAX_CORE_WINDOW, core_window_counts

    counts = [c.strip() for c in text.split(",") if c.strip() not in ("", "0")]
    if not all(c.isdigit() and 1 <= int(c) <= MAX_CORE_WINDOW for c in counts):
        raise commandline.UsageError(
            f"--core-windows must list core counts of 1 .. {MAX_CORE_WINDOW}, got {text[:60]!r}"
        )
    return core_window_counts(int(c) for c in counts)


def dra_driver(
    ctx: typer.Context,
    node_name: commandline.NodeName = None,
    driver_name: Annotated[
        str,
        typer.Option(help="the DRA driver name: a DNS domain of yours, never neuron.aws.com"),
    ] = DEFAULT_DRIVER_NAME,
    kubeconfig: commandline.Kubeconfig = None,
    dev_root: commandline.DevRoot = Path("/dev"),
    sys_root: commandline.SysRoot = Path("/sys"),
    logical_nc_config: commandline.LogicalNcConfig = DEFAULT_LOGICAL_NC_CONFIG,
    cores_per_device: commandline.CoresPerDevice = None,
    plugins_dir: Annotated[
        Path, typer.Option(help="kubelet's plugins directory (the DRA socket and state go here)")
    ] = DEFAULT_PLUGINS_DIR,
    registry_dir: Annotated[
        Path, typer.Option(help="kubelet's plugin registration directory")
    ] = DEFAULT_REGISTRY_DIR,
    cdi_root: Annotated[
        Path, typer.Option(help="where CDI specs go (one the container runtime reads)")
    ] = DEFAULT_CDI_ROOT,
    core_windows: CoreWindowsOption = DEFAULT_CORE_WINDOWS_TEXT,
    health_interval: commandline.HealthInterval = 5.0,
    resync_interval: Annotated[
        float, typer.Option(help="seconds between checks that the ResourceSlices are intact")
    ] = 60.0,
    log_level: commandline.LogLevel = "info",
) -> None:
    """Serve Neuron devices through Dynamic Resource Allocation: publish every legal device set
    of this node, and its NeuronCore windows, as ResourceSlice devices and prepare the claims
    kubelet hands over."""
    from neuron_scheduler.dra import driver_name_problem
    from neuron_scheduler.dra.driver import DriverConfig, run
    from neuron_scheduler.kube.config import ConfigError

    with commandline.user_errors(ConfigError):
        options, level = commandline.node_agent_options(**ctx.params)
        problem = driver_name_problem(driver_name)
        if problem:
            raise commandline.UsageError(f"--driver-name: {problem}")
        commandline.check_positive("--resync-interval", resync_interval)
        windows = core_window_option(core_windows)
        commandline.setup_logging(level)
        run(
            DriverConfig(
                **options,
                driver_name=driver_name,
                plugins_dir=plugins_dir,
                registry_dir=registry_dir,
                cdi_root=cdi_root,
                core_windows=windows,
                resync_interval=resync_interval,
            )
        )


def slice_templates(
    instance_type: Annotated[
        list[str] | None,
        typer.Option(help="an instance type to write (repeatable; default: every catalog type)"),
    ] = None,
    driver_name: Annotated[
        str, typer.Option(help="the DRA driver name the chart's driver runs with")
    ] = DEFAULT_DRIVER_NAME,
    topology_file: Annotated[
        Path | None,
        typer.Option("--topology-file", help="YAML file adding or overriding instance types."),
    ] = None,
    core_windows: CoreWindowsOption = DEFAULT_CORE_WINDOWS_TEXT,
) -> None:
    """Print the ResourceSlices the DRA driver would publish on a node of each instance type, as
    JSON {instance type: [ResourceSliceSpec, ...]}: ResourceSliceTemplates for an autoscaler's
    cloud provider (docs/autoscaling.md)."""
    import json

    from neuron_scheduler.core.catalog import Catalog, CatalogError
    from neuron_scheduler.dra import driver_name_problem
    from neuron_scheduler.dra.templates import slice_templates as templates

    with commandline.user_errors(CatalogError, ValueError):
        problem = driver_name_problem(driver_name)
        if problem:
            raise commandline.UsageError(f"--driver-name: {problem}")
        windows = core_window_option(core_windows)
        catalog = Catalog.load(topology_file)
        print(json.dumps(templates(catalog, driver_name, instance_type, windows), indent=1))


def register(app: typer.Typer) -> None:
    app.command("dra-driver")(dra_driver)
    app.command("dra-slice-templates")(slice_templates)
