"""The ResourceSlices the DRA driver publishes: every catalog type within resource.k8s.io/v1's
limits, counters that stand for physical devices, attributes, names in first-fit order."""

from __future__ import annotations

import copy

import pytest

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.topology import MAX_DEVICES, Topology, TopologyKind
from neuron_scheduler.dra import DEFAULT_CORE_WINDOWS
from neuron_scheduler.dra.devicegroups import pairing
from neuron_scheduler.dra.shapes import (
    EVERY_CORE_WINDOW,
    ShapeKind,
    core_windows_fit,
    published_shapes,
)
from neuron_scheduler.dra.slices import (
    NodeInventory,
    SliceContent,
    id_text,
    limit_problems,
    pool_slices,
    slice_prefix,
)

DRIVER = "neuron.example.com"
CATALOG = Catalog.builtin()
SWITCH_DEVICES = 16


def topology_of(instance_type: str, devices: int | None = None) -> Topology:
    return CATALOG.resolve(
        instance_type, devices or CATALOG.device_count(instance_type) or SWITCH_DEVICES
    ).topology


def devices_of(slices: list[SliceContent]) -> list[dict]:  # type: ignore[type-arg]
    return [d for s in slices for d in s.devices]


@pytest.mark.parametrize("core_windows", [(), DEFAULT_CORE_WINDOWS, EVERY_CORE_WINDOW])
@pytest.mark.parametrize("instance_type", CATALOG.instance_types)
def test_every_catalog_type_fits_the_api_limits(
    instance_type: str, core_windows: tuple[int, ...]
) -> None:
    topology = topology_of(instance_type)
    inventory = NodeInventory(
        "ip-10-0-1-7.ec2.internal", topology, pairing(instance_type), core_windows=core_windows
    )
    slices = pool_slices(DRIVER, inventory)
    assert limit_problems(slices) == []
    # Also with every device unhealthy (each shape then carries a taint).
    sick = NodeInventory(
        inventory.node, topology, None, dict.fromkeys(range(topology.devices), "x"), core_windows
    )
    assert limit_problems(pool_slices(DRIVER, sick)) == []
    assert len(devices_of(slices)) == len(published_shapes(topology, core_windows))


@pytest.mark.parametrize("kind", [TopologyKind.RING, TopologyKind.CHAIN])
def test_the_largest_node_modelled_fits_too(kind: TopologyKind) -> None:
    """A catalog override may define a ring of MAX_DEVICES (4,033 shapes): split into more
    slices, each within 64 devices, 2 counter sets and 2,048 consumed counters."""
    topology = Topology("big.ring", kind, MAX_DEVICES, 2)
    slices = pool_slices(DRIVER, NodeInventory("n", topology))
    assert limit_problems(slices) == []
    counters = slices[0].shared_counters
    assert [len(s["counters"]) for s in counters] == [32, 32]
    assert sum(len(s.devices) for s in slices) == len(published_shapes(topology))


def test_limit_check_can_fail() -> None:
    slices = pool_slices(DRIVER, NodeInventory("n", topology_of("inf2.48xlarge")))
    crowded = SliceContent("crowded", devices=slices[1].devices + slices[2].devices)
    assert any("128 devices (at most 64)" in p for p in limit_problems([slices[0], crowded]))
    broken = copy.deepcopy(slices[1].devices[0])
    broken["consumesCounters"][0]["counters"]["d99"] = {"value": "1"}
    assert any(
        "unknown counter d99" in p
        for p in limit_problems([slices[0], SliceContent("b", devices=(broken,))])
    )


def test_inf2_counts_and_a_wrapping_window() -> None:
    topology = topology_of("inf2.48xlarge")
    slices = pool_slices(DRIVER, NodeInventory("node-a", topology))
    assert [len(s.devices) for s in slices] == [0, 64, 64, 5]  # 12 x 11 windows + the ring
    (counter_set,) = slices[0].shared_counters
    assert counter_set["name"] == "neuron-devices-0"
    # A device's counter is worth its cores: a device set takes it all.
    assert counter_set["counters"] == {f"d{d}": {"value": "2"} for d in range(12)}
    device = {d["name"]: d for d in devices_of(slices)}["window-3-at-11"]
    assert device["attributes"]["members"] == {"string": "11,0,1"}
    assert device["attributes"]["deviceIds"] == {"string": "0,1,11"}
    assert device["attributes"]["size"] == {"int": 3}
    assert device["attributes"]["shape"] == {"string": "window"}
    assert device["attributes"]["instanceType"] == {"string": "inf2.48xlarge"}
    assert device["consumesCounters"] == [
        {
            "counterSet": "neuron-devices-0",
            "counters": {"d11": {"value": "2"}, "d0": {"value": "2"}, "d1": {"value": "2"}},
        }
    ]
    assert not any(k.startswith("resource.aws.com/") for k in device["attributes"])


