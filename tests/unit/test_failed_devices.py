"""Failed devices in what the extender knows: never planned for by filter, bind, preempt,
consolidation or the views; neither free nor any pod's; counted once; usable again as soon as
the device plugin says so (issue 39)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import generate_latest

from neuron_scheduler.core import handoff
from neuron_scheduler.core.allocation import (
    Placement,
    Policy,
    Refusal,
    free_devices,
    largest_free_block,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.eviction import plan_eviction
from neuron_scheduler.core.health import UNHEALTHY_DEVICES
from neuron_scheduler.core.ids import cores_of_devices
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.ledger import NODE_CHANGED, Claimant, Ledger
from neuron_scheduler.kube.objects import ObjectRef, Pod
from neuron_scheduler.live.diagnosis import ANY_PRIORITY
from neuron_scheduler.live.fleet import fleet_json, fleet_view
from tests.builders import node, pod

RING = "inf2-a"  # inf2.48xlarge: a ring of 12 devices x 2 cores
TORUS = "trn1-a"  # trn1.32xlarge: a 4x4 torus of 16 devices x 2 cores


def ledger_with(failed: Sequence[int] = (), torus_failed: Sequence[int] = ()) -> Ledger:
    ledger = Ledger(Catalog.builtin())
    ledger.replace_nodes(
        [
            node(RING, "inf2.48xlarge", failed=failed),
            node(TORUS, "trn1.32xlarge", failed=torus_failed),
        ]
    )
    return ledger


def running(name: str, node_name: str, devices: list[int]) -> Pod:
    """A pod the extender placed on these devices, admitted by the kubelet."""
    request = NeuronRequest(NEURON, len(devices))
    placement = Placement(tuple(devices), cores_of_devices(devices, 2), 0)
    annotations = handoff.encode(node_name, request, placement, ["c0"], 1)
    annotations[handoff.ALLOCATED] = "true"
    return pod(
        name, {NEURON: len(devices)}, node=node_name, annotations=annotations, phase="Running"
    )


def place(ledger: Ledger, node_name: str, count: int, resource: str = NEURON) -> Placement | str:
    request = NeuronRequest(resource, count)
    decision = ledger.fill_verdicts([node_name], request, Policy.BEST_FIT).decisions[node_name]
    return decision if isinstance(decision, Placement) else decision.reason


def test_a_failed_device_is_known_by_id_and_never_placed_on() -> None:
    ledger = ledger_with(failed=[5])
    entry = ledger.nodes[RING]
    assert entry.unhealthy_devices == 1 << 5
    assert entry.withheld_cores == 0  # the missing capacity is the failed device: not twice
    for count in (1, 2, 3, 4, 8, 11):
        placed = place(ledger, RING, count)
        assert isinstance(placed, Placement), (count, placed)
        assert 5 not in placed.devices, (count, placed)
    for count in (2, 4, 12):  # core runs do not wrap around: 12-23 is the longest now
        placed = place(ledger, RING, count, NEURONCORE)
        assert isinstance(placed, Placement) and not {10, 11} & set(placed.cores), placed
    assert "(device 5 failed)" in str(place(ledger, RING, 13, NEURONCORE))
    refused = place(ledger, RING, 12)
    assert isinstance(refused, str) and "(device 5 failed)" in refused


def test_without_the_plugins_annotation_the_missing_capacity_is_held_in_count() -> None:
    ledger = Ledger(Catalog.builtin())
    ledger.replace_nodes([node(RING, "inf2.48xlarge", failed=[5], published=False)])
    entry = ledger.nodes[RING]
    assert entry.unhealthy_devices == 0 and entry.withheld_cores == 2
    assert free_devices(entry.topology, ledger.state(RING)) == 11


def test_a_pod_on_a_failed_device_is_counted_as_kube_scheduler_counts_it() -> None:
    # The view: a pod on 4-7 when device 5 failed keeps running; 8-11 and 0-3 are idle.
    # Allocatable dropped to 11 while the pod still requests 4: kube-scheduler and the kubelet
    # leave 7 devices for others, and so does every view (one device's worth held in count).
    ledger = ledger_with(failed=[5])
    ledger.apply_pod(running("on-failed", RING, [4, 5, 6, 7]))
    entry, state = ledger.nodes[RING], ledger.state(RING)
    assert free_devices(entry.topology, state) == 7
    assert largest_free_block(entry.topology, state) == 7  # within 8-11,0-3 around the ring
    assert isinstance(place(ledger, RING, 7), Placement)
    assert "only 7 devices free" in str(place(ledger, RING, 8))
    assert [(uid, node_name, devices) for uid, node_name, devices in ledger.on_failed_devices()]
    fleet = fleet_json(fleet_view(ledger))
    ring = next(n for n in fleet["nodes"] if n["name"] == RING)
    assert (ring["free_devices"], ring["largest_free_block"], ring["withheld_cores"]) == (7, 7, 0)
    assert ring["unhealthy_devices"] == [5] and ring["held"]["devices"] == []
    assert ring["unattributed_cores"] == 2  # the failed device, requested still: once, in count
    assert ring["pods"][0]["on_unhealthy_devices"] == [5]
    assert fleet["summary"]["unhealthy_devices"] == 1
    assert fleet["summary"]["pods_on_unhealthy_devices"] == 1


def test_evicting_a_pod_never_frees_the_failed_device() -> None:
    # Preemption and consolidation weigh the node as eviction_view gives it: the failed device's
    # cores stay in use when the pod on it leaves, so 4-7 is no block to free for a 4-device pod.
    ledger = ledger_with(failed=[5])
    for name, devices in (("a", [0, 1, 2, 3]), ("b", [4, 5, 6, 7]), ("c", [8, 9, 10, 11])):
        ledger.apply_pod(running(name, RING, devices))
    entry = ledger.nodes[RING]
    request = NeuronRequest(NEURON, 4)
    base, occupants = ledger.eviction_view(Claimant(), RING)
    eviction = plan_eviction(entry.topology, base, request, ANY_PRIORITY, occupants)
    assert eviction is not None and 5 not in eviction.block.devices, eviction


def test_evicting_the_pod_on_the_failed_device_frees_its_count_never_the_device() -> None:
    # Only 0-3 of the healthy devices are free beside the pod on 4-7 (device 5 failed): an
    # 8-device pod needs that pod gone, and gets 6..1 around the ring, never 5.
    ledger = ledger_with(failed=[5])
    ledger.apply_pod(running("on-failed", RING, [4, 5, 6, 7]))
    ledger.apply_pod(running("right", RING, [8, 9, 10, 11]))
    entry = ledger.nodes[RING]
    base, occupants = ledger.eviction_view(Claimant(), RING)
    eviction = plan_eviction(
        entry.topology, base, NeuronRequest(NEURON, 7), ANY_PRIORITY, occupants
    )
    assert eviction is not None and 5 not in eviction.block.devices, eviction


def test_a_block_held_for_a_nominated_pod_never_takes_a_failed_device() -> None:
    # The pod on 4-7 is leaving: a nominated 4-device pod's block would be held where it fits
    # once that pod has gone. With device 5 failed nothing of 4-7 is a block: nothing is held,
    # and no event promises it 4-7.
    events: list[str] = []
    ledger = Ledger(Catalog.builtin(), report=lambda ref, reason, text, warn: events.append(text))
    ledger.replace_nodes([node(RING, "inf2.48xlarge", failed=[5])])
    leaving = running("leaving", RING, [4, 5, 6, 7])
    leaving.metadata.deletionTimestamp = "2026-11-28T00:00:00Z"
    waiting = pod("waiting", {NEURON: 4})
    waiting.status.nominatedNodeName = RING
    waiting.spec.priority = 100
    pods = [running("left", RING, [0, 1, 2, 3]), running("right", RING, [8, 9, 10, 11])]
    ledger.replace_pods([*pods, leaving, waiting])
    bound = 0
    for holding in ledger.pods_holding(RING).values():
        bound |= holding.cores
    assert ledger.state(RING).used_cores == bound  # nothing held beyond the pods
    assert not any("4-7" in text for text in events), events


def test_a_torus_with_a_failed_device_offers_only_the_groups_that_avoid_it() -> None:
    ledger = ledger_with(torus_failed=[5])
    rows = set()
    for _ in range(3):
        placed = place(ledger, TORUS, 4)
        assert isinstance(placed, Placement)
        rows.add(placed.devices[0] // 4)
        ledger.apply_pod(running(f"row{len(rows)}", TORUS, list(placed.devices)))
    assert rows == {0, 2, 3}
    refused = ledger.fill_verdicts([TORUS], NeuronRequest(NEURON, 4), Policy.BEST_FIT)
    decision = refused.decisions[TORUS]
    # No 4-row is left but row 1, which the failed device breaks: freeing pods would help.
    assert isinstance(decision, Refusal) and not decision.unresolvable
    assert "(device 5 failed)" in decision.reason
    # 16 devices can never fit while device 5 is failed: kube-scheduler preempts nothing for it.
    whole = ledger_with(torus_failed=[5]).fill_verdicts(
        [TORUS], NeuronRequest(NEURON, 16), Policy.BEST_FIT
    )
    assert isinstance(whole.decisions[TORUS], Refusal) and whole.decisions[TORUS].unresolvable
    half = place(ledger_with(torus_failed=[5]), TORUS, 8)
    assert isinstance(half, Placement) and half.devices == tuple(range(8, 16))


def test_a_device_that_recovers_is_usable_at_once_and_the_waker_hears_of_it() -> None:
    ledger = ledger_with(failed=[5])
    freed: list[tuple[tuple[str, ...], str]] = []
    ledger.on_freed = lambda nodes, why: freed.append((tuple(nodes), why))
    assert isinstance(place(ledger, RING, 12), str)
    ledger.apply_node(node(RING, "inf2.48xlarge"))
    assert freed == [((RING,), NODE_CHANGED)]
    placed = place(ledger, RING, 12)
    assert isinstance(placed, Placement) and 5 in placed.devices


def test_an_unreadable_health_annotation_is_reported_and_the_count_is_held() -> None:
    reports: list[tuple[ObjectRef, str, str, bool]] = []
    ledger = Ledger(Catalog.builtin(), report=lambda *event: reports.append(event))
    bad = node(RING, "inf2.48xlarge", failed=[5])
    bad.metadata.annotations[UNHEALTHY_DEVICES] = "5,99"  # beyond the node's 12 devices
    ledger.replace_nodes([bad])
    ledger.apply_node(bad)  # said once
    entry = ledger.nodes[RING]
    assert entry.unhealthy_devices == 0 and entry.withheld_cores == 2
    assert [(r[1], r[3]) for r in reports] == [("NeuronHealthUnreadable", True)]
    assert "beyond the node's 12" in reports[0][2]
    huge = node(RING, "inf2.48xlarge")
    huge.metadata.annotations[UNHEALTHY_DEVICES] = "1," * 100_000
    ledger.apply_node(huge)  # bounded before it is parsed
    assert ledger.nodes[RING].unhealthy_devices == 0


def test_metrics_count_failed_devices_and_the_pods_on_them() -> None:
    ledger = ledger_with(failed=[5], torus_failed=[0, 15])
    ledger.apply_pod(running("on-failed", RING, [4, 5, 6, 7]))
    text = generate_latest(Metrics(ledger).registry).decode()
    assert f'neuron_scheduler_node_unhealthy_devices{{node="{RING}"}} 1.0' in text
    assert f'neuron_scheduler_node_unhealthy_devices{{node="{TORUS}"}} 2.0' in text
    assert "neuron_scheduler_pods_on_unhealthy_devices 1.0" in text
    assert f'neuron_scheduler_node_free_devices{{node="{RING}"}} 7.0' in text
    assert f'neuron_scheduler_node_largest_free_block{{node="{TORUS}"}} 4.0' in text
