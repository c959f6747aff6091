"""The DRA driver process: reads the node and its devices, publishes the ResourceSlices, serves
kubelet (registration and DRAPlugin), and turns device health into device taints."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.dra import (
    DEFAULT_CDI_ROOT,
    DEFAULT_CORE_WINDOWS,
    DEFAULT_DRIVER_NAME,
    DEFAULT_LOGICAL_NC_CONFIG,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_REGISTRY_DIR,
)
from neuron_scheduler.dra.checkpoint import Checkpoint
from neuron_scheduler.dra.claims import ResourceClaim
from neuron_scheduler.dra.devicegroups import pairing
from neuron_scheduler.dra.hardware import HostDevices, read_host, read_logical_nc
from neuron_scheduler.dra.pools import node_topology
from neuron_scheduler.dra.preparing import NodeDevices, Preparer
from neuron_scheduler.dra.publisher import Owner, Publisher
from neuron_scheduler.dra.service import Registration, dra_server, registration_server
from neuron_scheduler.dra.slices import NodeInventory
from neuron_scheduler.grpcsocket import SocketServer
from neuron_scheduler.kube.backoff import Backoff
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.config import load_config
from neuron_scheduler.kube.errors import READ_ERRORS, NotFound, error_text

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DriverConfig:
    node_name: str
    driver_name: str = DEFAULT_DRIVER_NAME
    kubeconfig: Path | None = None
    dev_root: Path = Path("/dev")
    sys_root: Path = Path("/sys")
    logical_nc_config: Path = DEFAULT_LOGICAL_NC_CONFIG
    cores_per_device: int | None = None  # overrides sysfs core counts and the LNC file
    plugins_dir: Path = DEFAULT_PLUGINS_DIR
    registry_dir: Path = DEFAULT_REGISTRY_DIR
    cdi_root: Path = DEFAULT_CDI_ROOT
    # The counts of cores windows are published for beside the device sets (none: no windows).
    core_windows: tuple[int, ...] = DEFAULT_CORE_WINDOWS
    health_interval: float = 5.0
    resync_interval: float = 60.0
    socket_poll_interval: float = 1.0

    @property
    def state_dir(self) -> Path:
        return self.plugins_dir / self.driver_name

    @property
    def dra_socket(self) -> Path:
        return self.state_dir / "dra.sock"

    @property
    def registration_socket(self) -> Path:
        return self.registry_dir / f"{self.driver_name}-reg.sock"


def efa_pairing(instance_type: str, host: HostDevices, devices: int) -> tuple[str, ...] | None:
    """AWS's Neuron-to-EFA pairing, when this node is such a type and has its EFA devices."""
    paired = pairing(instance_type)
    if paired is None or len(paired) != devices or not host.efa_bdfs & set(paired):
        return None
    return paired


