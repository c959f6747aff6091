"""A model of the extender's bind path against an API server that fails, in random interleavings.

The API here (tests/podapi.py) keeps pods as the real one does for what bind touches, with its
preconditions. Faults: a call fails before it takes effect (500), takes effect and its answer is
lost (a timeout) or does not decode, or times out while the request is still on its way and takes
effect (or fails its preconditions) at some later step; the API may go down part way through a
bind. The watch lags: changes reach the ledger only when a step delivers them. Binds of one pod
run concurrently, to different nodes, as kube-scheduler's retries do. The extender may restart (a
new ledger and binder, re-listing everything).

After every step, in the API's own state (the truth):
- every bound pod that requests Neuron resources carries readable ids for its node;
- no two live pods on one node hold a common core;
and in the extender's: every bound pod's cores are counted as used on its node (by the watch or,
until the watch shows the binding, by the bind's reservation), so nothing is ever handed out twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NEURONCORE
from neuron_scheduler.extender.verbs.wire import ExtenderBindingArgs
from neuron_scheduler.extender.wiring import Extender, wire
from neuron_scheduler.kube.errors import ApiError
from neuron_scheduler.kube.objects import Node, Pod
from neuron_scheduler.kube.reading import assignment
from tests.builders import node, pod_json
from tests.podapi import FakeAPI

NODES = {"inf1": "inf1.6xlarge", "inf2": "inf2.24xlarge"}
REQUESTS = [{NEURON: 1}, {NEURON: 2}, {NEURONCORE: 1}, {NEURONCORE: 3}]
FAULTS = ["none", "none", "none", "fail", "lost", "garbled", "late"]  # see tests/podapi.py


class BindModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.api = FakeAPI()
        self.names = itertools.count()
        self.nodes: list[Node] = [node(name, kind) for name, kind in NODES.items()]
        self.extender = self._start()

    def _start(self) -> Extender:
        """A (re)started extender: lists every node, then every pod, as its watches do."""
        extender = wire(self.api, Catalog.builtin())  # type: ignore[arg-type]
        for view in extender.views:
            view.replace_nodes(self.nodes)
            view.replace_pods([msgspec.convert(p, Pod) for p in self.api.pods.values()])
        self.api.events.clear()  # the list saw all of them
        extender.synced.set()
        return extender

    def teardown(self) -> None:
        self.loop.run_until_complete(self.extender.events.close())
        self.loop.close()

    @rule(limits=st.sampled_from(REQUESTS))
    def create(self, limits: dict[str, int]) -> None:
        name = f"p{next(self.names)}"
        body = pod_json(name, limits, uid=f"uid-{name}")
        body["metadata"]["resourceVersion"] = str(next(self.api.version))
        self.api.pods[name] = body

    @precondition(lambda self: any(not p["spec"].get("nodeName") for p in self.api.pods.values()))
    @rule(
        data=st.data(),
        to=st.lists(st.sampled_from(sorted(NODES)), min_size=1, max_size=3),
        faults=st.lists(st.sampled_from(FAULTS), max_size=6),
        then=st.sampled_from(["none", "none", "fail"]),
    )
    def bind(self, data: st.DataObject, to: list[str], faults: list[str], then: str) -> None:
        """kube-scheduler binds a pending pod, its retries racing the first attempt; the API may
        go down (every write fails) part way."""
        pending = sorted(n for n, p in self.api.pods.items() if not p["spec"].get("nodeName"))
        name = data.draw(st.sampled_from(pending))
        uid = self.api.pods[name]["metadata"]["uid"]
        self.api.faults, self.api.then = list(faults), then
        binder = self.extender.binder
        calls = [binder.bind(ExtenderBindingArgs(name, "default", uid, target)) for target in to]

        async def together() -> list[str]:
            return list(await asyncio.gather(*calls))

        self.loop.run_until_complete(together())
        self.api.faults, self.api.then = [], "none"

    @precondition(lambda self: bool(self.api.events))
    @rule(data=st.data())
    def watch_delivers(self, data: st.DataObject) -> None:
        """The watch catches up on some of the changes, in order."""
        count = data.draw(st.integers(1, len(self.api.events)))
        delivered, self.api.events = self.api.events[:count], self.api.events[count:]
        for kind, body in delivered:
            pod = msgspec.convert(body, Pod)
            for view in self.extender.views:
                if kind == "DELETED":
                    view.remove_pod(pod.metadata.uid)
                else:
                    view.apply_pod(pod)

    @precondition(lambda self: bool(self.api.in_flight))
    @rule(data=st.data())
    def a_late_write_lands(self, data: st.DataObject) -> None:
        """A write whose caller gave up on it reaches the API server now (or fails there)."""
        index = data.draw(st.integers(0, len(self.api.in_flight) - 1))
        with contextlib.suppress(ApiError):
            self.api.in_flight.pop(index)()

    @precondition(lambda self: bool(self.api.pods))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.api.pods)))
        body = self.api.pods.pop(name)
        self.api.events.append(("DELETED", body))

    @rule()
    def restart(self) -> None:
        self.loop.run_until_complete(self.extender.events.close())
        self.extender = self._start()

    def _bound(self) -> list[Pod]:
        return [
            msgspec.convert(p, Pod) for p in self.api.pods.values() if p["spec"].get("nodeName")
        ]

    @invariant()
    def bound_pods_have_their_own_ids(self) -> None:
        taken: dict[str, dict[int, str]] = {name: {} for name in NODES}
        for pod in self._bound():
            found = assignment(pod, None)
            assert found is not None, f"{pod.key} is bound to {pod.spec.nodeName} without ids"
            assert found.node == pod.spec.nodeName
            for core in found.cores:
                other = taken[pod.spec.nodeName].setdefault(core, pod.key)
                assert other == pod.key, f"{pod.key} and {other} share core {core}"

    @invariant()
    def the_extender_counts_every_bound_pod(self) -> None:
        ledger = self.extender.ledger
        for pod in self._bound():
            found = assignment(pod, None)
            assert found is not None
            used = ledger.state(pod.spec.nodeName).used_cores
            assert found.core_mask & ~used == 0, f"{pod.key}'s cores are free in the ledger"


TestBindModel = BindModel.TestCase
TestBindModel.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
