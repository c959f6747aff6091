"""ResourceSliceTemplates per instance type (dra/templates): the driver's own slices, without a
node, one pool per type, within resource.k8s.io/v1's limits."""

from __future__ import annotations

import pytest

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.dra import DEFAULT_CORE_WINDOWS
from neuron_scheduler.dra.shapes import published_shapes
from neuron_scheduler.dra.slices import NodeInventory, SliceContent, limit_problems, pool_slices
from neuron_scheduler.dra.templates import slice_templates

CATALOG = Catalog.builtin()
DRIVER = "neuron.neuron-scheduler.io"


def test_every_fixed_type_gets_the_slices_its_node_would_publish() -> None:
    templates = slice_templates(CATALOG, DRIVER)
    assert "trn3.48xlarge" not in templates  # sized by its node: no template
    for name, specs in templates.items():
        topology = CATALOG.resolve(name).topology
        inventory = NodeInventory(name, topology, core_windows=DEFAULT_CORE_WINDOWS)
        published = pool_slices(DRIVER, inventory)
        assert len(specs) == len(published)
        for spec, content in zip(specs, published, strict=True):
            assert "nodeName" not in spec
            assert spec["pool"] == {"name": name, "generation": 0, "resourceSliceCount": len(specs)}
            assert spec.get("devices", []) == list(content.devices)
            assert spec.get("sharedCounters", []) == list(content.shared_counters)
        devices = [d for s in specs for d in s.get("devices", [])]
        assert len(devices) == len(published_shapes(topology, DEFAULT_CORE_WINDOWS))
        assert (
            limit_problems(
                [
                    SliceContent(
                        str(i), tuple(s.get("sharedCounters", ())), tuple(s.get("devices", ()))
                    )
                    for i, s in enumerate(specs)
                ]
            )
            == []
        )


def test_an_inf2_48xlarge_has_one_counter_slice_and_every_window() -> None:
    (counters, *device_slices) = slice_templates(CATALOG, DRIVER, ["inf2.48xlarge"])[
        "inf2.48xlarge"
    ]
    assert [c["name"] for c in counters["sharedCounters"]] == ["neuron-devices-0", "neuron-cores-0"]
    names = {d["name"] for s in device_slices for d in s["devices"]}
    assert {"window-4-at-0", "window-3-at-11", "all", "cores-2-at-0", "cores-16-at-8"} <= names
    # Without core windows (the driver's --core-windows ''): the device sets alone.
    (counters, *_) = slice_templates(CATALOG, DRIVER, ["inf2.48xlarge"], ())["inf2.48xlarge"]
    assert [c["name"] for c in counters["sharedCounters"]] == ["neuron-devices-0"]


def test_a_type_of_no_fixed_size_is_refused() -> None:
    with pytest.raises(ValueError, match="fixed size"):
        slice_templates(CATALOG, DRIVER, ["trn3.48xlarge"])
