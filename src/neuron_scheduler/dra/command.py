"""The `dra-driver` command. `register(app)` adds it to a typer app (the project CLI does)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from neuron_scheduler.commandline import UsageError, check_log_level, setup_logging, user_errors
from neuron_scheduler.dra import (
    DEFAULT_CDI_ROOT,
    DEFAULT_DRIVER_NAME,
    DEFAULT_LOGICAL_NC_CONFIG,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_REGISTRY_DIR,
)


def dra_driver(
    node_name: Annotated[
        str | None,
        typer.Option(
            envvar="NODE_NAME",
            help="this node's name (a pod gets it from the downward API: spec.nodeName)",
        ),
    ] = None,
    driver_name: Annotated[
        str,
        typer.Option(help="the DRA driver name: a DNS domain of yours, never neuron.aws.com"),
    ] = DEFAULT_DRIVER_NAME,
    kubeconfig: Annotated[
        Path | None, typer.Option(help="kubeconfig file (default: in-cluster service account)")
    ] = None,
    dev_root: Annotated[
        Path,
        typer.Option(help="where this process sees the host's /dev (CDI specs still name /dev)"),
    ] = Path("/dev"),
    sys_root: Annotated[Path, typer.Option(help="where this process sees the host's /sys")] = Path(
        "/sys"
    ),
    logical_nc_config: Annotated[
        Path, typer.Option(help="Trn2 Logical NeuronCore setting; cores per device = physical/LNC")
    ] = DEFAULT_LOGICAL_NC_CONFIG,
    cores_per_device: Annotated[
        int | None,
        typer.Option(help="logical cores per device, instead of sysfs core_count and the LNC file"),
    ] = None,
    plugins_dir: Annotated[
        Path, typer.Option(help="kubelet's plugins directory (the DRA socket and state go here)")
    ] = DEFAULT_PLUGINS_DIR,
    registry_dir: Annotated[
        Path, typer.Option(help="kubelet's plugin registration directory")
    ] = DEFAULT_REGISTRY_DIR,
    cdi_root: Annotated[
        Path, typer.Option(help="where CDI specs go (one the container runtime reads)")
    ] = DEFAULT_CDI_ROOT,
    health_interval: Annotated[
        float, typer.Option(help="seconds between device health checks")
    ] = 5.0,
    resync_interval: Annotated[
        float, typer.Option(help="seconds between checks that the ResourceSlices are intact")
    ] = 60.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
) -> None:
    """Serve Neuron devices through Dynamic Resource Allocation: publish every legal device set
    of this node as a ResourceSlice device and prepare the claims kubelet hands over."""
    from neuron_scheduler.dra.driver import DriverConfig, driver_name_problem, run
    from neuron_scheduler.kube.config import ConfigError

    with user_errors(ConfigError):
        if not node_name:
            raise UsageError("--node-name (or NODE_NAME) is required")
        log_level = check_log_level(log_level)
        problem = driver_name_problem(driver_name)
        if problem:
            raise UsageError(f"--driver-name: {problem}")
        if cores_per_device is not None and cores_per_device < 1:
            raise UsageError(f"--cores-per-device {cores_per_device}: must be at least 1")
        for option, value in (
            ("--health-interval", health_interval),
            ("--resync-interval", resync_interval),
        ):
            if value <= 0:
                raise UsageError(f"{option} {value}: must be positive")
        if kubeconfig is not None and not kubeconfig.is_file():
            raise UsageError(f"--kubeconfig {kubeconfig}: no such file")
        setup_logging(log_level)
        run(
            DriverConfig(
                node_name=node_name,
                driver_name=driver_name,
                kubeconfig=kubeconfig,
                dev_root=dev_root,
                sys_root=sys_root,
                logical_nc_config=logical_nc_config,
                cores_per_device=cores_per_device,
                plugins_dir=plugins_dir,
                registry_dir=registry_dir,
                cdi_root=cdi_root,
                health_interval=health_interval,
                resync_interval=resync_interval,
            )
        )


def register(app: typer.Typer) -> None:
    app.command("dra-driver")(dra_driver)
