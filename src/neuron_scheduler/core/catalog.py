"""The instance-type catalog: built-in YAML data, optionally overridden by a user's YAML file."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import msgspec

from neuron_scheduler.core.ids import ids_mask, parse_id_ranges
from neuron_scheduler.core.topology import (
    MAX_CORES_PER_DEVICE,
    MAX_DEVICES,
    Topology,
    TopologyKind,
)
from neuron_scheduler.core.yamlfile import decode_yaml, read_yaml

INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


class CatalogError(ValueError):
    """A catalog or topology file that cannot be used; the message names the file and the field."""


class CapacityError(ValueError):
    """Advertised Neuron capacity that cannot be right for the node (beyond what its type has,
    beyond the ceilings for types the catalog does not fix, or not whole per device): the node is
    left unused, with this reason, rather than modelled from numbers anyone could write."""

    def __init__(self, reason: str, code: str) -> None:
        super().__init__(reason)
        self.code = code  # a short label for metrics: beyond_type, beyond_ceiling, inconsistent


class InstanceTypeSpec(msgspec.Struct, forbid_unknown_fields=True):
    topology: TopologyKind
    cores_per_device: int
    devices: int | None = None
    groups: dict[int, list[str]] = {}
    # Physical cores per device: the most a node may advertise (Trn2 at LNC=1). Default: the
    # logical `cores_per_device`.
    max_cores_per_device: int | None = None


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
        for name, spec in self._specs.items():
            most = spec.max_cores_per_device
            if most is not None and not spec.cores_per_device <= most <= MAX_CORES_PER_DEVICE:
                raise CatalogError(
                    f"instance type {name}: max_cores_per_device must be "
                    f"{spec.cores_per_device}-{MAX_CORES_PER_DEVICE}, got {most}"
                )
            self._build(name, None, None)

    @classmethod
    def builtin(cls) -> Catalog:
        return _builtin()

    @classmethod
    def load(cls, override: Path | None = None) -> Catalog:
        """The built-in catalog, with the instance types of `override` added or replaced."""
        specs = dict(_builtin()._specs)
        if override is not None:
            specs.update(
                read_yaml(override, CatalogFile, CatalogError, "topology file").instance_types
            )
        return cls(specs)

    def knows(self, instance_type: str) -> bool:
        return instance_type in self._specs

    @property
    def instance_types(self) -> list[str]:
        return sorted(self._specs)

    def device_count(self, instance_type: str) -> int | None:
        """The devices a known type has; None when the node's own capacity says (switches)."""
        return self._specs[instance_type].devices

    def resolve(
        self,
        instance_type: str,
        device_capacity: int | None = None,
        core_capacity: int | None = None,
    ) -> Resolved:
        """The topology of a node from its instance-type label and advertised Neuron capacity.

        Cores per device come from the capacity (neuroncore / neuron) because Trn2's Logical
        NeuronCore setting changes it per node; the catalog's figure is the fallback. Capacity
        that cannot be right raises CapacityError: devices other than the type has, more cores
        per device than it has physically, cores that do not divide among the devices, or (for
        types the catalog does not fix) more than MAX_DEVICES devices of MAX_CORES_PER_DEVICE.
        """
        return self._resolve(instance_type, device_capacity, core_capacity)

    @lru_cache(maxsize=1024)  # noqa: B019 - catalogs live as long as the process
    def _resolve(
        self, instance_type: str, device_capacity: int | None, core_capacity: int | None
    ) -> Resolved:
        if instance_type in self._specs:
            return Resolved(self._build(instance_type, device_capacity, core_capacity))
        devices = _checked_devices(instance_type, device_capacity, None)
        cores = _checked_cores(instance_type, devices, core_capacity, 1, MAX_CORES_PER_DEVICE)
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
        devices = _checked_devices(name, device_capacity, spec.devices)
        most = spec.max_cores_per_device or spec.cores_per_device
        cores = _checked_cores(name, devices, core_capacity, spec.cores_per_device, most)
        try:
            groups = tuple(
                (size, tuple(ids_mask(parse_id_ranges(text)) for text in sets))
                for size, sets in sorted(spec.groups.items())
            )
            return Topology(name, spec.topology, devices, cores, groups)
        except ValueError as error:
            raise CatalogError(f"instance type {name}: {error}") from error


def _checked_devices(name: str, advertised: int | None, fixed: int | None) -> int:
    """The node's device count: the catalog's when it fixes one (the node must agree), else the
    node's own, up to MAX_DEVICES."""
    if fixed is not None:
        if advertised is not None and advertised != fixed:
            raise CapacityError(
                f"advertises {advertised} Neuron devices, but {name} has {fixed}",
                "beyond_type" if advertised > fixed else "inconsistent",
            )
        return fixed
    devices = advertised or 1
    if devices > MAX_DEVICES:
        raise CapacityError(
            f"advertises {devices} Neuron devices; neuron-scheduler models at most {MAX_DEVICES}",
            "beyond_ceiling",
        )
    return devices


def _checked_cores(name: str, devices: int, advertised: int | None, default: int, most: int) -> int:
    """Cores per device from the node's core capacity (default when it advertises none)."""
    if advertised is None:
        return default
    if advertised % devices or advertised < devices:
        raise CapacityError(
            f"advertises {advertised} NeuronCores on {devices} devices: not a whole number "
            "per device",
            "inconsistent",
        )
    cores = advertised // devices
    if cores > most:
        raise CapacityError(
            f"advertises {cores} NeuronCores per device; {name} has at most {most}",
            "beyond_type" if most < MAX_CORES_PER_DEVICE else "beyond_ceiling",
        )
    return cores


@lru_cache(maxsize=1)
def _builtin() -> Catalog:
    data = resources.files("neuron_scheduler.core").joinpath("catalog.yaml").read_bytes()
    return Catalog(decode_yaml(data, CatalogFile, "built-in catalog", CatalogError).instance_types)
