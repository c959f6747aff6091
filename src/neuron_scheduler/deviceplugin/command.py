"""The `device-plugin` command. `register(app)` adds it to a typer app (the project CLI does)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from neuron_scheduler import commandline
from neuron_scheduler.deviceplugin import (
    DEFAULT_LOGICAL_NC_CONFIG,
    DEFAULT_PLUGIN_DIR,
    DEFAULT_POD_RESOURCES_SOCKET,
)


def device_plugin(
    ctx: typer.Context,
    node_name: commandline.NodeName = None,
    plugin_dir: Annotated[
        Path, typer.Option(help="kubelet's device plugin directory (holds kubelet.sock)")
    ] = DEFAULT_PLUGIN_DIR,
    dev_root: commandline.DevRoot = Path("/dev"),
    sys_root: commandline.SysRoot = Path("/sys"),
    kubeconfig: commandline.Kubeconfig = None,
    logical_nc_config: commandline.LogicalNcConfig = DEFAULT_LOGICAL_NC_CONFIG,
    cores_per_device: commandline.CoresPerDevice = None,
    health_interval: commandline.HealthInterval = 2.0,
    pod_resources_socket: Annotated[
        Path,
        typer.Option(
            help="kubelet's pod resources API socket: which pod it admits, which container "
            "really holds each id"
        ),
    ] = DEFAULT_POD_RESOURCES_SOCKET,
    log_level: commandline.LogLevel = "info",
) -> None:
    """Serve the kubelet device plugin API for aws.amazon.com/neuroncore, neuron and neurondevice,
    handing each container exactly the ids the scheduler annotated on its pod."""
    from neuron_scheduler.deviceplugin.plugin import PluginConfig, run
    from neuron_scheduler.kube.config import ConfigError

    with commandline.user_errors(ConfigError):
        options, level = commandline.node_agent_options(**ctx.params)
        commandline.setup_logging(level)
        run(
            PluginConfig(
                **options, plugin_dir=plugin_dir, pod_resources_socket=pod_resources_socket
            )
        )


def register(app: typer.Typer) -> None:
    app.command("device-plugin")(device_plugin)
