"""ResourceClaims as the driver (and the extender) read them, and what an allocation means for a
node. Pure.

Only the fields they use, decoded with msgspec; everything is untrusted and bounded. Opaque
per-claim config (`kind: NeuronConfig`) may choose the Logical NeuronCore setting, with AWS's
field name so claims written for AWS's driver keep their meaning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from neuron_scheduler.kube.decoding import decode_any

# The API allows 32 results per claim and 32 config entries per claim plus the classes' own.
MAX_RESULTS = 32
MAX_CONFIGS = 64
CONFIG_KIND = "NeuronConfig"
AWS_CONFIG_API_VERSION = "neuron.aws.com/v1"
LNC_SETTINGS = (1, 2)


class ClaimError(ValueError):
    """A claim this driver cannot prepare; the message goes back to kubelet (and the pod)."""


class ClaimMeta(msgspec.Struct):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    deletionTimestamp: str | None = None


class Opaque(msgspec.Struct):
    driver: str = ""
    parameters: msgspec.Raw = msgspec.Raw(b"null")


class ConfigEntry(msgspec.Struct):
    source: str = ""
    requests: list[str] = []
    opaque: Opaque | None = None


class Result(msgspec.Struct):
    request: str = ""
    driver: str = ""
    pool: str = ""
    device: str = ""
    # Admin access (monitoring): the scheduler gives it devices whether or not other claims
    # hold them, and does not count it as holding them.
    adminAccess: bool | None = None

    @property
    def base_request(self) -> str:
        # A firstAvailable request's results are "<request>/<subrequest>"; kubelet wants the
        # request itself.
        return self.request.split("/", 1)[0]


class DeviceAllocation(msgspec.Struct):
    results: list[Result] = []
    config: list[ConfigEntry] = []


class Allocation(msgspec.Struct):
    devices: DeviceAllocation = msgspec.field(default_factory=DeviceAllocation)


class ClaimStatus(msgspec.Struct):
    allocation: Allocation | None = None


class ExactRequest(msgspec.Struct):
    deviceClassName: str = ""
    allocationMode: str = "ExactCount"
    count: int = 1


class DeviceRequest(msgspec.Struct):
    name: str = ""
    exactly: ExactRequest | None = None  # (firstAvailable requests are not read)


class DeviceClaim(msgspec.Struct):
    requests: list[DeviceRequest] = []


class ClaimSpec(msgspec.Struct):
    devices: DeviceClaim = msgspec.field(default_factory=DeviceClaim)


class ResourceClaim(msgspec.Struct):
    metadata: ClaimMeta = msgspec.field(default_factory=ClaimMeta)
    spec: ClaimSpec = msgspec.field(default_factory=ClaimSpec)
    status: ClaimStatus = msgspec.field(default_factory=ClaimStatus)


def our_results(claim: ResourceClaim, driver: str, pool: str) -> list[Result]:
    """The claim's allocated devices from this driver on this node; ClaimError when the claim is
    not allocated, is too large to be real, or holds our devices from another node's pool."""
    allocation = claim.status.allocation
    if allocation is None:
        raise ClaimError("the claim is not allocated")
    results = allocation.devices.results
    if len(results) > MAX_RESULTS or len(allocation.devices.config) > MAX_CONFIGS:
        raise ClaimError(
            f"the claim's allocation has {len(results)} results and "
            f"{len(allocation.devices.config)} config entries; at most {MAX_RESULTS} and "
            f"{MAX_CONFIGS} are possible"
        )
    ours = [r for r in results if r.driver == driver]
    foreign = sorted({r.pool for r in ours if r.pool != pool})
    if foreign:
        raise ClaimError(
            f"the claim holds {driver} devices of pool(s) {', '.join(foreign)}, not of this "
            f"node ({pool})"
        )
    return ours


@dataclass(frozen=True, slots=True)
class NeuronConfig:
    logical_neuron_core: int | None = None  # None: the node's own setting


def request_configs(
    claim: ResourceClaim, driver: str, requests: Sequence[str]
) -> dict[str, NeuronConfig]:
    """Each request's effective config: entries for this driver, the class's first and the
    claim's after them, a later entry overriding an earlier one. ClaimError on bad config."""
    allocation = claim.status.allocation
    entries = allocation.devices.config if allocation is not None else []
    ordered = [e for e in entries if e.source == "FromClass"]
    ordered += [e for e in entries if e.source != "FromClass"]
    configs = {request: NeuronConfig() for request in requests}
    for entry in ordered:
        if entry.opaque is None or entry.opaque.driver != driver:
            continue
        parsed = parse_config(entry.opaque.parameters, driver)
        targets = {r.split("/", 1)[0] for r in entry.requests} or set(requests)
        for request in targets & set(requests):
            if parsed.logical_neuron_core is not None:
                configs[request] = parsed
    return configs


def parse_config(raw: msgspec.Raw, driver: str) -> NeuronConfig:
    try:
        value: Any = decode_any(raw)
    except msgspec.DecodeError as error:
        raise ClaimError(f"opaque config for {driver} is not JSON: {error}") from None
    if value is None:
        return NeuronConfig()
    if not isinstance(value, Mapping):
        raise ClaimError(f"opaque config for {driver} must be an object, got {_kind(value)}")
    versions = (f"{driver}/v1", AWS_CONFIG_API_VERSION)
    api_version = value.get("apiVersion")
    if api_version not in versions or value.get("kind") != CONFIG_KIND:
        raise ClaimError(
            f"opaque config for {driver} must be apiVersion {versions[0]} (or "
            f"{versions[1]}), kind {CONFIG_KIND}; got apiVersion {_short(api_version)}, kind "
            f"{_short(value.get('kind'))}"
        )
    unknown = sorted(
        str(k)[:40] for k in value if k not in ("apiVersion", "kind", "logicalNeuronCore")
    )
    if unknown:
        raise ClaimError(
            f"{CONFIG_KIND}: unknown field(s) {', '.join(unknown[:5])}; the only setting is "
            "logicalNeuronCore"
        )
    lnc = value.get("logicalNeuronCore")
    if lnc is None:
        return NeuronConfig()
    if isinstance(lnc, bool) or not isinstance(lnc, int) or lnc not in LNC_SETTINGS:
        raise ClaimError(
            f"{CONFIG_KIND}: logicalNeuronCore must be one of "
            f"{', '.join(map(str, LNC_SETTINGS))}; got {_short(lnc)}"
        )
    return NeuronConfig(lnc)


def _kind(value: object) -> str:
    return type(value).__name__


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
