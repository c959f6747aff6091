"""Preemption in the simulator, as kube-scheduler 1.36 does it, with or without our verb. Pure.

kube-scheduler's dry run (DefaultPreemption) picks victims on each node by counting the
requested resource alone: it removes every lower-priority pod, checks the count fits, then gives
pods back, most important first (higher priority, then longer running), while it still fits. A
node where that leaves no victims is no candidate (so a node short only of contiguity never is).
With the verb, each candidate's victims are replaced by the extender's choice (core/eviction),
or the node is dropped. kube-scheduler then picks one node: fewest budget violations (none
here), lowest highest-victim priority, lowest priority sum, fewest victims, latest start of the
highest-priority victims.

Simplifications: victims leave at once (no graceful termination); evicted pods are not recreated;
only the Neuron resource the preemptor asks for is counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from neuron_scheduler.core.allocation import NodeState, Placement, Policy, allocate
from neuron_scheduler.core.eviction import Occupant, plan_eviction
from neuron_scheduler.core.resources import NeuronRequest, Unit
from neuron_scheduler.core.topology import Topology


class Preemption(StrEnum):
    VERB = "verb"  # kube-scheduler asks the extender's preempt verb for the victims
    COUNT = "count"  # kube-scheduler alone: victims by counting


@dataclass(frozen=True, slots=True)
class Resident:
    """A running pod, as preemption weighs it."""

    request: NeuronRequest
    priority: int
    started: float
    cores: int  # mask of the cores it holds


def capacity(topology: Topology, unit: Unit) -> int:
    """What the node advertises of a resource in `unit`s (neuron and neurondevice: devices)."""
    return topology.devices if unit is Unit.DEVICE else topology.total_cores


def count_victims(
    topology: Topology, residents: Mapping[str, Resident], request: NeuronRequest, priority: int
) -> list[str]:
    """kube-scheduler's victims on one node by counting `request.resource`; [] when the node is
    no candidate (nothing lower to remove, removing all does not fit, or nothing needs to go)."""
    same = {n: r for n, r in residents.items() if r.request.resource == request.resource}
    lower = sorted(
        (n for n, r in same.items() if r.priority < priority),
        key=lambda n: (-same[n].priority, same[n].started),
    )
    if not lower:
        return []
    free = capacity(topology, request.unit)
    free -= sum(r.request.count for n, r in same.items() if r.priority >= priority)
    if free < request.count:
        return []
    victims = []
    for name in lower:  # most important first: reprieved while the count still fits
        if free - same[name].request.count >= request.count:
            free -= same[name].request.count
        else:
            victims.append(name)
    return victims


def verb_victims(
    topology: Topology,
    state: NodeState,
    residents: Mapping[str, Resident],
    request: NeuronRequest,
    priority: int,
    suggested: Sequence[str],
    policy: Policy,
) -> list[str] | None:
    """The extender's answer for one candidate node: victims, or None to drop the node."""
    if isinstance(allocate(topology, state, request, policy), Placement):
        return list(suggested)  # devices are not short here: kube-scheduler's answer stands
    occupants = {n: Occupant(r.cores, 0, r.priority, r.started) for n, r in residents.items()}
    eviction = plan_eviction(
        topology, state, request, priority, occupants, suggested, policy=policy
    )
    return list(eviction.victims) if eviction is not None else None


def pick_key(victims: Sequence[Resident]) -> tuple[int, int, int, float]:
    """kube-scheduler's order among candidate nodes (smallest first)."""
    top = max(r.priority for r in victims)
    earliest_top = min(r.started for r in victims if r.priority == top)
    return (top, sum(r.priority + 2**31 for r in victims), len(victims), -earliest_top)
