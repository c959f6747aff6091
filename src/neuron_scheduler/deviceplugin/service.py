"""The DevicePlugin gRPC service for one resource: thin glue over DeviceState and Assigner."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

import grpc

from neuron_scheduler.core.resources import RESOURCE_UNITS
from neuron_scheduler.deviceplugin.assigning import AllocationError, Assigner, ContainerRequest
from neuron_scheduler.deviceplugin.devicewatch import DeviceState
from neuron_scheduler.deviceplugin.inventory import HEALTHY, UNHEALTHY
from neuron_scheduler.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]


class NeuronDevicePlugin(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, resource: str, state: DeviceState, assigner: Assigner) -> None:
        self.resource = resource
        self.unit = RESOURCE_UNITS[resource]
        self.state = state
        self.assigner = assigner

    async def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: Context
    ) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=True
        )

    async def ListAndWatch(
        self, request: api_pb2.Empty, context: Context
    ) -> AsyncGenerator[api_pb2.ListAndWatchResponse, None]:
        log.info("kubelet is watching %s", self.resource)
        sent: tuple[tuple[str, bool], ...] | None = None
        version = self.state.version
        while True:
            devices = self.state.advertised(self.unit)
            if devices != sent:
                yield api_pb2.ListAndWatchResponse(
                    devices=[
                        api_pb2.Device(ID=i, health=HEALTHY if ok else UNHEALTHY)
                        for i, ok in devices
                    ]
                )
                sent = devices
            version = await self.state.wait_newer(version)

    async def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: Context
    ) -> api_pb2.PreferredAllocationResponse:
        requests = [
            ContainerRequest(
                tuple(r.available_deviceIDs), tuple(r.must_include_deviceIDs), r.allocation_size
            )
            for r in request.container_requests
        ]
        try:
            answers = await self.assigner.preferred(self.resource, requests)
        except Exception as error:  # advice only: a bug here must not fail the pod
            log.exception("GetPreferredAllocation for %s failed", self.resource)
            await context.abort(grpc.StatusCode.INTERNAL, f"GetPreferredAllocation: {error}")
        return api_pb2.PreferredAllocationResponse(
            container_responses=[
                api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids) for ids in answers
            ]
        )

    async def Allocate(
        self, request: api_pb2.AllocateRequest, context: Context
    ) -> api_pb2.AllocateResponse:
        try:
            responses = await self.assigner.allocate(
                self.resource, self.unit, [list(r.devices_ids) for r in request.container_requests]
            )
        except AllocationError as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except Exception as error:
            log.exception("Allocate for %s failed", self.resource)
            await context.abort(grpc.StatusCode.INTERNAL, f"Allocate: {error}")
        return api_pb2.AllocateResponse(container_responses=responses)

    async def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: Context
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()
