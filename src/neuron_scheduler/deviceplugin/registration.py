"""Serving each resource on its socket and keeping it registered with kubelet.

kubelet dials a plugin's endpoint while handling Register, so every endpoint serves before it
registers. When kubelet restarts it deletes every socket in the plugin directory and creates a new
kubelet.sock; a poll of the directory notices both, serves again and registers again, and then
says so (`on_kubelet_start`): the pods bound by then reach the new kubelet in one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from neuron_scheduler.grpcsocket import FileIdentity, SocketServer, identity
from neuron_scheduler.kube.backoff import Backoff

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"


def socket_name(resource: str) -> str:
    return f"neuron-scheduler-{resource.rsplit('/', 1)[-1]}.sock"


class Endpoint(SocketServer):
    """One resource's DevicePlugin service on its socket in kubelet's device plugin directory."""

    def __init__(
        self, plugin_dir: Path, resource: str, servicer: api_pb2_grpc.DevicePluginServicer
    ) -> None:
        def add(server: grpc.aio.Server) -> None:
            api_pb2_grpc.add_DevicePluginServicer_to_server(servicer, server)

        super().__init__(plugin_dir / socket_name(resource), add, resource)
        self.resource = resource


async def register(kubelet_socket: Path, endpoint: Endpoint, timeout: float) -> None:
    async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}") as channel:
        stub = api_pb2_grpc.RegistrationStub(channel)
        await stub.Register(
            api_pb2.RegisterRequest(
                version=API_VERSION,
                endpoint=endpoint.socket.name,
                resource_name=endpoint.resource,
                options=api_pb2.DevicePluginOptions(
                    pre_start_required=False, get_preferred_allocation_available=True
                ),
            ),
            timeout=timeout,
        )


class Registrar:
    """Serves every endpoint and keeps each registered with the current kubelet."""

    def __init__(
        self,
        plugin_dir: Path,
        endpoints: list[Endpoint],
        poll_interval: float = 0.5,
        register_timeout: float = 15.0,
        on_kubelet_start: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.plugin_dir = plugin_dir
        self.kubelet_socket = plugin_dir / KUBELET_SOCKET
        self.endpoints = endpoints
        self.poll_interval = poll_interval
        self.register_timeout = register_timeout
        # resource -> the kubelet.sock identity it is registered with
        self.registered: dict[str, FileIdentity] = {}
        self._backoff = {e.resource: Backoff(initial=0.5, maximum=30.0) for e in endpoints}
        self._tried: dict[str, FileIdentity] = {}
        # Told of each kubelet that starts while this process watches (not of one that was
        # already running when it started: that kubelet's start batch is long admitted).
        self.on_kubelet_start = on_kubelet_start
        self._kubelet: FileIdentity | None = None
        self._watched = False  # a first look at the directory has been taken
        # Only their throttled log lines use these two.
        self._absent = Backoff(initial=1.0, maximum=3600.0)
        self._dir_problem = Backoff(initial=1.0, maximum=3600.0)

    async def run(self, stop: asyncio.Event) -> None:
        try:
            while not stop.is_set():
                await self.tick()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.poll_interval)
        finally:
            for endpoint in self.endpoints:
                await endpoint.stop()

    async def tick(self) -> None:
        # A kubelet that was not there at the first look (no directory yet, or no socket) started
        # while this process watched.
        watched, self._watched = self._watched, True
        problem = socket_dir_problem(self.plugin_dir)
        if problem is not None:
            self.registered.clear()
            self._dir_problem.failed()
            if self._dir_problem.should_log:
                log.warning("cannot serve yet: %s (kubelet creates it when it starts)", problem)
            return
        if self._dir_problem.failures:
            log.info("plugin directory %s is usable now", self.plugin_dir)
            self._dir_problem.succeeded()
        for endpoint in self.endpoints:
            if not endpoint.intact:
                # First start, or kubelet (or a person) removed our socket.
                backoff = self._backoff[endpoint.resource]
                if not backoff.ready():
                    continue
                try:
                    await endpoint.start()
                except Exception as error:  # e.g. a socket path the OS refuses
                    delay = backoff.failed()
                    if backoff.should_log:
                        log.error(
                            "cannot serve %s on %s: %s; retrying in %.1fs",
                            endpoint.resource,
                            endpoint.socket,
                            error,
                            delay,
                        )
                    continue
                backoff.succeeded()
                self.registered.pop(endpoint.resource, None)
        kubelet = identity(self.kubelet_socket)
        if kubelet is None:
            self.registered.clear()
            self._absent.failed()
            if self._absent.should_log:
                log.warning(
                    "waiting for kubelet: %s does not exist (is this the kubelet's device plugin "
                    "directory, and is kubelet running?)",
                    self.kubelet_socket,
                )
            return
        if self._absent.failures:
            log.info("kubelet socket %s appeared", self.kubelet_socket)
            self._absent.succeeded()
        for endpoint in self.endpoints:
            await self._register(endpoint, kubelet)
        if kubelet != self._kubelet:
            self._kubelet = kubelet
            if watched and self.on_kubelet_start is not None:
                await self.on_kubelet_start()

    async def _register(self, endpoint: Endpoint, kubelet: FileIdentity) -> None:
        if not endpoint.intact or self.registered.get(endpoint.resource) == kubelet:
            return
        backoff = self._backoff[endpoint.resource]
        if self._tried.get(endpoint.resource) != kubelet:
            # A new kubelet: register at once, whatever the last one made us wait for.
            self._tried[endpoint.resource] = kubelet
            backoff.succeeded()
        if not backoff.ready():
            return
        began = time.monotonic()
        try:
            await register(self.kubelet_socket, endpoint, self.register_timeout)
        except grpc.aio.AioRpcError as error:
            delay = backoff.failed()
            if backoff.should_log:
                log.warning(
                    "registering %s with kubelet failed: %s: %s; retrying in %.1fs",
                    endpoint.resource,
                    error.code().name,
                    loggable(error.details()),
                    delay,
                )
            return
        self.registered[endpoint.resource] = kubelet
        backoff.succeeded()
        log.info(
            "registered %s with kubelet (endpoint %s, %.0f ms)",
            endpoint.resource,
            endpoint.socket.name,
            1000 * (time.monotonic() - began),
        )


def socket_dir_problem(plugin_dir: Path) -> str | None:
    """Why the plugin directory cannot hold our sockets, or None."""
    if not plugin_dir.is_dir():
        return f"{plugin_dir} is not a directory"
    if not os.access(plugin_dir, os.W_OK | os.X_OK):
        return f"{plugin_dir} is not writable"
    return None