class Driver:
    def __init__(self, config: DriverConfig, api: KubeAPI, catalog: Catalog | None = None) -> None:
        self.config = config
        self.api = api
        self.catalog = catalog or Catalog.builtin()
        self.changed = asyncio.Event()
        self.devices: NodeDevices | None = None
        self.inventory: NodeInventory | None = None
        self.preparer: Preparer | None = None
        self.publisher: Publisher | None = None
        self.registration: Registration | None = None
        self.instance_type = ""

    async def _node(self, stop: asyncio.Event) -> Owner | None:
        backoff = Backoff(initial=1.0, maximum=30.0, jitter=0.2)
        name = self.config.node_name
        while not stop.is_set():
            try:
                node = await self.api.get_node(name)
                self.instance_type = node.instance_type
                return Owner(name, node.metadata.uid)
            except NotFound:
                problem = f"node {name} does not exist in the API"
            except READ_ERRORS as error:
                problem = f"cannot read node {name}: {error_text(error)}"
            delay = backoff.failed()
            if backoff.should_log:
                log.warning("%s; retrying in %.0fs", problem, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        return None

    def _cores(self, host: HostDevices) -> int | None:
        if self.config.cores_per_device:
            return self.config.cores_per_device
        if host.physical_cores is None:
            return None
        lnc, warning = read_logical_nc(self.config.logical_nc_config)
        if warning:
            log.warning("%s", warning)
        if host.physical_cores % lnc:
            return host.physical_cores
        return host.physical_cores // lnc

    async def _host(self, stop: asyncio.Event) -> tuple[HostDevices, int] | None:
        backoff = Backoff(initial=1.0, maximum=60.0)
        while not stop.is_set():
            host = await asyncio.to_thread(read_host, self.config.dev_root, self.config.sys_root)
            cores = self._cores(host)
            if host.devices and cores:
                return host, cores
            delay = backoff.failed()
            if backoff.should_log:
                log.warning(
                    "no usable Neuron devices under %s and %s yet (is the Neuron driver loaded?); "
                    "retrying in %.0fs",
                    self.config.dev_root,
                    self.config.sys_root,
                    delay,
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        return None

    async def run(self, stop: asyncio.Event) -> None:
        owner = await self._node(stop)
        found = await self._host(stop) if owner is not None else None
        if owner is None or found is None:
            return
        host, cores = found
        topology, warning = node_topology(self.catalog, self.instance_type, host.count, cores)
        if warning:
            log.warning("%s", warning)
        self.devices = NodeDevices(topology, host.physical_cores, dict(host.problems))
        paired = efa_pairing(topology.instance_type, host, topology.devices)
        self.inventory = NodeInventory(
            owner.name, topology, paired, dict(host.problems), self.config.core_windows
        )
        log.info(
            "node %s: %s, %s of %d devices x %d cores, %d unhealthy%s",
            owner.name,
            topology.instance_type,
            topology.kind.value,
            topology.devices,
            topology.cores_per_device,
            len(host.problems),
            ", EFA device groups published" if paired else "",
        )
        checkpoint = Checkpoint(
            self.config.state_dir / "checkpoint.json", self.config.driver_name, owner.name
        )
        checkpoint.load()

        async def read_claim(namespace: str, name: str) -> ResourceClaim:
            return await self.api.get_resource_claim(namespace, name, ResourceClaim)

        self.preparer = Preparer(
            self.config.driver_name,
            owner.name,
            self.devices,
            checkpoint,
            self.config.cdi_root,
            read_claim,
        )
        self.publisher = Publisher(self.api, self.config.driver_name, owner)
        self.registration = Registration(self.config.driver_name, self.config.dra_socket)
        servers = [
            # The DRA socket first: kubelet dials it as soon as registration answers.
            dra_server(self.config.dra_socket, self.preparer),
            registration_server(self.config.registration_socket, self.registration),
        ]
        inventory = self.inventory

        def current() -> NodeInventory:
            return self.inventory or inventory

        try:
            await asyncio.gather(
                self.publisher.run(current, self.changed, stop, self.config.resync_interval),
                self._serve(servers, stop),
                self._watch_health(stop),
            )
        finally:
            for server in reversed(servers):
                await server.stop()

    async def _serve(self, servers: list[SocketServer], stop: asyncio.Event) -> None:
        backoff = Backoff(initial=0.5, maximum=30.0)
        while not stop.is_set():
            if not all(s.intact for s in servers) and backoff.ready():
                try:
                    for server in servers:
                        await server.start()
                    backoff.succeeded()
                except Exception as error:  # e.g. a directory the OS refuses us
                    delay = backoff.failed()
                    if backoff.should_log:
                        log.error(
                            "cannot serve kubelet sockets: %s; retrying in %.1fs", error, delay
                        )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.socket_poll_interval)

    async def _watch_health(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.health_interval)
            if stop.is_set() or self.devices is None or self.inventory is None:
                return
            try:
                host = await asyncio.to_thread(
                    read_host, self.config.dev_root, self.config.sys_root
                )
            except Exception:  # a reader bug must not stop health reporting for good
                log.exception("reading the Neuron devices failed; retrying")
                continue
            topology = self.devices.topology
            problems = {d: p for d, p in host.problems.items() if d < topology.devices}
            problems.update(
                {d: f"neuron{d} is not present" for d in range(host.count, topology.devices)}
            )
            if problems == self.devices.unhealthy:
                continue
            for d in sorted(set(problems) | set(self.devices.unhealthy)):
                if d in problems and d not in self.devices.unhealthy:
                    log.warning("neuron%d is unhealthy: %s; tainting its devices", d, problems[d])
                elif d not in problems:
                    log.info("neuron%d is healthy again", d)
            self.devices.unhealthy = problems
            self.inventory = dataclasses.replace(self.inventory, unhealthy=dict(problems))
            self.changed.set()


async def serve(config: DriverConfig, stop: asyncio.Event) -> None:
    """Run until `stop` is set. Raises kube.config.ConfigError when there is no way to reach the
    API server at all; every other trouble is logged and retried."""
    api = KubeAPI(load_config(config.kubeconfig))
    try:
        await Driver(config, api).run(stop)
    finally:
        await api.close()


def run(config: DriverConfig) -> None:
    """Serve until SIGTERM or SIGINT."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    asyncio.run(main())
