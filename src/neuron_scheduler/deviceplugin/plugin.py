"""The device plugin process: discovery, the three endpoints, registration, health (to the
kubelet, and which devices failed on the Node for the extender), and keeping the annotations true
to kubelet's pod resources."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE
from neuron_scheduler.deviceplugin import (
    DEFAULT_LOGICAL_NC_CONFIG,
    DEFAULT_PLUGIN_DIR,
    DEFAULT_POD_RESOURCES_SOCKET,
)
from neuron_scheduler.deviceplugin.assigning import Assigner
from neuron_scheduler.deviceplugin.correcting import Corrector
from neuron_scheduler.deviceplugin.devicewatch import DeviceWatch
from neuron_scheduler.deviceplugin.hardware import Hardware, SysfsHardware
from neuron_scheduler.deviceplugin.holdings import SocketHoldings
from neuron_scheduler.deviceplugin.pods import ApiNodePods
from neuron_scheduler.deviceplugin.publishing import HealthPublisher
from neuron_scheduler.deviceplugin.registration import Endpoint, Registrar
from neuron_scheduler.deviceplugin.service import NeuronDevicePlugin
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.config import load_config
from neuron_scheduler.kube.errors import API_ERRORS

log = logging.getLogger(__name__)

RESOURCES = (NEURONCORE, NEURON, NEURONDEVICE)


@dataclass(frozen=True, slots=True)
class PluginConfig:
    node_name: str
    plugin_dir: Path = DEFAULT_PLUGIN_DIR
    dev_root: Path = Path("/dev")
    sys_root: Path = Path("/sys")
    kubeconfig: Path | None = None  # None: in-cluster service account
    logical_nc_config: Path = DEFAULT_LOGICAL_NC_CONFIG
    cores_per_device: int | None = None  # overrides sysfs core_count / LNC
    resources: tuple[str, ...] = RESOURCES
    health_interval: float = 2.0
    poll_interval: float = 0.5  # how often the plugin directory is checked for a new kubelet
    pod_resources_socket: Path = DEFAULT_POD_RESOURCES_SOCKET
    reconcile_interval: float = 30.0  # between comparisons with kubelet's pod resources


async def serve(
    config: PluginConfig, stop: asyncio.Event, hardware: Hardware | None = None
) -> None:
    """Run until `stop` is set. Raises kube.config.ConfigError at once when there is no way to reach
    the API server at all; every other trouble is logged and retried."""
    api = KubeAPI(load_config(config.kubeconfig))
    assigner: Assigner | None = None
    try:
        watch = DeviceWatch(
            hardware or SysfsHardware(config.dev_root, config.sys_root),
            config.logical_nc_config,
            config.cores_per_device,
            config.health_interval,
        )
        state = await watch.discover(stop)
        if state is None:
            return
        kubelet = SocketHoldings(config.pod_resources_socket, config.resources)
        assigner = Assigner(
            ApiNodePods(api, config.node_name), config.node_name, state, kubelet=kubelet
        )
        corrector = Corrector(
            assigner.pods,
            kubelet,
            config.node_name,
            assigner.topology,
            interval=config.reconcile_interval,
            withheld=assigner.withheld,
            unhealthy=assigner.unhealthy_devices,
        )
        assigner.on_allocate = corrector.allocating
        endpoints = [
            Endpoint(config.plugin_dir, resource, NeuronDevicePlugin(resource, state, assigner))
            for resource in config.resources
        ]
        registrar = Registrar(
            config.plugin_dir,
            endpoints,
            config.poll_interval,
            on_kubelet_start=assigner.kubelet_started,
        )
        await asyncio.gather(
            watch.run(state, stop),
            HealthPublisher(assigner.pods, state).run(stop),
            registrar.run(stop),
            corrector.run(stop),
            _check_api(assigner, config.node_name),
        )
    finally:
        if assigner is not None:
            await assigner.close()
        await api.close()


async def _check_api(assigner: Assigner, node: str) -> None:
    # Said once at start so a wrong kubeconfig or missing RBAC shows up before the first pod.
    try:
        pods = await assigner.pods.list_pods()
    except API_ERRORS as error:
        log.warning(
            "cannot list pods on node %s yet (%s); Allocate will retry, and fail pods only "
            "while the API stays unreachable",
            node,
            loggable(error),
        )
        return
    topology = await assigner.topology()
    log.info(
        "node %s: %s, %s of %d devices x %d cores; %d pods bound here",
        node,
        topology.instance_type,
        topology.kind.value,
        topology.devices,
        topology.cores_per_device,
        len(pods),
    )


def run(config: PluginConfig) -> None:
    """Serve until SIGTERM or SIGINT."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        task = asyncio.create_task(serve(config, stop))
        await asyncio.wait([task, asyncio.create_task(stop.wait())], return_when="FIRST_COMPLETED")
        if not task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), 5.0)
        if task.done():
            task.result()
        else:
            task.cancel()
        log.info("device plugin stopped")

    asyncio.run(main())
