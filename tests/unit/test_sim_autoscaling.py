"""The simulator's autoscaler (sim/autoscaling.py): a node for a pod short of devices in every
setup, for a stranded pod only with capacity requests, and only when consolidation cannot help;
added nodes removed once empty, and their time counted."""

from __future__ import annotations

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NeuronRequest
from neuron_scheduler.sim.autoscaling import AutoscalerLimits, autoscaled
from neuron_scheduler.sim.contenders import Contender
from neuron_scheduler.sim.simulation import NodeSpec, PodEvent, SimResult

CATALOG = Catalog.builtin()
FLEET = [NodeSpec("ring", "inf2.48xlarge")]


def run(limits: AutoscalerLimits, owned: bool = False, big: int = 4) -> SimResult:
    """One inf2.48xlarge: 12 one-device pods fill it, those on devices 2, 5, 8 and 11 leave,
    then a pod of `big` devices comes: stranded (4 free, no 4 in a row) or short (more)."""
    events = [
        PodEvent(float(i), f"small-{i:02d}", NeuronRequest(NEURON, 1), duration=None, owned=owned)
        for i in range(12)
    ]
    events += [PodEvent(20.0, f"small-{i:02d}", None) for i in (2, 5, 8, 11)]
    events.append(PodEvent(30.0, "big", NeuronRequest(NEURON, big), duration=100.0))
    events.append(PodEvent(3000.0, "late", NeuronRequest(NEURON, 1), duration=1.0))
    return Contender("t", simulation=autoscaled(limits)).run(FLEET, CATALOG, events, 1)


def test_a_stranded_pod_gets_a_node_only_at_a_capacity_request() -> None:
    alone = run(AutoscalerLimits())
    assert alone.nodes_added == 0 and "big" in alone.pending
    asked = run(AutoscalerLimits(capacity_requests=True, pending_seconds=60))
    assert (asked.nodes_added, asked.capacity_requests) == (1, 1)
    assert "big" not in asked.pending
    # Asked after 60 s, there 90 s later; removed 30 s after the pod left (100 s): 130 s up.
    assert asked.added_node_seconds == 130.0


def test_no_capacity_request_when_consolidation_can_move_the_pods_in_the_way() -> None:
    both = run(AutoscalerLimits(consolidation=True, capacity_requests=True), owned=True)
    assert both.nodes_added == 0 and both.unblocked == 1 and "big" not in both.pending
    pinned = run(AutoscalerLimits(consolidation=True, capacity_requests=True), owned=False)
    assert pinned.capacity_requests == 1


def test_a_pod_short_of_devices_gets_a_node_in_every_setup() -> None:
    result = run(AutoscalerLimits(), big=8)
    assert (result.nodes_added, result.capacity_requests) == (1, 0)
    assert "big" not in result.pending
