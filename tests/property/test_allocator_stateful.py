"""Random allocate/release sequences on every instance type keep the allocator's invariants,
with and without the cluster's demand (core.demand) steering best-fit."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    Policy,
    Refusal,
    _unusable,
    allocate,
    busy_devices,
    is_valid_core_set,
    is_valid_device_set,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.demand import Demand
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE, NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology, TopologyKind

CATALOG = Catalog.builtin()
# Every built-in type, Trn2 at both Logical NeuronCore settings, and a switch node.
TOPOLOGIES: list[Topology] = [CATALOG.resolve(t).topology for t in CATALOG.instance_types]
TOPOLOGIES.append(CATALOG.resolve("trn2.48xlarge", 16, 128).topology)
TOPOLOGIES.append(CATALOG.resolve("trn3.48xlarge", 16, 128).topology)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.topology = TOPOLOGIES[0]
        self.policy = Policy.BEST_FIT
        self.state = NodeState()
        self.pods: dict[int, tuple[NeuronRequest, Placement]] = {}
        self.next_pod = 0
        self.demand: Demand | None = None

    @initialize(
        topology=st.sampled_from(TOPOLOGIES),
        policy=st.sampled_from(list(Policy)),
        by_demand=st.booleans(),
    )
    def pick_node(self, topology: Topology, policy: Policy, by_demand: bool) -> None:
        self.topology = topology
        self.policy = policy
        self.demand = Demand() if by_demand else None

    @rule(data=st.data(), resource=st.sampled_from([NEURON, NEURONDEVICE, NEURONCORE]))
    def request(self, data: st.DataObject, resource: str) -> None:
        unit_total = self.topology.total_cores if resource == NEURONCORE else self.topology.devices
        count = data.draw(st.integers(1, unit_total), label="count")
        request = NeuronRequest(resource, count)
        demand = ()
        if self.demand is not None:
            self.demand.record(request.unit, count)
            demand = self.demand.weights
        decision = allocate(self.topology, self.state, request, self.policy, demand)
        plain = allocate(self.topology, self.state, request, self.policy)
        assert isinstance(decision, Refusal) == isinstance(plain, Refusal), "demand changes a fit"
        if demand and isinstance(plain, Placement) and self.policy is Policy.BEST_FIT:
            used = self.state.used_cores
            chosen = _unusable(self.topology, used | decision.core_mask, demand)
            assert chosen <= _unusable(self.topology, used | plain.core_mask, demand)
        if isinstance(decision, Refusal):
            assert decision.reason
            if request.unit is Unit.DEVICE and self.topology.kind is TopologyKind.TORUS:
                allowed = self.topology.allowed_device_counts or ()
                assert decision.unresolvable == (count not in allowed)
            return
        cores = set(decision.cores)
        assert len(cores) == len(decision.cores)
        assert not decision.core_mask & self.state.used_cores, "overlap with cores in use"
        assert 0 <= decision.score <= 10
        if request.unit is Unit.DEVICE:
            assert len(decision.devices) == count
            assert is_valid_device_set(self.topology, decision.devices)
            per = self.topology.cores_per_device
            assert cores == {d * per + i for d in decision.devices for i in range(per)}
            assert not busy_devices(self.topology, self.state.used_cores) & sum(
                1 << d for d in decision.devices
            ), "device request got a device with a core in use"
        else:
            assert len(cores) == count
            assert is_valid_core_set(self.topology, decision.cores)
            per = self.topology.cores_per_device
            assert set(decision.devices) == {c // per for c in decision.cores}
        self.state = self.state.with_used(decision.core_mask)
        self.pods[self.next_pod] = (request, decision)
        self.next_pod += 1

    @precondition(lambda self: bool(self.pods))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        pod = data.draw(st.sampled_from(sorted(self.pods)), label="pod")
        _, placement = self.pods.pop(pod)
        self.state = self.state.without(placement.core_mask)

    @rule()
    def one_and_all_fit_an_empty_node(self) -> None:
        if self.pods:
            return
        for resource, total in (
            (NEURON, self.topology.devices),
            (NEURONCORE, self.topology.total_cores),
        ):
            for count in {1, total}:
                decision = allocate(self.topology, self.state, NeuronRequest(resource, count))
                assert isinstance(decision, Placement)

    @invariant()
    def views_agree(self) -> None:
        used = 0
        for _, placement in self.pods.values():
            assert not used & placement.core_mask, "two pods share a core"
            used |= placement.core_mask
        assert used == self.state.used_cores
        devices = {d for _, p in self.pods.values() for d in p.devices}
        assert busy_devices(self.topology, used) == sum(1 << d for d in devices)

    def teardown(self) -> None:
        for pod in list(self.pods):
            _, placement = self.pods.pop(pod)
            self.state = self.state.without(placement.core_mask)
        assert self.state == NodeState(), "releasing everything must restore the empty node"


AllocatorMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocator = AllocatorMachine.TestCase
