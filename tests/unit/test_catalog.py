from __future__ import annotations

from pathlib import Path

import pytest

from neuron_scheduler.core.catalog import CapacityError, Catalog, CatalogError
from neuron_scheduler.core.topology import TopologyKind

EXPECTED = {
    "inf1.xlarge": (1, 4, TopologyKind.SINGLE),
    "inf1.2xlarge": (1, 4, TopologyKind.SINGLE),
    "inf1.6xlarge": (4, 4, TopologyKind.CHAIN),
    "inf1.24xlarge": (16, 4, TopologyKind.CHAIN),
    "inf2.xlarge": (1, 2, TopologyKind.SINGLE),
    "inf2.8xlarge": (1, 2, TopologyKind.SINGLE),
    "inf2.24xlarge": (6, 2, TopologyKind.RING),
    "inf2.48xlarge": (12, 2, TopologyKind.RING),
    "trn1.2xlarge": (1, 2, TopologyKind.SINGLE),
    "trn1.32xlarge": (16, 2, TopologyKind.TORUS),
    "trn1n.32xlarge": (16, 2, TopologyKind.TORUS),
    "trn2.3xlarge": (1, 4, TopologyKind.SINGLE),
    "trn2.48xlarge": (16, 4, TopologyKind.TORUS),
    "trn2u.48xlarge": (16, 4, TopologyKind.TORUS),
}


@pytest.mark.parametrize("instance_type", sorted(EXPECTED))
def test_builtin_catalog_matches_the_facts(catalog: Catalog, instance_type: str) -> None:
    t = catalog.resolve(instance_type).topology
    assert (t.devices, t.cores_per_device, t.kind) == EXPECTED[instance_type]


def test_torus_allowed_counts(catalog: Catalog) -> None:
    t = catalog.resolve("trn1.32xlarge").topology
    assert t.allowed_device_counts == (1, 4, 8, 16)
    assert catalog.resolve("inf2.48xlarge").topology.allowed_device_counts is None


def test_cores_per_device_come_from_capacity(catalog: Catalog) -> None:
    assert catalog.resolve("trn2.48xlarge", 16, 128).topology.cores_per_device == 8
    assert catalog.resolve("trn2.48xlarge", 16, 64).topology.cores_per_device == 4
    # Capacity that does not divide evenly cannot be trusted: the node is unusable (issue 21;
    # the catalog's figure used to stay, modelling a node that says something else).
    with pytest.raises(CapacityError, match="not a whole number per device"):
        catalog.resolve("trn2.48xlarge", 16, 63)


def test_switch_takes_devices_from_capacity(catalog: Catalog) -> None:
    t = catalog.resolve("trn3.48xlarge", 16, 128).topology
    assert (t.kind, t.devices, t.cores_per_device) == (TopologyKind.SWITCH, 16, 8)


def test_unknown_instance_type_is_a_chain_with_a_warning(catalog: Catalog) -> None:
    resolved = catalog.resolve("inf9.huge", 8, 32)
    assert resolved.topology.kind is TopologyKind.CHAIN
    assert (resolved.topology.devices, resolved.topology.cores_per_device) == (8, 4)
    assert resolved.warning is not None and "inf9.huge" in resolved.warning


def test_override_file_adds_and_replaces(tmp_path: Path) -> None:
    path = tmp_path / "topo.yaml"
    path.write_text(
        "instance_types:\n"
        "  inf1.6xlarge: {devices: 4, cores_per_device: 4, topology: ring}\n"
        "  lab.box: {devices: 8, cores_per_device: 2, topology: torus,"
        " groups: {2: ['0-1', '2-3', '4-5', '6-7'], 4: ['0-3', '4-7']}}\n"
    )
    catalog = Catalog.load(path)
    assert catalog.resolve("inf1.6xlarge").topology.kind is TopologyKind.RING
    lab = catalog.resolve("lab.box").topology
    assert lab.allowed_device_counts == (1, 2, 4, 8)
    assert catalog.resolve("inf2.48xlarge").topology.devices == 12


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("instance_types: [", "not valid YAML"),
        ("instance_types:\n  x: {devices: 2, cores_per_device: 2, topology: mesh}", "topology"),
        ("instance_types:\n  x: {devices: two, cores_per_device: 2, topology: chain}", "devices"),
        (
            "instance_types:\n  x: {devices: 4, cores_per_device: 2, topology: torus,"
            " groups: {4: ['0-4']}}",
            "not a set of 4 devices",
        ),
        (
            "instance_types:\n  x: {devices: 4, cores_per_device: 2, topology: torus,"
            " groups: {4: ['4-7']}}",
            "within 0-3",
        ),
        ("instance_types:\n  x: {devices: 2, cores_per_device: 0, topology: chain}", "at least 1"),
        (
            "instance_types:\n  x: {devices: 2, cores_per_device: 2, topology: chain, colour: red}",
            "colour",
        ),
    ],
)
def test_bad_override_files_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "topo.yaml"
    path.write_text(text)
    with pytest.raises(CatalogError, match=message):
        Catalog.load(path)


def test_missing_override_file(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot read topology file"):
        Catalog.load(tmp_path / "nope.yaml")
