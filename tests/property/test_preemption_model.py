"""The preempt verb against brute force on small nodes (issue 18).

For random nodes (a torus, a ring, a core-level ring) holding up to 8 pods of random priorities on
random cores, and a preemptor of random size and priority, every subset of the pods is tried:
- when no subset of lower-priority pods makes room, the node is dropped from the answer;
- when the preemptor already fits, the node is dropped (nothing to evict for devices);
- otherwise the answer's victims are all of lower priority, their removal lets the allocator
  place the preemptor, and no subset is better by the documented order (highest victim priority,
  then pod count, then work lost; no disruption budgets here).
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from neuron_scheduler.core.allocation import NodeState, Placement, allocate, check_request
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import comma_ids, devices_of_cores
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.budgets import DisruptionBudgets
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.verbs.preempting import Preemptor
from neuron_scheduler.extender.verbs.wire import ExtenderPreemptionArgs, MetaVictims
from neuron_scheduler.kube.objects import Pod
from tests.builders import node, pod

CATALOG = Catalog.builtin()
# (instance type, the unit pods hold and ask in)
NODES = [("trn1.32xlarge", NEURON), ("inf2.48xlarge", NEURON), ("inf1.6xlarge", NEURONCORE)]
MAX_PODS = 8


def holder(index: int, cores: list[int], resource: str, priority: int, per_device: int) -> Pod:
    devices = sorted(set(devices_of_cores(cores, per_device)))
    ids = devices if resource == NEURON else cores
    name = f"p{index}"
    annotations = {
        "AWS_NEURON_IDS": comma_ids(ids),
        "NEURON_RESOURCE_TYPE": resource,
        "NEURON_CORES": comma_ids(cores),
        "NEURON_DEVS": comma_ids(devices),
        "NEURON_NODE": "n",
    }
    body = pod(name, {resource: len(ids)}, node="n", uid=name, annotations=annotations)
    body.spec.priority = priority
    body.status.startTime = f"2026-11-23T10:{index:02d}:00Z"
    return body


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[str, str, list[Pod], int, int]:
    node_type, resource = draw(st.sampled_from(NODES))
    topology = CATALOG.resolve(node_type).topology
    per_device = topology.cores_per_device
    units = topology.devices if resource == NEURON else topology.total_cores
    # Each unit free (-1) or owned by one of MAX_PODS pods.
    owners = draw(st.lists(st.integers(-1, MAX_PODS - 1), min_size=units, max_size=units))
    priorities = draw(st.lists(st.integers(0, 3), min_size=MAX_PODS, max_size=MAX_PODS))
    pods = []
    for index in range(MAX_PODS):
        mine = [u for u, owner in enumerate(owners) if owner == index]
        if not mine:
            continue
        if resource == NEURON:
            cores = [d * per_device + c for d in mine for c in range(per_device)]
        else:
            cores = mine
        pods.append(holder(index, cores, resource, priorities[index], per_device))
    count = draw(st.integers(1, units))
    return node_type, resource, pods, count, draw(st.integers(1, 4))


def key(victims: list[Pod]) -> tuple[int, int, float]:
    return (
        max((p.spec.priority or 0) for p in victims),
        len(victims),
        -sum(datetime.fromisoformat(p.status.startTime or "").timestamp() for p in victims),
    )


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_the_answer_is_the_best_subset(scenario: tuple[str, str, list[Pod], int, int]) -> None:
    node_type, resource, pods, count, priority = scenario
    ledger = Ledger(CATALOG)
    ledger.replace_nodes([node("n", node_type)])
    ledger.replace_pods(pods)
    topology = ledger.nodes["n"].topology
    request = NeuronRequest(resource, count)
    preemptor = pod("big", {resource: count}, uid="big")
    preemptor.spec.priority = priority
    preempt = Preemptor(ledger, DisruptionBudgets(), Metrics(ledger))
    args = ExtenderPreemptionArgs(Pod=preemptor, NodeNameToMetaVictims={"n": MetaVictims([])})
    answer = asyncio.run(preempt.preempt(args)).NodeNameToMetaVictims

    def fits_without(gone: tuple[Pod, ...]) -> bool:
        used = 0
        for p in pods:
            if p not in gone:
                used |= ledger.pods_holding("n")[p.metadata.uid].cores
        return isinstance(allocate(topology, NodeState(used, 0), request), Placement)

    if check_request(topology, request) is not None or fits_without(()):
        assert answer == {}
        return
    lower = [p for p in pods if (p.spec.priority or 0) < priority]
    working = [
        list(subset)
        for size in range(1, len(lower) + 1)
        for subset in combinations(lower, size)
        if fits_without(subset)
    ]
    if not working:
        assert answer == {}
        return
    (victims,) = answer.values()
    by_uid = {p.metadata.uid: p for p in pods}
    chosen = [by_uid[v.UID] for v in victims.Pods]
    assert all((p.spec.priority or 0) < priority for p in chosen)
    assert fits_without(tuple(chosen))
    assert key(chosen) == min(key(subset) for subset in working)
    # Highest priority first, as kube-scheduler expects.
    ranks = [p.spec.priority or 0 for p in chosen]
    assert ranks == sorted(ranks, reverse=True)
