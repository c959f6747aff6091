"""Prepare and Unprepare: the allocator's re-check, CDI specs, the checkpoint, idempotence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.dra.checkpoint import Checkpoint
from neuron_scheduler.dra.claims import ResourceClaim
from neuron_scheduler.dra.preparing import ClaimRef, NodeDevices, Preparer
from neuron_scheduler.kube.decoding import decode
from neuron_scheduler.kube.errors import NotFound

DRIVER = "neuron.example.com"
NODE = "node-a"
CATALOG = Catalog.builtin()


def claim_json(
    uid: str,
    devices: list[str | tuple[str, str]],
    *,
    name: str | None = None,
    pool: str = NODE,
    config: list[dict[str, Any]] | None = None,
    allocated: bool = True,
) -> dict[str, Any]:
    results = [
        {"request": d[0], "driver": DRIVER, "pool": pool, "device": d[1]}
        if isinstance(d, tuple)
        else {"request": "neurons", "driver": DRIVER, "pool": pool, "device": d}
        for d in devices
    ]
    body: dict[str, Any] = {
        "metadata": {"name": name or f"claim-{uid}", "namespace": "ns", "uid": uid}
    }
    if allocated:
        body["status"] = {"allocation": {"devices": {"results": results, "config": config or []}}}
    return body


class FakeApi:
    def __init__(self) -> None:
        self.claims: dict[str, dict[str, Any]] = {}
        self.texts: dict[str, str] = {}  # a claim as the API server sends it, where set
        self.reads = 0

    def add(self, body: dict[str, Any]) -> ClaimRef:
        self.claims[body["metadata"]["name"]] = body
        meta = body["metadata"]
        return ClaimRef(meta["namespace"], meta["name"], meta["uid"])

    async def __call__(self, namespace: str, name: str) -> ResourceClaim:
        self.reads += 1
        if name not in self.claims:
            raise NotFound("GET", f"/claims/{name}", 404, b'{"message": "not found"}')
        text = self.texts.get(name) or json.dumps(self.claims[name])
        return decode(text, ResourceClaim)  # as KubeAPI decodes


class World:
    def __init__(self, root: Path, instance_type: str = "inf2.48xlarge", physical: int = 2) -> None:
        self.root = root
        self.api = FakeApi()
        topology = CATALOG.resolve(instance_type).topology
        self.devices = NodeDevices(topology, physical)
        self.preparer = self.start()

    def start(self) -> Preparer:
        checkpoint = Checkpoint(self.root / "state" / "checkpoint.json", DRIVER, NODE)
        checkpoint.load()
        return Preparer(DRIVER, NODE, self.devices, checkpoint, self.root / "cdi", self.api)

    def spec(self, uid: str) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(
            (self.root / "cdi" / f"{DRIVER}-{uid}.json").read_text()
        )
        return result


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


async def test_prepare_writes_one_cdi_spec_naming_exactly_the_devices(world: World) -> None:
    ref = world.api.add(claim_json("uid-1", ["window-3-at-11"]))
    (answer,) = (await world.preparer.prepare([ref])).values()
    assert not isinstance(answer, str), answer
    (device,) = answer.devices
    assert (device.request, device.pool, device.device) == ("neurons", NODE, "window-3-at-11")
    assert device.cdi_id == f"{DRIVER}/neuron=uid-1-window-3-at-11"
    spec = world.spec("uid-1")
    assert spec["kind"] == f"{DRIVER}/neuron"
    (cdi,) = spec["devices"]
    assert cdi["name"] == "uid-1-window-3-at-11"
    edits = cdi["containerEdits"]
    assert edits["deviceNodes"] == [{"path": f"/dev/neuron{d}"} for d in (0, 1, 11)]
    assert edits["env"] == [
        "NEURON_RT_VISIBLE_CORES=0,1,2,3,22,23",
        "AWS_NEURON_VISIBLE_DEVICES=0,1,11",
    ]


async def test_prepare_and_unprepare_are_idempotent(world: World) -> None:
    ref = world.api.add(claim_json("uid-1", ["window-4-at-0"], name="c"))
    first = await world.preparer.prepare([ref])
    second = await world.preparer.prepare([ref])
    assert not isinstance(first["uid-1"], str), first
    assert first == second and world.api.reads == 1
    assert await world.preparer.unprepare([ref]) == {"uid-1": ""}
    assert not (world.root / "cdi" / f"{DRIVER}-uid-1.json").exists()
    assert await world.preparer.unprepare([ref]) == {"uid-1": ""}
    never = ClaimRef("ns", "never", "uid-never")
    assert await world.preparer.unprepare([never]) == {"uid-never": ""}


async def test_a_restarted_driver_keeps_what_it_prepared(world: World) -> None:
    held = world.api.add(claim_json("uid-1", ["window-4-at-0"]))
    await world.preparer.prepare([held])
    (world.root / "cdi" / f"{DRIVER}-uid-1.json").unlink()  # a runtime dir wiped meanwhile
    restarted = world.start()
    reads = world.api.reads
    again = await restarted.prepare([held])
    assert world.api.reads == reads  # answered from the checkpoint
    assert not isinstance(again["uid-1"], str)
    assert world.spec("uid-1")["devices"][0]["name"] == "uid-1-window-4-at-0"
    overlapping = world.api.add(claim_json("uid-2", ["window-2-at-3"]))
    refused = await restarted.prepare([overlapping])
    assert refused == {"uid-2": "cores 6,7 are in use by another prepared claim"}


async def test_a_prepared_claim_that_no_longer_exists_frees_its_devices(world: World) -> None:
    """Deleted while the driver was down, and never unprepared: the next claim wanting its
    devices finds it gone from the API and takes them."""
    gone = world.api.add(claim_json("uid-1", ["window-4-at-0"], name="gone"))
    await world.preparer.prepare([gone])
    del world.api.claims["gone"]
    restarted = world.start()
    successor = world.api.add(claim_json("uid-2", ["window-2-at-3"]))
    (answer,) = (await restarted.prepare([successor])).values()
    assert not isinstance(answer, str), answer
    assert set(restarted.checkpoint.claims) == {"uid-2"}
    assert not (world.root / "cdi" / f"{DRIVER}-uid-1.json").exists()


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        (
            claim_json("u", ["single-0", "single-5"]),
            "devices 0,5, which are not directly connected",
        ),
        (
            claim_json("u", ["single-0", "window-2-at-0"]),
            "overlaps another device of the same claim",
        ),
        (claim_json("u", ["window-99-at-0"]), "'window-99-at-0' is not one this driver publishes"),
        (claim_json("u", ["single-0"], pool="node-b"), "pool(s) node-b, not of this node (node-a)"),
        (claim_json("u", ["single-0"], allocated=False), "the claim is not allocated"),
        (
            claim_json(
                "u",
                ["single-0"],
                config=[
                    {
                        "source": "FromClaim",
                        "opaque": {"driver": DRIVER, "parameters": {"kind": "Foo"}},
                    }
                ],
            ),
            "must be apiVersion neuron.example.com/v1",
        ),
        (
            claim_json(
                "u",
                ["single-0"],
                config=[
                    {
                        "source": "FromClaim",
                        "requests": ["neurons"],
                        "opaque": {
                            "driver": DRIVER,
                            "parameters": {
                                "apiVersion": f"{DRIVER}/v1",
                                "kind": "NeuronConfig",
                                "logicalNeuronCore": 2,
                            },
                        },
                    }
                ],
            ),
            "logicalNeuronCore 2 needs devices with 8 physical NeuronCores",
        ),
    ],
)
async def test_claims_that_cannot_be_prepared_get_a_clear_error(
    world: World, claim: dict[str, Any], message: str
) -> None:
    ref = world.api.add(claim)
    (answer,) = (await world.preparer.prepare([ref])).values()
    assert isinstance(answer, str) and message in answer, answer
    assert world.preparer.checkpoint.claims == {}


async def test_a_claim_whose_config_nests_deep_gets_a_clear_error(world: World) -> None:
    """The claim's author writes its opaque config, which kube-apiserver keeps nested up to
    10,000 deep: decoding the claim raised RecursionError, which nothing caught (kube.decoding
    decodes it again with what nests past any field we read cut off)."""
    opaque = {"driver": DRIVER, "parameters": "DEEP"}
    claim = claim_json("u", ["single-0"], config=[{"source": "FromClaim", "opaque": opaque}])
    ref = world.api.add(claim)
    deep = "[" * 10_000 + "]" * 10_000
    world.api.texts[claim["metadata"]["name"]] = json.dumps(claim).replace('"DEEP"', deep)
    (answer,) = (await world.preparer.prepare([ref])).values()
    assert isinstance(answer, str) and "must be an object, got list" in answer, answer
    assert world.preparer.checkpoint.claims == {}


async def test_two_singles_that_form_a_window_are_legal(world: World) -> None:
    ref = world.api.add(claim_json("u", ["single-11", "single-0"]))
    (answer,) = (await world.preparer.prepare([ref])).values()
    assert not isinstance(answer, str), answer


async def test_a_request_given_several_devices_names_all_of_them_in_every_edit(
    world: World,
) -> None:
    """kubelet hands a container every CDI device of the claim's request, and each device's
    edits set the same variables: the last one applied would win, so each must name the whole
    request (two 1-core windows that form one window: both cores; two singles: both devices)."""
    joined = world.api.add(claim_json("j", ["cores-1-at-6", "cores-1-at-7"]))
    assert not isinstance((await world.preparer.prepare([joined]))["j"], str)
    for device in world.spec("j")["devices"]:
        edits = device["containerEdits"]
        assert edits["env"] == ["NEURON_RT_VISIBLE_CORES=6,7"], device["name"]
        assert edits["deviceNodes"] == [{"path": "/dev/neuron3"}]
    pair = world.api.add(claim_json("p", ["single-11", "single-0"]))
    assert not isinstance((await world.preparer.prepare([pair]))["p"], str)
    for device in world.spec("p")["devices"]:
        edits = device["containerEdits"]
        assert edits["env"] == [
            "NEURON_RT_VISIBLE_CORES=0,1,22,23",
            "AWS_NEURON_VISIBLE_DEVICES=0,11",
        ], device["name"]
        assert edits["deviceNodes"] == [{"path": "/dev/neuron0"}, {"path": "/dev/neuron11"}]
    # Separate requests stay separate (a container may name one request of the claim).
    apart = world.api.add(claim_json("a", [("x", "single-4"), ("y", "single-6")]))
    assert not isinstance((await world.preparer.prepare([apart]))["a"], str)
    envs = [d["containerEdits"]["env"] for d in world.spec("a")["devices"]]
    assert envs == [
        ["NEURON_RT_VISIBLE_CORES=8,9", "AWS_NEURON_VISIBLE_DEVICES=4"],
        ["NEURON_RT_VISIBLE_CORES=12,13", "AWS_NEURON_VISIBLE_DEVICES=6"],
    ]


async def test_admin_access_neither_holds_cores_nor_is_kept_off_them(world: World) -> None:
    """kube-scheduler gives an admin-access request (monitoring) devices other claims hold and
    does not count it as holding them: a workload allocated the same cores after it must still
    be prepared, and it must be prepared beside one."""
    body = claim_json("mon", ["single-0"])
    body["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    monitor = world.api.add(body)
    assert not isinstance((await world.preparer.prepare([monitor]))["mon"], str)
    work = world.api.add(claim_json("work", ["cores-1-at-0"]))
    assert not isinstance((await world.preparer.prepare([work]))["work"], str)
    body = claim_json("mon2", ["window-2-at-0"])
    body["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    second = world.api.add(body)
    assert not isinstance((await world.preparer.prepare([second]))["mon2"], str)
    # After a restart too; and a workload is still kept off the workload's cores.
    restarted = world.start()
    other = world.api.add(claim_json("other", ["single-0"]))
    assert await restarted.prepare([other]) == {
        "other": "cores 0 are in use by another prepared claim"
    }


async def test_separate_requests_may_hold_separate_sets(world: World) -> None:
    ref = world.api.add(claim_json("u", [("a", "single-0"), ("b", "single-5")]))
    (answer,) = (await world.preparer.prepare([ref])).values()
    assert not isinstance(answer, str), answer
    assert [d.request for d in answer.devices] == ["a", "b"]


async def test_missing_replaced_and_unhealthy(world: World) -> None:
    missing = await world.preparer.prepare([ClaimRef("ns", "gone", "uid-9")])
    assert missing == {"uid-9": "claim ns/gone does not exist"}
    world.api.add(claim_json("uid-new", ["single-0"], name="same"))
    replaced = await world.preparer.prepare([ClaimRef("ns", "same", "uid-old")])
    assert "it was deleted and created again" in str(replaced["uid-old"])
    world.devices.unhealthy = {1: "core_count unreadable"}
    sick = world.api.add(claim_json("uid-s", ["window-2-at-0"]))
    answer = await world.preparer.prepare([sick])
    assert answer == {"uid-s": "unhealthy devices: neuron1: core_count unreadable"}
    bad = await world.preparer.prepare([ClaimRef("ns", "x", "../../etc/passwd")])
    assert "is not a claim UID" in str(bad["../../etc/passwd"])


async def test_logical_neuroncore_per_claim_on_trn2(tmp_path: Path) -> None:
    world = World(tmp_path, "trn2.48xlarge", physical=8)
    config = [
        {
            "source": "FromClass",
            "opaque": {
                "driver": DRIVER,
                "parameters": {
                    "apiVersion": "neuron.aws.com/v1",
                    "kind": "NeuronConfig",
                    "logicalNeuronCore": 2,
                },
            },
        },
        {
            "source": "FromClaim",
            "requests": ["neurons"],
            "opaque": {
                "driver": DRIVER,
                "parameters": {
                    "apiVersion": f"{DRIVER}/v1",
                    "kind": "NeuronConfig",
                    "logicalNeuronCore": 1,
                },
            },
        },
    ]
    ref = world.api.add(claim_json("u", ["single-1"], config=config))
    (answer,) = (await world.preparer.prepare([ref])).values()
    assert not isinstance(answer, str), answer
    env = world.spec("u")["devices"][0]["containerEdits"]["env"]
    assert env == [
        "NEURON_RT_VISIBLE_CORES=8,9,10,11,12,13,14,15",
        "AWS_NEURON_VISIBLE_DEVICES=1",
        "NEURON_LOGICAL_NC_CONFIG=1",
    ]
    # Without config: the node's own setting (4 logical cores per device, LNC=2).
    plain = world.api.add(claim_json("p", ["single-2"]))
    await world.preparer.prepare([plain])
    assert world.spec("p")["devices"][0]["containerEdits"]["env"][0] == (
        "NEURON_RT_VISIBLE_CORES=8,9,10,11"
    )


async def test_a_core_window_gets_exactly_its_cores_and_the_devices_they_are_on(
    world: World,
) -> None:
    ref = world.api.add(claim_json("c", ["cores-3-at-3"]))
    (answer,) = (await world.preparer.prepare([ref])).values()
    assert not isinstance(answer, str), answer
    (device,) = world.spec("c")["devices"]
    assert device["name"] == "c-cores-3-at-3"
    edits = device["containerEdits"]
    assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/neuron1", "/dev/neuron2"]
    # As the device plugin answers a core request: the cores, no device list.
    assert edits["env"] == ["NEURON_RT_VISIBLE_CORES=3,4,5"]
    assert answer.devices[0].cores == (3, 4, 5)


async def test_core_and_device_claims_never_share_a_core(world: World) -> None:
    """Core 1 in use: its device is taken for device claims, its other core is not."""
    first = world.api.add(claim_json("one", ["cores-1-at-1"]))
    assert not isinstance((await world.preparer.prepare([first]))["one"], str)
    device = world.api.add(claim_json("dev", ["single-0"]))
    assert await world.preparer.prepare([device]) == {
        "dev": "cores 1 are in use by another prepared claim"
    }
    neighbour = world.api.add(claim_json("nb", ["cores-1-at-0"]))
    assert not isinstance((await world.preparer.prepare([neighbour]))["nb"], str)
    across = world.api.add(claim_json("across", ["cores-2-at-1"]))
    assert await world.preparer.prepare([across]) == {
        "across": "cores 1 are in use by another prepared claim"
    }
    # A device claim held first keeps core windows off its device, after a restart too.
    window = world.api.add(claim_json("win", ["window-2-at-5"]))
    assert not isinstance((await world.preparer.prepare([window]))["win"], str)
    restarted = world.start()
    inside = world.api.add(claim_json("in", ["cores-1-at-11"]))
    assert await restarted.prepare([inside]) == {
        "in": "cores 11 are in use by another prepared claim"
    }


async def test_a_core_request_must_get_one_window(world: World) -> None:
    split = world.api.add(claim_json("s", ["cores-1-at-0", "cores-1-at-5"]))
    (answer,) = (await world.preparer.prepare([split])).values()
    assert isinstance(answer, str)
    assert "was given cores 0,5, which are not one window of connected cores" in answer
    mixed = world.api.add(claim_json("m", ["cores-1-at-0", "single-3"]))
    (answer,) = (await world.preparer.prepare([mixed])).values()
    assert isinstance(answer, str) and "both device sets and core windows" in answer
    # Two windows that together are one window are one legal set (count: 2 of a 1-core class).
    joined = world.api.add(claim_json("j", ["cores-1-at-6", "cores-1-at-7"]))
    (answer,) = (await world.preparer.prepare([joined])).values()
    assert not isinstance(answer, str), answer


async def test_a_core_claim_keeps_the_nodes_logical_cores(tmp_path: Path) -> None:
    world = World(tmp_path, "trn2.48xlarge", physical=8)  # LNC=2: 4 logical cores per device

    def lnc(value: int) -> list[dict[str, Any]]:
        parameters = {"apiVersion": f"{DRIVER}/v1", "kind": "NeuronConfig"}
        return [
            {
                "source": "FromClaim",
                "opaque": {
                    "driver": DRIVER,
                    "parameters": {**parameters, "logicalNeuronCore": value},
                },
            }
        ]

    other = world.api.add(claim_json("o", ["cores-2-at-4"], config=lnc(1)))
    (answer,) = (await world.preparer.prepare([other])).values()
    assert isinstance(answer, str)
    assert "its cores are the node's logical cores (LNC 2)" in answer
    same = world.api.add(claim_json("s", ["cores-2-at-4"], config=lnc(2)))
    (answer,) = (await world.preparer.prepare([same])).values()
    assert not isinstance(answer, str), answer
    assert (
        world.spec("s")["devices"][0]["containerEdits"]["env"][0] == "NEURON_RT_VISIBLE_CORES=4,5"
    )


def test_an_unreadable_checkpoint_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_text("{not json")
    checkpoint = Checkpoint(path, DRIVER, NODE)
    checkpoint.load()
    assert checkpoint.claims == {}
    assert not path.exists()
    (aside,) = tmp_path.glob("checkpoint.json.unreadable-*")
    assert aside.read_text() == "{not json"
