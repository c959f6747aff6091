"""How well a node suits a pod with our DRA claim: the node score the extender's prioritize gives
such pods. Pure.

kube-scheduler's DRA plugin filters the nodes and its allocator picks the device (first fit in
our order, `firstfit`), but it does not score nodes by what that pick does to them: equal nodes
are a random pick. The extender scores them by the same best-fit measure as its own placements
(`core.allocation.placement_score`: how tightly the pick fills its free block, or, weighed by
the cluster's demand, how little it wastes), applied to the placement the scheduler will
actually make there.
"""

from __future__ import annotations

from functools import lru_cache

from neuron_scheduler.core.allocation import (
    Decision,
    NodeState,
    Placement,
    Policy,
    placement_score,
)
from neuron_scheduler.core.demand import DemandWeights
from neuron_scheduler.core.ids import ids_mask
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.core.topology import Topology
from neuron_scheduler.dra.firstfit import allocate_like_scheduler
from neuron_scheduler.dra.shapes import CoreWindows


@lru_cache(maxsize=1 << 16)
def scored_decision(
    topology: Topology,
    state: NodeState,
    request: NeuronRequest,
    core_windows: CoreWindows,
    demand: DemandWeights = (),
) -> Decision:
    """The scheduler's DRA decision on this node, with the node score the extender gives it.
    Cached: a fleet has many nodes of one type in one state."""
    decision = allocate_like_scheduler(topology, state, request, core_windows)
    if not isinstance(decision, Placement):
        return decision
    score = placement_score(
        topology, state, request.unit, ids_mask(decision.cores), Policy.BEST_FIT, demand
    )
    return decision._replace(score=score)
