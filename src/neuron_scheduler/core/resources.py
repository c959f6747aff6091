"""What a pod asks for: Neuron resource names, and a pod's request built from its containers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

NEURON = "aws.amazon.com/neuron"
# Our DRA driver's default name (the chart's dra.driverName): its devices, the same Neuron
# devices, when a node uses Dynamic Resource Allocation instead of the device plugin.
DRA_DRIVER = "neuron.neuron-scheduler.io"
NEURONCORE = "aws.amazon.com/neuroncore"
NEURONDEVICE = "aws.amazon.com/neurondevice"  # deprecated upstream, still accepted


class Unit(StrEnum):
    DEVICE = "device"
    CORE = "core"


RESOURCE_UNITS: dict[str, Unit] = {
    NEURON: Unit.DEVICE,
    NEURONDEVICE: Unit.DEVICE,
    NEURONCORE: Unit.CORE,
}
RESOURCE_ALIASES: dict[str, str] = {
    "neuron": NEURON,
    "neuroncore": NEURONCORE,
    "neurondevice": NEURONDEVICE,
    "device": NEURON,
    "core": NEURONCORE,
}


class RequestError(ValueError):
    """A pod or command-line request that can never be served as written."""


def resource_name(text: str) -> str:
    """Accepts the full resource name or its short form (`neuroncore`)."""
    name = RESOURCE_ALIASES.get(text, text)
    if name not in RESOURCE_UNITS:
        known = ", ".join(sorted(RESOURCE_UNITS))
        raise RequestError(f"unknown Neuron resource {text!r}; expected one of {known}")
    return name


@dataclass(frozen=True, slots=True)
class NeuronRequest:
    resource: str
    count: int
    # The pod's count split per app container, in container order; containers asking for none
    # get 0. Empty means one container (or a request not tied to a pod).
    per_container: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.resource not in RESOURCE_UNITS:
            raise RequestError(f"unknown Neuron resource {self.resource!r}")
        if self.count < 1:
            raise RequestError(f"{self.resource}: count must be at least 1, got {self.count}")
        if self.per_container and sum(self.per_container) != self.count:
            raise RequestError("per-container counts do not add up to the pod's count")

    @property
    def unit(self) -> Unit:
        return RESOURCE_UNITS[self.resource]

    def describe(self) -> str:
        return f"{self.count} {self.unit.value}{'s' if self.count != 1 else ''} ({self.resource})"


def pod_request(
    containers: Sequence[Mapping[str, int]], init_containers: Sequence[Mapping[str, int]] = ()
) -> NeuronRequest | None:
    """The pod's Neuron request from each container's Neuron resource counts.

    Like kube-scheduler, the pod needs max(sum of app containers, largest init container): init
    containers run one at a time before the app containers and reuse the same ids.
    Raises RequestError when the pod mixes Neuron resource kinds: one allocation cannot be both
    devices and cores, and the device plugin could not tell which ids belong to which resource.
    """
    names = {
        name
        for counts in (*containers, *init_containers)
        for name, value in counts.items()
        if name in RESOURCE_UNITS and value
    }
    if not names:
        return None
    if len(names) > 1:
        raise RequestError(
            "pod requests more than one Neuron resource kind ("
            + ", ".join(sorted(names))
            + "); request only one of them for all containers"
        )
    (name,) = names
    for counts in (*containers, *init_containers):
        value = counts.get(name, 0)
        if value < 0:
            raise RequestError(f"{name}: negative count {value}")
    split = tuple(counts.get(name, 0) for counts in containers)
    total = max(sum(split), max((c.get(name, 0) for c in init_containers), default=0))
    if total != sum(split):
        # An init container needs more than all app containers together: the app containers
        # still get their own slices; the remainder is held for the pod as a whole.
        split = (*split, total - sum(split))
    return NeuronRequest(name, total, split if len(split) > 1 else ())
