"""The allocator's rules, one test per rule, with the seed documents' examples."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from neuron_scheduler.core.allocation import (
    NodeState,
    Placement,
    Policy,
    Refusal,
    allocate,
    check_request,
    is_valid_core_set,
    is_valid_device_set,
)
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import ids_mask
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE, NeuronRequest
from neuron_scheduler.core.topology import Topology

TORUS_ROWS = [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
TORUS_HALVES = [tuple(range(8)), tuple(range(8, 16))]


def topo(catalog: Catalog, instance_type: str, cores: int | None = None) -> Topology:
    return catalog.resolve(instance_type, None, cores).topology


def busy(topology: Topology, devices: list[int], cores: Sequence[int] = ()) -> NodeState:
    return NodeState(topology.core_mask_of_devices(ids_mask(devices)) | ids_mask(list(cores)))


def placed(decision: Placement | Refusal) -> Placement:
    assert isinstance(decision, Placement), decision
    return decision


def refused(decision: Placement | Refusal) -> Refusal:
    assert isinstance(decision, Refusal), decision
    return decision


def test_seed_nine_cores_on_empty_four_by_four(catalog: Catalog) -> None:
    t = topo(catalog, "inf1.6xlarge")
    p = placed(allocate(t, NodeState(), NeuronRequest(NEURONCORE, 9)))
    assert p.cores == tuple(range(9))
    assert p.devices == (0, 1, 2)


def test_seed_two_cores_on_second_device(catalog: Catalog) -> None:
    # Seed flow diagram: cores 2,3 live on /dev/neuron1 of a 2-core-per-device node.
    t = topo(catalog, "trn1.32xlarge")
    p = placed(allocate(t, busy(t, [0]), NeuronRequest(NEURONCORE, 2)))
    assert p.cores == (2, 3)
    assert p.devices == (1,)


@pytest.mark.parametrize("count", [2, 3, 5, 6, 7, 9, 12, 15])
def test_torus_refuses_other_counts_with_exact_warning(catalog: Catalog, count: int) -> None:
    for instance_type in ("trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge"):
        t = topo(catalog, instance_type)
        r = refused(allocate(t, NodeState(), NeuronRequest(NEURON, count)))
        assert r.reason == (
            f"Instance type {instance_type} does not support requests for device: {count}. "
            "Please request a different number of devices."
        )
        assert r.unresolvable


def test_torus_four_devices_get_whole_rows(catalog: Catalog) -> None:
    t = topo(catalog, "trn1.32xlarge")
    state = NodeState()
    seen = []
    for _ in range(4):
        p = placed(allocate(t, state, NeuronRequest(NEURON, 4)))
        assert p.devices in TORUS_ROWS
        seen.append(p.devices)
        state = state.with_used(p.core_mask)
    assert sorted(seen) == TORUS_ROWS
    refused(allocate(t, state, NeuronRequest(NEURON, 4)))


def test_torus_never_gives_a_square_or_a_partial_row(catalog: Catalog) -> None:
    t = topo(catalog, "trn1.32xlarge")
    # One device used in every row: no row is whole, so 4 devices cannot be placed at all.
    r = refused(allocate(t, busy(t, [0, 5, 10, 15]), NeuronRequest(NEURON, 4)))
    assert "whole row" in r.reason and not r.unresolvable
    assert not is_valid_device_set(t, [9, 10, 13, 14])
    assert not is_valid_device_set(t, [1, 2])
    assert is_valid_device_set(t, [4, 5, 6, 7])


def test_torus_eight_devices_get_halves(catalog: Catalog) -> None:
    t = topo(catalog, "trn2.48xlarge")
    p = placed(allocate(t, NodeState(), NeuronRequest(NEURON, 8)))
    assert p.devices in TORUS_HALVES
    p2 = placed(allocate(t, NodeState().with_used(p.core_mask), NeuronRequest(NEURON, 8)))
    assert p2.devices in TORUS_HALVES and p2.devices != p.devices
    # A busy device in the first half leaves only the second.
    p3 = placed(allocate(t, busy(t, [3]), NeuronRequest(NEURON, 8)))
    assert p3.devices == TORUS_HALVES[1]


def test_best_fit_single_device_keeps_whole_rows_free(catalog: Catalog) -> None:
    t = topo(catalog, "trn1.32xlarge")
    # Device 5 is used: the next single device goes into its row, not into a whole free row.
    p = placed(allocate(t, busy(t, [5]), NeuronRequest(NEURON, 1)))
    assert p.devices[0] in (4, 6, 7)


def test_one_and_all_are_always_valid(catalog: Catalog) -> None:
    for instance_type in catalog.instance_types:
        t = topo(catalog, instance_type)
        for resource, total in ((NEURON, t.devices), (NEURONCORE, t.total_cores)):
            for count in (1, total):
                p = placed(allocate(t, NodeState(), NeuronRequest(resource, count)))
                assert len(p.cores) == (
                    count if resource == NEURONCORE else count * t.cores_per_device
                )


def test_ring_three_devices_are_contiguous_never_spread(catalog: Catalog) -> None:
    t = topo(catalog, "inf2.48xlarge")
    # Devices 1,3,5,7,9,11 used: three free devices exist, but no three in a row.
    r = refused(allocate(t, busy(t, [1, 3, 5, 7, 9, 11]), NeuronRequest(NEURON, 3)))
    assert r.reason == (
        "needs 3 contiguous devices; largest free contiguous run is 1 device "
        "(free devices: 0,2,4,6,8,10)"
    )
    assert not is_valid_device_set(t, [0, 2, 4])
    assert is_valid_device_set(t, [0, 1, 2])


def test_ring_wraps_around_where_the_link_exists(catalog: Catalog) -> None:
    ring = topo(catalog, "inf2.48xlarge")
    p = placed(allocate(ring, busy(ring, list(range(2, 11))), NeuronRequest(NEURON, 3)))
    assert p.devices == (11, 0, 1)
    assert p.cores == (22, 23, 0, 1, 2, 3)


def test_chain_never_wraps(catalog: Catalog) -> None:
    chain = topo(catalog, "inf1.24xlarge")
    r = refused(allocate(chain, busy(chain, list(range(2, 15))), NeuronRequest(NEURON, 3)))
    assert "largest free contiguous run is 2" in r.reason
    assert not is_valid_device_set(chain, [15, 0, 1])


def test_best_fit_takes_the_smallest_free_block_that_fits(catalog: Catalog) -> None:
    t = topo(catalog, "inf2.48xlarge")
    # Free runs: 0-4 (5 long) and 6-8 (3 long). Three devices go into the exact 3-run.
    state = busy(t, [5, 9, 10, 11])
    p = placed(allocate(t, state, NeuronRequest(NEURON, 3)))
    assert p.devices == (6, 7, 8)
    assert p.score == 10
    # First-fit takes the first run from device 0 instead.
    f = placed(allocate(t, state, NeuronRequest(NEURON, 3), Policy.FIRST_FIT))
    assert f.devices == (0, 1, 2)


def test_best_fit_places_at_the_edge_of_a_run(catalog: Catalog) -> None:
    t = topo(catalog, "inf2.48xlarge")
    p = placed(allocate(t, busy(t, [5]), NeuronRequest(NEURON, 3)))
    assert p.devices in ((2, 3, 4), (6, 7, 8))


def test_device_request_cannot_use_a_device_with_a_core_in_use(catalog: Catalog) -> None:
    t = topo(catalog, "inf1.6xlarge")
    p = placed(allocate(t, busy(t, [], [1]), NeuronRequest(NEURON, 3)))
    assert p.devices == (1, 2, 3)
    refused(allocate(t, busy(t, [], [1, 12]), NeuronRequest(NEURON, 3)))


def test_device_request_takes_all_cores(catalog: Catalog) -> None:
    t = topo(catalog, "trn2.48xlarge")
    p = placed(allocate(t, NodeState(), NeuronRequest(NEURONDEVICE, 1)))
    assert len(p.cores) == 4 and p.cores == tuple(range(p.devices[0] * 4, p.devices[0] * 4 + 4))


def test_core_requests_pack_into_partly_used_devices(catalog: Catalog) -> None:
    t = topo(catalog, "inf1.6xlarge")
    p = placed(allocate(t, busy(t, [], [0, 1]), NeuronRequest(NEURONCORE, 2)))
    assert p.cores == (2, 3)


def test_core_span_on_torus_stays_inside_one_group(catalog: Catalog) -> None:
    t = topo(catalog, "trn1.32xlarge")
    # Cores 0-5 used: 3 more cores fit on devices 3 (cores 6,7) and 4 (core 8)? No: {3,4} crosses
    # rows, so the allocator must pick a span inside one row.
    p = placed(allocate(t, busy(t, [], list(range(6))), NeuronRequest(NEURONCORE, 3)))
    rows = {d // 4 for d in p.devices}
    assert len(rows) == 1
    assert is_valid_core_set(t, p.cores)
    assert not is_valid_core_set(t, [6, 7, 8])
    assert not is_valid_core_set(t, [0, 2])


def test_core_placement_on_trn2_follows_advertised_capacity(catalog: Catalog) -> None:
    lnc2 = topo(catalog, "trn2.48xlarge", 64)
    lnc1 = topo(catalog, "trn2.48xlarge", 128)
    assert (lnc2.cores_per_device, lnc1.cores_per_device) == (4, 8)
    p = placed(allocate(lnc1, NodeState(), NeuronRequest(NEURONCORE, 8)))
    assert p.devices == (0,) and p.cores == tuple(range(8))
    p = placed(allocate(lnc2, NodeState(), NeuronRequest(NEURONCORE, 8)))
    assert p.devices == (0, 1)


def test_requests_above_the_node_are_unresolvable(catalog: Catalog) -> None:
    t = topo(catalog, "inf2.24xlarge")
    r = check_request(t, NeuronRequest(NEURON, 7))
    assert r is not None and r.unresolvable and "has 6" in r.reason
    r = check_request(t, NeuronRequest(NEURONCORE, 13))
    assert r is not None and r.unresolvable
    assert check_request(t, NeuronRequest(NEURON, 6)) is None


def test_full_node_is_a_resolvable_refusal(catalog: Catalog) -> None:
    t = topo(catalog, "inf2.24xlarge")
    r = refused(allocate(t, busy(t, list(range(6))), NeuronRequest(NEURON, 1)))
    assert not r.unresolvable


def test_unattributed_cores_stay_free(catalog: Catalog) -> None:
    t = topo(catalog, "inf1.6xlarge")
    # 8 cores are held by pods whose ids we do not know: only 8 of 16 cores may be handed out.
    refused(allocate(t, NodeState(0, 8), NeuronRequest(NEURONCORE, 9)))
    placed(allocate(t, NodeState(0, 8), NeuronRequest(NEURONCORE, 8)))
    r = refused(allocate(t, NodeState(0, 8), NeuronRequest(NEURON, 3)))
    # In the unit each count names: 8 cores held leave 2 devices, not "8 held".
    assert r.reason == "needs 3 devices; only 2 devices free (8 cores held with ids unknown)"


def test_core_refusal_reason_names_the_largest_run(catalog: Catalog) -> None:
    t = topo(catalog, "inf1.6xlarge")
    r = refused(allocate(t, busy(t, [], [3, 7, 11, 15]), NeuronRequest(NEURONCORE, 4)))
    assert r.reason == (
        "needs 4 contiguous cores; largest free contiguous core run is 3 cores "
        "(free cores: 0-2,4-6,8-10,12-14)"
    )


def test_switch_allows_any_set(catalog: Catalog) -> None:
    t = catalog.resolve("trn3.48xlarge", 16, 128).topology
    assert t.devices == 16 and t.cores_per_device == 8
    p = placed(allocate(t, busy(t, [0, 2, 4]), NeuronRequest(NEURON, 5)))
    assert p.devices == (1, 3, 5, 6, 7)
    assert is_valid_device_set(t, [0, 2, 4])


def test_decisions_are_deterministic(catalog: Catalog) -> None:
    t = topo(catalog, "inf2.48xlarge")
    state = busy(t, [3, 8])
    first = allocate(t, state, NeuronRequest(NEURON, 2))
    assert all(allocate(t, state, NeuronRequest(NEURON, 2)) == first for _ in range(5))


def test_scores_prefer_tight_fits(catalog: Catalog) -> None:
    t = topo(catalog, "inf2.48xlarge")
    empty = placed(allocate(t, NodeState(), NeuronRequest(NEURON, 2)))
    tight = placed(allocate(t, busy(t, list(range(2, 12))), NeuronRequest(NEURON, 2)))
    assert 0 < empty.score < tight.score == 10
