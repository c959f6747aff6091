"""What a comparison runs side by side: ways of placing pods, each a label and a setup. Pure.

- neuron-scheduler: our best-fit allocator and prioritize under the chart's profile;
- first-fit: what a topology-aware extender without scoring gets (AWS's extension: filter and
  bind only, devices taken lowest first) under kube-scheduler's default profile;
- no-topology bound: counts only, contiguity ignored, packed like ours: no topology-correct
  scheduler places more on the same stream;
- clairvoyant: neuron-scheduler that knows when every pod will leave (sim/clairvoyant.py): what
  knowing lifetimes would add, which no real scheduler does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.sim.clairvoyant import ClairvoyantSimulation
from neuron_scheduler.sim.kubescheduler import CHART, DEFAULT_FILTER_ONLY, Profile
from neuron_scheduler.sim.preemption import Preemption
from neuron_scheduler.sim.simulation import (
    Allocator,
    NodeSpec,
    PodEvent,
    SimResult,
    Simulation,
    count_allocator,
    topology_allocator,
)


@dataclass(frozen=True, slots=True)
class Contender:
    label: str
    policy: Policy = Policy.BEST_FIT
    profile: Profile = CHART
    allocator: Allocator = topology_allocator
    preemption: Preemption = Preemption.VERB
    simulation: type[Simulation] = Simulation

    def without_verb(self) -> Contender:
        return replace(self, label=f"{self.label}, no verb", preemption=Preemption.COUNT)

    def run(
        self,
        fleet: list[NodeSpec],
        catalog: Catalog,
        events: list[PodEvent],
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> SimResult:
        simulation = self.simulation(
            fleet, catalog, self.policy, self.preemption, self.profile, self.allocator, seed
        )
        result = simulation.run(events, progress)
        result.label = self.label
        return result


NEURON_SCHEDULER = Contender("neuron-scheduler")
FIRST_FIT = Contender("first-fit", Policy.FIRST_FIT, DEFAULT_FILTER_ONLY)
NO_TOPOLOGY = Contender("no-topology bound", allocator=count_allocator)
CLAIRVOYANT = Contender("clairvoyant (knows lifetimes)", simulation=ClairvoyantSimulation)
