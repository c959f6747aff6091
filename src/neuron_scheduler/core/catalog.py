"""The instance-type catalog: built-in YAML data, optionally overridden by a user's YAML file."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import msgspec

from neuron_scheduler.core.ids import ids_mask, parse_id_ranges
from neuron_scheduler.core.topology import Topology, TopologyKind

INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


class CatalogError(ValueError):
    """A catalog or topology file that cannot be used; the message names the file and the field."""


class InstanceTypeSpec(msgspec.Struct, forbid_unknown_fields=True):
    topology: TopologyKind
    cores_per_device: int
    devices: int | None = None
    groups: dict[int, list[str]] = {}


class CatalogFile(msgspec.Struct):
    instance_types: dict[str, InstanceTypeSpec]


@dataclass(frozen=True, slots=True)
class Resolved:
    """A node's topology and what a person should know about how it was derived."""

    topology: Topology
    warning: str | None = None


class Catalog:
    def __init__(self, specs: dict[str, InstanceTypeSpec]) -> None:
        self._specs = dict(specs)
        # Validate every entry now, so a bad file fails at start-up rather than at the first pod.
        for name in self._specs:
            self._build(name, None, None)

    @classmethod
    def builtin(cls) -> Catalog:
        return _builtin()

    @classmethod
    def load(cls, override: Path | None = None) -> Catalog:
        """The built-in catalog, with the instance types of `override` added or replaced."""
        specs = dict(_builtin()._specs)
        if override is not None:
            specs.update(_decode(_read(override), str(override)).instance_types)
        return cls(specs)

    def knows(self, instance_type: str) -> bool:
        return instance_type in self._specs

    @property
    def instance_types(self) -> list[str]:
        return sorted(self._specs)

    def resolve(
        self,
        instance_type: str,
        device_capacity: int | None = None,
        core_capacity: int | None = None,
    ) -> Resolved:
        """The topology of a node from its instance-type label and advertised Neuron capacity.

        Cores per device come from the capacity (neuroncore / neuron) because Trn2's Logical
        NeuronCore setting changes it per node; the catalog's figure is the fallback.
        """
        return self._resolve(instance_type, device_capacity, core_capacity)

    @lru_cache(maxsize=1024)  # noqa: B019 - catalogs live as long as the process
    def _resolve(
        self, instance_type: str, device_capacity: int | None, core_capacity: int | None
    ) -> Resolved:
        if instance_type in self._specs:
            return Resolved(self._build(instance_type, device_capacity, core_capacity))
        devices = device_capacity or 1
        cores = (core_capacity // devices) if core_capacity and core_capacity >= devices else 1
        warning = (
            f"unknown instance type {instance_type!r}: treating its {devices} devices as a "
            "contiguous chain (the most conservative rule); add it with --topology-file"
        )
        topology = Topology(
            instance_type or "<no instance-type label>",
            TopologyKind.CHAIN if devices > 1 else TopologyKind.SINGLE,
            devices,
            cores,
        )
        return Resolved(topology, warning)

    def _build(self, name: str, device_capacity: int | None, core_capacity: int | None) -> Topology:
        spec = self._specs[name]
        devices = spec.devices or device_capacity or 1
        cores = spec.cores_per_device
        if core_capacity and core_capacity >= devices and core_capacity % devices == 0:
            cores = core_capacity // devices
        try:
            groups = tuple(
                (size, tuple(ids_mask(parse_id_ranges(text)) for text in sets))
                for size, sets in sorted(spec.groups.items())
            )
            return Topology(name, spec.topology, devices, cores, groups)
        except ValueError as error:
            raise CatalogError(f"instance type {name}: {error}") from error


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise CatalogError(f"cannot read topology file {path}: {error.strerror}") from error


def _decode(data: bytes, source: str) -> CatalogFile:
    try:
        return msgspec.yaml.decode(data, type=CatalogFile)
    except msgspec.ValidationError as error:
        raise CatalogError(f"{source}: {error}") from error
    except msgspec.DecodeError as error:
        raise CatalogError(f"{source}: not valid YAML: {error}") from error


@lru_cache(maxsize=1)
def _builtin() -> Catalog:
    data = resources.files("neuron_scheduler.core").joinpath("catalog.yaml").read_bytes()
    return Catalog(_decode(data, "built-in catalog").instance_types)
