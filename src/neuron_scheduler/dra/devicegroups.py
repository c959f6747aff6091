"""AWS's Neuron + EFA alignment attributes, `resource.aws.com/devicegroupN_id`. Pure.

AWS's Neuron DRA driver and DraNet put the same values on Neuron devices and on EFA NICs, and
users pair them in one claim with `matchAttribute: resource.aws.com/devicegroup8_id`. The values
follow AWS's public library (aws-neuron/connected-device-maps-over-efa-for-neuron, lookup.go):
- devicegroup1_id: the PCI address (BDF) of the EFA device paired with the Neuron device;
- devicegroupN_id for N in 4, 8, 16: the block `id // N` (ids of aligned blocks of N); the BDFs
  paired with the block's devices, de-duplicated (two Trn1 devices share an EFA), sorted, joined
  with ",", SHA-256, lower-case hex, first 16 characters.

A published shape carries a group's id when all its members are in that one block: a single
carries all four, a row devicegroup4/8/16_id, a half devicegroup8/16_id, the whole node
devicegroup16_id. The driver publishes them only on nodes where it finds EFA devices.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

DOMAIN = "resource.aws.com"
GROUP_SIZES = (1, 4, 8, 16)

# Neuron device id -> paired EFA BDF, per instance family (AWS's lookup/neuron/<family>.json).
_TRN1 = (
    "0000:10:1a.0 0000:10:1a.0 0000:a0:1a.0 0000:a0:1a.0 0000:20:19.0 0000:20:19.0 0000:90:19.0 "
    "0000:90:19.0 0000:20:1a.0 0000:20:1a.0 0000:90:1a.0 0000:90:1a.0 0000:10:19.0 0000:10:19.0 "
    "0000:a0:19.0 0000:a0:19.0"
)
_TRN1N = (
    "0000:10:17.0 0000:10:1a.0 0000:a0:17.0 0000:a0:1a.0 0000:20:19.0 0000:20:18.0 0000:90:19.0 "
    "0000:90:18.0 0000:20:17.0 0000:20:1a.0 0000:90:17.0 0000:90:1a.0 0000:10:19.0 0000:10:18.0 "
    "0000:a0:19.0 0000:a0:18.0"
)
_TRN2 = (
    "0000:c9:00.0 0000:b4:00.0 0000:b3:00.0 0000:ca:00.0 0000:6c:00.0 0000:57:00.0 0000:56:00.0 "
    "0000:6d:00.0 0000:98:00.0 0000:83:00.0 0000:82:00.0 0000:99:00.0 0000:f5:00.0 0000:e0:00.0 "
    "0000:df:00.0 0000:f6:00.0"
)
PAIRINGS: dict[str, tuple[str, ...]] = {
    "trn1": tuple(_TRN1.split()),
    "trn1n": tuple(_TRN1N.split()),
    "trn2": tuple(_TRN2.split()),
}
# EFA-enabled instance types and the family table each uses (AWS's config/*.json).
EFA_INSTANCE_TYPES: dict[str, str] = {
    "trn1.32xlarge": "trn1",
    "trn1n.32xlarge": "trn1n",
    "trn2.48xlarge": "trn2",
    "trn2e.48xlarge": "trn2",
    "trn2u.48xlarge": "trn2",
}


def attribute_name(size: int) -> str:
    return f"{DOMAIN}/devicegroup{size}_id"


def pairing(instance_type: str) -> tuple[str, ...] | None:
    """The EFA BDF paired with each Neuron device id, None for types without EFA pairing."""
    family = EFA_INSTANCE_TYPES.get(instance_type)
    return PAIRINGS[family] if family else None


def group_hash(bdfs: list[str] | tuple[str, ...]) -> str:
    unique = sorted(set(bdfs))
    if not unique:
        return ""
    return hashlib.sha256(",".join(unique).encode()).hexdigest()[:16]


def block_id(paired: tuple[str, ...], device: int, size: int) -> str:
    """devicegroup<size>_id of one Neuron device (size 1: the paired BDF itself)."""
    if size == 1:
        return paired[device] if device < len(paired) else ""
    first = device // size * size
    return group_hash([paired[d] for d in range(first, first + size) if d < len(paired)])


def group_attributes(paired: tuple[str, ...], members: tuple[int, ...]) -> Mapping[str, str]:
    """The devicegroupN_id attributes of a published shape: those of every group size whose
    block holds all its members (a single is in one block of each size)."""
    values: dict[str, str] = {}
    for size in GROUP_SIZES:
        blocks = {d // size for d in members}
        if len(blocks) != 1 or len(members) > size:
            continue
        value = block_id(paired, members[0], size)
        if value:
            values[attribute_name(size)] = value
    return values