def test_chains_do_not_wrap_and_torus_has_only_its_groups() -> None:
    chain = {
        d["name"]
        for d in devices_of(pool_slices(DRIVER, NodeInventory("n", topology_of("inf1.24xlarge"))))
    }
    assert "window-3-at-13" in chain and "window-3-at-14" not in chain
    assert len(chain) == 16 * 17 // 2
    torus = devices_of(pool_slices(DRIVER, NodeInventory("n", topology_of("trn1.32xlarge"))))
    shapes = {d["name"]: d["attributes"]["members"]["string"] for d in torus}
    assert len(shapes) == 23
    assert shapes["row-1"] == "4,5,6,7" and shapes["half-1"] == "8,9,10,11,12,13,14,15"
    assert shapes["all"] == ",".join(map(str, range(16)))
    assert {d["attributes"]["shape"]["string"] for d in torus} == {"single", "row", "half", "whole"}


def test_single_device_nodes_need_no_counters() -> None:
    slices = pool_slices(DRIVER, NodeInventory("n", topology_of("inf2.xlarge")))
    (only,) = slices
    (device,) = only.devices
    assert device["name"] == "single-0" and "consumesCounters" not in device
    assert device["attributes"]["deviceId"] == {"int": 0}
    assert "sharedCounters" not in only.spec(DRIVER, "n", 1, 1)


def test_slice_names_sort_in_shape_order() -> None:
    """The allocator walks slices by name and devices in order: that order is ours."""
    slices = pool_slices(DRIVER, NodeInventory("node-a", topology_of("inf1.24xlarge")))
    names = [s.name for s in slices]
    assert names == sorted(names)
    assert names[0] == "node-a-neuron.example.com-counters"
    walked = [d["name"] for s in sorted(slices, key=lambda s: s.name) for d in s.devices]
    assert walked == [s.name for s in published_shapes(topology_of("inf1.24xlarge"))]


def test_spec_is_a_counter_slice_or_a_device_slice() -> None:
    slices = pool_slices(DRIVER, NodeInventory("node-a", topology_of("trn2.48xlarge")))
    counters = slices[0].spec(DRIVER, "node-a", 3, 2)
    assert counters == {
        "driver": DRIVER,
        "nodeName": "node-a",
        "pool": {"name": "node-a", "generation": 3, "resourceSliceCount": 2},
        "sharedCounters": list(slices[0].shared_counters),
    }
    assert "sharedCounters" not in slices[1].spec(DRIVER, "node-a", 3, 2)


def test_unhealthy_devices_taint_every_shape_holding_them() -> None:
    topology = topology_of("trn1.32xlarge")
    slices = pool_slices(DRIVER, NodeInventory("n", topology, unhealthy={5: "gone"}))
    tainted = {d["name"] for d in devices_of(slices) if d.get("taints")}
    assert tainted == {"single-5", "row-1", "half-0", "all"}
    taint = next(d for d in devices_of(slices) if d["name"] == "row-1")["taints"]
    assert taint == [{"key": f"{DRIVER}/unhealthy", "value": "neuron5", "effect": "NoSchedule"}]


def test_fingerprint_follows_content() -> None:
    topology = topology_of("trn1.32xlarge")
    healthy = pool_slices(DRIVER, NodeInventory("n", topology))
    again = pool_slices(DRIVER, NodeInventory("n", topology))
    sick = pool_slices(DRIVER, NodeInventory("n", topology, unhealthy={0: "x"}))
    assert [s.fingerprint for s in healthy] == [s.fingerprint for s in again]
    assert healthy[1].fingerprint != sick[1].fingerprint
    assert healthy[0].fingerprint == sick[0].fingerprint


def test_long_node_names_keep_names_valid_and_distinct() -> None:
    long_a, long_b = "a" * 250 + "x", "a" * 250 + "y"
    prefix_a, prefix_b = slice_prefix(DRIVER, long_a), slice_prefix(DRIVER, long_b)
    assert prefix_a != prefix_b
    slices = pool_slices(DRIVER, NodeInventory(long_a, topology_of("inf2.48xlarge")))
    assert limit_problems(slices) == []
    assert all(len(s.name) <= 253 for s in slices)


def test_efa_group_attributes_on_trn2() -> None:
    topology = topology_of("trn2.48xlarge")
    slices = pool_slices(DRIVER, NodeInventory("n", topology, pairing("trn2.48xlarge")))
    attributes = {d["name"]: d["attributes"] for d in devices_of(slices)}
    group = "resource.aws.com/devicegroup{}_id"
    assert attributes["single-0"][group.format(1)] == {"string": "0000:c9:00.0"}
    assert attributes["single-0"][group.format(4)] == {"string": "13713e551cd37c19"}
    assert attributes["row-0"][group.format(4)] == {"string": "13713e551cd37c19"}
    assert attributes["row-0"][group.format(8)] == {"string": "3593812b8066a078"}
    assert group.format(1) not in attributes["row-0"]
    assert attributes["half-1"][group.format(8)] == {"string": "614e16dab9ba2f1f"}
    assert group.format(4) not in attributes["half-1"]
    assert attributes["all"] == {
        **{k: v for k, v in attributes["all"].items() if not k.startswith("resource.aws.com")},
        group.format(16): {"string": "821d14afaf11327d"},
    }
    assert all(s.kind is not ShapeKind.WINDOW for s in published_shapes(topology))


