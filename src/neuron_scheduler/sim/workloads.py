"""Fleets and seeded pod streams: the built-in default and the standard workloads of the
placement-quality benchmark (bench/quality.py). Pure.

A generated pod arrives (Poisson arrivals), waits until it is placed, then runs for its duration
(exponential lifetimes) and leaves. The standard workloads offer more work than their fleet holds,
so pods queue; none of them is tuned to any placement policy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE, NeuronRequest, Unit
from neuron_scheduler.sim.simulation import NodeSpec, PodEvent


@dataclass(frozen=True, slots=True)
class PodMix:
    resource: str
    sizes: tuple[int, ...]
    weight: float
    priority: int = 0


def fleet_of(mix: list[tuple[str, int]]) -> list[NodeSpec]:
    return [
        NodeSpec(f"{instance_type.replace('.', '-')}-{i}", instance_type)
        for instance_type, count in mix
        for i in range(count)
    ]


def default_fleet() -> list[NodeSpec]:
    """A small mixed fleet whose every node still fits in one picture."""
    return fleet_of(
        [
            ("inf1.6xlarge", 2),
            ("inf1.24xlarge", 1),
            ("inf2.24xlarge", 2),
            ("inf2.48xlarge", 3),
            ("trn1.32xlarge", 3),
            ("trn2.48xlarge", 2),
        ]
    )


DEFAULT_MIX = (
    PodMix(NEURONCORE, (1, 2, 2, 4, 8, 9, 16), 5.0),
    PodMix(NEURON, (1, 1, 2, 3, 4, 4, 8, 12, 16), 4.0),
    PodMix(NEURONDEVICE, (1, 2), 1.0),
)


def is_service(request: NeuronRequest) -> bool:
    """A small pod: one device, or up to two cores (what long-lived inference replicas ask)."""
    return request.count <= (1 if request.unit is Unit.DEVICE else 2)


def generate_workload(
    pods: int = 600,
    seed: int = 7,
    mean_interarrival: float = 1.0,
    mean_lifetime: float = 90.0,
    mix: tuple[PodMix, ...] = DEFAULT_MIX,
    services: float = 0.0,
) -> list[PodEvent]:
    """A seeded stream of pod arrivals, each with how long it runs once placed. `services`:
    small pods (`is_service`) are owned by a controller and live that many times longer (0: as
    long as the others, and bare)."""
    rng = random.Random(seed)
    weights = [m.weight for m in mix]
    events: list[PodEvent] = []
    now = 0.0
    for i in range(pods):
        now += rng.expovariate(1.0 / mean_interarrival)
        kind = rng.choices(mix, weights)[0]
        request = NeuronRequest(kind.resource, rng.choice(kind.sizes))
        duration = rng.expovariate(1.0 / mean_lifetime)
        owned = bool(services) and is_service(request)
        if owned:
            duration *= services
        events.append(PodEvent(now, f"pod-{i:05d}", request, kind.priority, duration, owned))
    return events


@dataclass(frozen=True, slots=True)
class Workload:
    """A standard workload: its fleet and its pod stream, both fixed by name and seed."""

    name: str
    description: str
    fleet: tuple[tuple[str, int], ...]
    mix: tuple[PodMix, ...]
    pods: int
    mean_interarrival: float
    mean_lifetime: float
    services: float = 0.0  # small pods live this many times longer, owned (generate_workload)

    def nodes(self) -> list[NodeSpec]:
        return fleet_of(list(self.fleet))

    def events(self, seed: int) -> list[PodEvent]:
        return generate_workload(
            self.pods, seed, self.mean_interarrival, self.mean_lifetime, self.mix, self.services
        )

    def with_services(self, factor: float) -> Workload:
        """The same workload whose small pods are long-lived replicas of controllers (the pods
        that leave scattered one-device holes), `factor` times the others' lifetime."""
        return replace(self, name=f"{self.name} + services", services=factor)

    def offered_load(self, catalog: Catalog) -> float:
        """Devices the stream asks for over time, as a share of the fleet's devices: arrival
        rate x mean devices per pod x mean lifetime / devices. A core request counts as its
        share of a device at the fleet's mean cores per device."""
        devices = cores = 0
        for spec in self.nodes():
            topology = catalog.resolve(spec.instance_type, None, spec.neuroncore_capacity).topology
            devices += topology.devices
            cores += topology.total_cores
        cores_per_device = cores / devices
        total_weight = sum(m.weight for m in self.mix)
        mean_devices = 0.0  # device-lifetimes per pod, in units of the mean lifetime
        for m in self.mix:
            for count in m.sizes:
                request = NeuronRequest(m.resource, count)
                size = count / cores_per_device if request.unit is Unit.CORE else float(count)
                if self.services and is_service(request):
                    size *= self.services
                mean_devices += m.weight / total_weight * size / len(m.sizes)
        return mean_devices * self.mean_lifetime / self.mean_interarrival / devices

    def at_load(self, load: float, catalog: Catalog) -> Workload:
        """The same fleet and mix with arrivals spaced for `load` (1.0: the fleet's devices)."""
        interarrival = self.mean_interarrival * self.offered_load(catalog) / load
        return replace(self, mean_interarrival=interarrival)


# Offered load (arrival rate x mean devices per pod x mean lifetime) is about 1.2x each fleet's
# devices for inference and training, and about 2x for mixed (the built-in stream).
STANDARD = {
    w.name: w
    for w in (
        Workload(
            "inference",
            "inf2 and trn1; mostly 1-2 core and 1-device pods, some 4 and 8 devices; short lives",
            (("inf2.48xlarge", 6), ("inf2.24xlarge", 6), ("trn1.32xlarge", 4)),
            (
                PodMix(NEURONCORE, (1,), 4.0),
                PodMix(NEURONCORE, (2,), 3.0),
                PodMix(NEURON, (1,), 3.0),
                PodMix(NEURON, (4,), 0.6),
                PodMix(NEURON, (8,), 0.4),
            ),
            6000,
            0.18,
            30.0,
        ),
        Workload(
            "training",
            "trn1 and trn2; 4/8/16-device and whole-node pods, long lives, a few small pods",
            (("trn1.32xlarge", 8), ("trn2.48xlarge", 4)),
            (
                PodMix(NEURON, (4,), 3.0),
                PodMix(NEURON, (8,), 2.0),
                PodMix(NEURON, (16,), 1.5),
                PodMix(NEURON, (1,), 1.0),
                PodMix(NEURONCORE, (2,), 0.5),
            ),
            1500,
            8.75,
            300.0,
        ),
        Workload(
            "mixed",
            "the built-in stream on the built-in fleet (every instance type, every request kind)",
            (
                ("inf1.6xlarge", 2),
                ("inf1.24xlarge", 1),
                ("inf2.24xlarge", 2),
                ("inf2.48xlarge", 3),
                ("trn1.32xlarge", 3),
                ("trn2.48xlarge", 2),
            ),
            DEFAULT_MIX,
            1500,
            1.0,
            90.0,
        ),
    )
}
