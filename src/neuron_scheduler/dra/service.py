"""kubelet's gRPC side: the DRAPlugin service (v1 and v1beta1, same messages) over the Preparer,
the plugin registration service, and the unix sockets both are served on (`grpcsocket`).

kubelet finds `<registry dir>/<driver>-reg.sock`, asks GetInfo, and from then on calls the DRA
socket the answer names, choosing the first service of `supported_versions` it knows (v1 first).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.dra.checkpoint import PreparedClaim
from neuron_scheduler.dra.pluginregistration import api_pb2 as registration_pb2
from neuron_scheduler.dra.pluginregistration import api_pb2_grpc as registration_grpc
from neuron_scheduler.dra.preparing import ClaimRef, Preparer
from neuron_scheduler.dra.v1 import api_pb2 as v1_pb2
from neuron_scheduler.dra.v1 import api_pb2_grpc as v1_grpc
from neuron_scheduler.dra.v1beta1 import api_pb2 as v1beta1_pb2
from neuron_scheduler.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from neuron_scheduler.grpcsocket import SocketServer

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]
PLUGIN_TYPE = "DRAPlugin"
SUPPORTED_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # kubelet takes the first it knows
MAX_CLAIMS_PER_CALL = 256  # a pod has at most a few; more is not a real kubelet call


def _refs(claims: Sequence[Any]) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.name, c.uid) for c in claims[:MAX_CLAIMS_PER_CALL]]


def _device_fields(claim: PreparedClaim) -> list[dict[str, Any]]:
    return [
        {
            "request_names": [d.request],
            "pool_name": d.pool,
            "device_name": d.device,
            "cdi_device_ids": [d.cdi_id],
        }
        for d in claim.devices
    ]


class DraPluginV1(v1_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    async def NodePrepareResources(
        self, request: v1_pb2.NodePrepareResourcesRequest, context: Context
    ) -> v1_pb2.NodePrepareResourcesResponse:
        answers = await self.preparer.prepare(_refs(request.claims))
        response = v1_pb2.NodePrepareResourcesResponse()
        for uid, answer in answers.items():
            entry = response.claims[uid]
            if isinstance(answer, str):
                entry.error = answer
            else:
                entry.devices.extend(v1_pb2.Device(**f) for f in _device_fields(answer))
        return response

    async def NodeUnprepareResources(
        self, request: v1_pb2.NodeUnprepareResourcesRequest, context: Context
    ) -> v1_pb2.NodeUnprepareResourcesResponse:
        answers = await self.preparer.unprepare(_refs(request.claims))
        response = v1_pb2.NodeUnprepareResourcesResponse()
        for uid, error in answers.items():
            response.claims[uid].error = error
        return response


class DraPluginV1beta1(v1beta1_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    async def NodePrepareResources(
        self, request: v1beta1_pb2.NodePrepareResourcesRequest, context: Context
    ) -> v1beta1_pb2.NodePrepareResourcesResponse:
        answers = await self.preparer.prepare(_refs(request.claims))
        response = v1beta1_pb2.NodePrepareResourcesResponse()
        for uid, answer in answers.items():
            entry = response.claims[uid]
            if isinstance(answer, str):
                entry.error = answer
            else:
                entry.devices.extend(v1beta1_pb2.Device(**f) for f in _device_fields(answer))
        return response

    async def NodeUnprepareResources(
        self, request: v1beta1_pb2.NodeUnprepareResourcesRequest, context: Context
    ) -> v1beta1_pb2.NodeUnprepareResourcesResponse:
        answers = await self.preparer.unprepare(_refs(request.claims))
        response = v1beta1_pb2.NodeUnprepareResourcesResponse()
        for uid, error in answers.items():
            response.claims[uid].error = error
        return response


class Registration(registration_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: Path) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.registered = False

    async def GetInfo(
        self, request: registration_pb2.InfoRequest, context: Context
    ) -> registration_pb2.PluginInfo:
        return registration_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver,
            endpoint=str(self.endpoint),
            supported_versions=list(SUPPORTED_SERVICES),
        )

    async def NotifyRegistrationStatus(
        self, request: registration_pb2.RegistrationStatus, context: Context
    ) -> registration_pb2.RegistrationStatusResponse:
        self.registered = request.plugin_registered
        if request.plugin_registered:
            log.info("kubelet registered DRA driver %s (endpoint %s)", self.driver, self.endpoint)
        else:
            log.error("kubelet refused DRA driver %s: %s", self.driver, loggable(request.error))
        return registration_pb2.RegistrationStatusResponse()


def dra_server(socket: Path, preparer: Preparer) -> SocketServer:
    def add(server: grpc.aio.Server) -> None:
        v1_grpc.add_DRAPluginServicer_to_server(DraPluginV1(preparer), server)
        v1beta1_grpc.add_DRAPluginServicer_to_server(DraPluginV1beta1(preparer), server)

    return SocketServer(socket, add, "DRAPlugin v1 and v1beta1")


def registration_server(socket: Path, registration: Registration) -> SocketServer:
    def add(server: grpc.aio.Server) -> None:
        registration_grpc.add_RegistrationServicer_to_server(registration, server)

    return SocketServer(socket, add, f"plugin registration for {registration.driver}")