def test_core_windows_beside_the_device_sets_on_inf2() -> None:
    topology = topology_of("inf2.48xlarge")
    slices = pool_slices(DRIVER, NodeInventory("node-a", topology, core_windows=(1, 2, 3, 4)))
    devices = {d["name"]: d for d in devices_of(slices)}
    # 133 device sets, then windows of 1-4 cores: 24 + 23 + 22 + 21.
    assert len(devices) == 133 + 90
    assert [d["name"] for d in devices_of(slices)][133:136] == [
        "cores-1-at-0",
        "cores-1-at-1",
        "cores-1-at-2",
    ]
    devices_set, cores_set = slices[0].shared_counters
    assert devices_set["name"] == "neuron-devices-0" and len(devices_set["counters"]) == 12
    assert cores_set == {
        "name": "neuron-cores-0",
        "counters": {f"c{c}": {"value": "1"} for c in range(24)},
    }
    window = devices["cores-3-at-1"]
    assert window["attributes"]["size"] == {"int": 0}  # no `neuron-N` class matches it
    assert window["attributes"]["cores"] == {"int": 3}
    assert window["attributes"]["coreIds"] == {"string": "1,2,3"}
    assert window["attributes"]["shape"] == {"string": "cores"}
    assert window["attributes"]["members"] == {"string": "0,1"}
    assert window["consumesCounters"] == [
        {
            "counterSet": "neuron-devices-0",
            "counters": {"d0": {"value": "1"}, "d1": {"value": "2"}},
        },
        {
            "counterSet": "neuron-cores-0",
            "counters": {"c1": {"value": "1"}, "c2": {"value": "1"}, "c3": {"value": "1"}},
        },
    ]
    # Of each count, the windows inside one device come first: they break no second device.
    twos = [n for n in devices if n.startswith("cores-2-")]
    assert twos[:3] == ["cores-2-at-0", "cores-2-at-2", "cores-2-at-4"]
    assert twos[12] == "cores-2-at-1"


def test_core_windows_on_a_torus_stay_in_a_row_or_half() -> None:
    """trn1: 2 cores a device; a window over 2-4 devices stays in one row, over 5-8 in a half."""
    names = {s.name for s in published_shapes(topology_of("trn1.32xlarge"), EVERY_CORE_WINDOW)}
    assert "cores-2-at-1" in names  # devices 0 and 1, row 0
    assert "cores-2-at-7" not in names  # devices 3 and 4: two rows
    assert "cores-9-at-0" in names and "cores-9-at-8" not in names  # devices 4-8: two halves
    assert "cores-16-at-0" in names and "cores-16-at-16" in names and "cores-16-at-8" not in names


def test_trn2_at_lnc1_has_128_cores_in_four_sets() -> None:
    topology = CATALOG.resolve("trn2.48xlarge", 16, 128).topology
    slices = pool_slices(DRIVER, NodeInventory("n", topology, core_windows=EVERY_CORE_WINDOW))
    assert limit_problems(slices) == []
    names = [s["name"] for s in slices[0].shared_counters]
    assert names == ["neuron-devices-0", *(f"neuron-cores-{k}" for k in range(4))]
    windows = {d["name"] for d in devices_of(slices) if d["name"].startswith("cores-")}
    assert "cores-32-at-32" in windows and "cores-8-at-120" in windows
    assert "cores-2-at-31" not in windows  # across two sets of core counters


def test_no_core_windows_where_the_counters_cannot_hold_them() -> None:
    """More than 32 devices: device counters fill two sets, a window may draw on only two."""
    topology = Topology("big.ring", TopologyKind.RING, 40, 2)
    assert not core_windows_fit(topology)
    assert all(s.kind is not ShapeKind.CORES for s in published_shapes(topology, (1, 2)))


def test_a_single_device_node_with_core_windows_counts_them() -> None:
    slices = pool_slices(
        DRIVER, NodeInventory("n", topology_of("inf2.xlarge"), core_windows=(1, 2))
    )
    assert [d["name"] for d in devices_of(slices)] == [
        "single-0",
        "cores-1-at-0",
        "cores-1-at-1",
        "cores-2-at-0",
    ]
    assert slices[0].shared_counters and limit_problems(slices) == []


def test_long_id_lists_become_ranges_in_member_order() -> None:
    assert id_text((11, 0, 1)) == "11,0,1"
    long = tuple(range(54, 64)) + tuple(range(22))
    assert id_text(long) == "54-63,0-21"
