"""The karpenter.sh/do-not-disrupt marks (extender/loops/protecting): a bound pod no other node
has a legal block for is marked, the mark is lifted once one has, a user's own mark is never
touched, and turned off the leader lifts its marks."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON
from neuron_scheduler.extender.loops.protecting import SWEEP_SECONDS, Protector
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.state.protection import (
    KARPENTER_DO_NOT_DISRUPT,
    MARK,
    SAFE_TO_EVICT,
    Bound,
    mark_text,
    marked_keys,
)
from neuron_scheduler.kube.objects import Pod
from tests.builders import node, pod_json
from tests.unit.test_requesting import on_device

CATALOG = Catalog.builtin()


class FakeAPI:
    def __init__(self) -> None:
        self.patches: list[tuple[str, dict[str, str | None]]] = []

    async def patch_annotations(
        self,
        namespace: str,
        name: str,
        uid: str,
        values: dict[str, str | None],
        *,
        resource_version: str | None = None,
    ) -> str:
        self.patches.append((name, values))
        return "1"


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def big_on(node_name: str, annotations: dict[str, str] | None = None) -> Pod:
    body = pod_json("big", {NEURON: 4}, uid="big", node=node_name)
    body["metadata"]["annotations"] = {
        "AWS_NEURON_IDS": "0,1,2,3",
        "NEURON_RESOURCE_TYPE": NEURON,
        "NEURON_CORES": "0,1,2,3,4,5,6,7",
        "NEURON_DEVS": "0,1,2,3",
        "NEURON_NODE": node_name,
        **(annotations or {}),
    }
    body["status"] = {"phase": "Running"}
    return msgspec.convert(body, Pod)


class World:
    """`frag` (inf2.48xlarge) holds bare pods on all but devices 2, 5, 8 and 11; `new` holds a
    4-device pod on 0-3: by count it fits on frag, where it has no block."""

    def __init__(self, on: bool = True, **big: Any) -> None:
        self.clock = Clock()
        self.api = FakeAPI()
        self.ledger = Ledger(CATALOG)
        self.bound = Bound(["my-scheduler"])
        self.protector = Protector(
            self.ledger, self.bound, self.api, CollectorRegistry(), on=on, clock=self.clock
        )
        self.ledger.replace_nodes([node("frag", "inf2.48xlarge"), node("new", "inf2.48xlarge")])
        self.pods = [on_device(f"x{d}", "frag", d) for d in range(12) if d % 3 != 2]
        self.pods.append(big_on("new", **big))
        for view in (self.ledger, self.bound):
            view.replace_pods(self.pods)

    def step(self) -> None:
        asyncio.run(self.protector.step())


def test_a_pod_with_no_block_elsewhere_is_marked_and_the_mark_lifted_when_one_frees() -> None:
    world = World()
    world.step()
    assert world.api.patches == [
        (
            "big",
            {
                KARPENTER_DO_NOT_DISRUPT: "true",
                SAFE_TO_EVICT: "false",
                MARK: world.api.patches[0][1][MARK],
            },
        )
    ]
    marked = big_on("new", {KARPENTER_DO_NOT_DISRUPT: "true", MARK: "ours"})
    for view in (world.ledger, world.bound):
        view.apply_pod(marked)
    world.step()
    assert len(world.api.patches) == 1  # nothing new until the sweep
    for gone in ("x0", "x1", "x3"):  # frag has 0-3 free now: another legal block
        for view in (world.ledger, world.bound):
            view.remove_pod(gone)
    world.clock.now += SWEEP_SECONDS
    world.step()
    assert world.api.patches[-1] == (
        "big",
        {KARPENTER_DO_NOT_DISRUPT: None, SAFE_TO_EVICT: None, MARK: None},
    )


def test_a_users_own_mark_is_left_alone_and_off_lifts_only_ours() -> None:
    world = World(annotations={KARPENTER_DO_NOT_DISRUPT: "true", SAFE_TO_EVICT: "false"})
    world.step()
    assert world.api.patches == []
    # Karpenter reads only its own key: a user's safe-to-evict (any value) is left as it is,
    # and Karpenter's mark is still set, and later lifted, as ours.
    world = World(annotations={SAFE_TO_EVICT: "true"})
    world.step()
    values = {KARPENTER_DO_NOT_DISRUPT: "true", MARK: mark_text([KARPENTER_DO_NOT_DISRUPT])}
    assert world.api.patches == [("big", values)]
    world = World(on=False, annotations={SAFE_TO_EVICT: "true", **values})
    world.step()
    assert world.api.patches == [("big", {KARPENTER_DO_NOT_DISRUPT: None, MARK: None})]


def test_the_marks_record_of_its_keys_is_read_as_untrusted() -> None:
    both = (KARPENTER_DO_NOT_DISRUPT, SAFE_TO_EVICT)
    assert marked_keys(mark_text([SAFE_TO_EVICT])) == (SAFE_TO_EVICT,)
    assert marked_keys(mark_text(both)) == both
    assert marked_keys("ours") == both  # as the first marks were written
    assert marked_keys("x (set: kubernetes.io/other, " + "y" * 10_000 + ")") == both
    world = World(on=False, annotations={KARPENTER_DO_NOT_DISRUPT: "true", MARK: "ours"})
    world.step()
    assert world.api.patches == [
        ("big", {KARPENTER_DO_NOT_DISRUPT: None, SAFE_TO_EVICT: None, MARK: None})
    ]


def test_a_pod_newly_bound_is_judged_at_once_and_pods_of_other_schedulers_never() -> None:
    world = World()
    world.step()
    world.api.patches.clear()
    other = pod_json("other", {NEURON: 4}, uid="other", node="new", scheduler="default")
    world.bound.apply_pod(msgspec.convert(other, Pod))
    assert "other" not in world.bound.pods
    asyncio.run(world.protector.step())
    assert world.api.patches == []
