"""AWS's device-group ids, against the check vectors of its public library."""

from __future__ import annotations

import hashlib

from neuron_scheduler.dra.devicegroups import block_id, group_attributes, group_hash, pairing


def test_trn2_check_vectors() -> None:
    paired = pairing("trn2.48xlarge")
    assert paired is not None
    assert [block_id(paired, 0, n) for n in (1, 4, 8, 16)] == [
        "0000:c9:00.0",
        "13713e551cd37c19",
        "3593812b8066a078",
        "821d14afaf11327d",
    ]
    assert [block_id(paired, d, 4) for d in (4, 8, 12)] == [
        "671622785349fddf",
        "237e3ef7b968b4d3",
        "b3d6ce1919d29f8f",
    ]
    assert block_id(paired, 15, 8) == "614e16dab9ba2f1f"
    # Every device of a block shares its id.
    assert {block_id(paired, d, 4) for d in range(4, 8)} == {"671622785349fddf"}


def test_the_hash_is_sorted_unique_bdfs() -> None:
    bdfs = ["0000:c9:00.0", "0000:b4:00.0", "0000:b3:00.0", "0000:ca:00.0"]
    text = "0000:b3:00.0,0000:b4:00.0,0000:c9:00.0,0000:ca:00.0"
    assert group_hash(bdfs) == hashlib.sha256(text.encode()).hexdigest()[:16]
    assert group_hash(bdfs + bdfs[:2]) == group_hash(bdfs)  # trn1: two devices share an EFA
    assert group_hash([]) == ""


def test_trn1_shares_an_efa_between_two_devices() -> None:
    paired = pairing("trn1.32xlarge")
    assert paired is not None
    assert block_id(paired, 0, 1) == block_id(paired, 1, 1) == "0000:10:1a.0"
    assert block_id(paired, 0, 4) == group_hash(["0000:10:1a.0", "0000:a0:1a.0"])


def test_types_without_efa_pairing() -> None:
    assert pairing("inf2.48xlarge") is None
    assert pairing("trn1.2xlarge") is None
    assert pairing("trn2u.48xlarge") == pairing("trn2.48xlarge")


def test_a_shape_carries_only_the_groups_that_hold_all_of_it() -> None:
    paired = pairing("trn2.48xlarge")
    assert paired is not None
    row = group_attributes(paired, (4, 5, 6, 7))
    assert set(row) == {f"resource.aws.com/devicegroup{n}_id" for n in (4, 8, 16)}
    straddling = group_attributes(paired, (3, 4))
    assert set(straddling) == {f"resource.aws.com/devicegroup{n}_id" for n in (8, 16)}
