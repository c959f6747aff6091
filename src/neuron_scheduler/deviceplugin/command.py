"""The `device-plugin` command. `register(app)` adds it to a typer app (the project CLI does)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from neuron_scheduler.commandline import UsageError, check_log_level, setup_logging, user_errors
from neuron_scheduler.deviceplugin import (
    DEFAULT_LOGICAL_NC_CONFIG,
    DEFAULT_PLUGIN_DIR,
    DEFAULT_POD_RESOURCES_SOCKET,
)


def device_plugin(
    node_name: Annotated[
        str | None,
        typer.Option(
            envvar="NODE_NAME",
            help="this node's name (a pod gets it from the downward API: spec.nodeName)",
        ),
    ] = None,
    plugin_dir: Annotated[
        Path, typer.Option(help="kubelet's device plugin directory (holds kubelet.sock)")
    ] = DEFAULT_PLUGIN_DIR,
    dev_root: Annotated[
        Path,
        typer.Option(help="where this process sees the host's /dev (device specs still name /dev)"),
    ] = Path("/dev"),
    sys_root: Annotated[Path, typer.Option(help="where this process sees the host's /sys")] = Path(
        "/sys"
    ),
    kubeconfig: Annotated[
        Path | None, typer.Option(help="kubeconfig file (default: in-cluster service account)")
    ] = None,
    logical_nc_config: Annotated[
        Path, typer.Option(help="Trn2 Logical NeuronCore setting; cores per device = physical/LNC")
    ] = DEFAULT_LOGICAL_NC_CONFIG,
    cores_per_device: Annotated[
        int | None,
        typer.Option(help="logical cores per device, instead of sysfs core_count and the LNC file"),
    ] = None,
    health_interval: Annotated[
        float, typer.Option(help="seconds between device health checks")
    ] = 2.0,
    pod_resources_socket: Annotated[
        Path,
        typer.Option(
            help="kubelet's pod resources API socket: which container really holds each id"
        ),
    ] = DEFAULT_POD_RESOURCES_SOCKET,
    log_level: Annotated[str, typer.Option(help="debug, info, warning or error")] = "info",
) -> None:
    """Serve the kubelet device plugin API for aws.amazon.com/neuroncore, neuron and neurondevice,
    handing each container exactly the ids the scheduler annotated on its pod."""
    from neuron_scheduler.deviceplugin.plugin import PluginConfig, run
    from neuron_scheduler.kube.config import ConfigError

    with user_errors(ConfigError):
        if not node_name:
            raise UsageError("--node-name (or NODE_NAME) is required")
        log_level = check_log_level(log_level)
        if cores_per_device is not None and cores_per_device < 1:
            raise UsageError(f"--cores-per-device {cores_per_device}: must be at least 1")
        if health_interval <= 0:
            raise UsageError(f"--health-interval {health_interval}: must be positive")
        if kubeconfig is not None and not kubeconfig.is_file():
            raise UsageError(f"--kubeconfig {kubeconfig}: no such file")
        setup_logging(log_level)
        run(
            PluginConfig(
                node_name=node_name,
                plugin_dir=plugin_dir,
                dev_root=dev_root,
                sys_root=sys_root,
                kubeconfig=kubeconfig,
                logical_nc_config=logical_nc_config,
                cores_per_device=cores_per_device,
                health_interval=health_interval,
                pod_resources_socket=pod_resources_socket,
            )
        )


def register(app: typer.Typer) -> None:
    app.command("device-plugin")(device_plugin)
