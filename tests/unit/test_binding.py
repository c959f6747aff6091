"""A bind whose Binding may still land keeps its devices until it cannot (tests/podapi.py's API)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from neuron_scheduler.core import handoff
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NEURONCORE
from neuron_scheduler.extender.verbs import binding
from neuron_scheduler.extender.verbs.wire import ExtenderBindingArgs
from neuron_scheduler.extender.wiring import Extender, wire
from neuron_scheduler.kube.errors import Conflict
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import assignment
from tests.builders import node, pod_json
from tests.podapi import FakeAPI

NODE = "inf2"


def extender_with(api: FakeAPI, *names: str) -> Extender:
    for name in names:
        body = pod_json(name, {NEURON: 1}, uid=f"uid-{name}")
        body["metadata"]["resourceVersion"] = str(next(api.version))
        api.pods[name] = body
    extender = wire(api, Catalog.builtin())  # type: ignore[arg-type]
    for view in extender.views:
        view.replace_nodes([node(NODE, "inf2.xlarge")])  # one device
    extender.synced.set()
    return extender


def args(name: str) -> ExtenderBindingArgs:
    return ExtenderBindingArgs(name, "default", f"uid-{name}", NODE)


def device_taken(extender: Extender) -> bool:
    return extender.ledger.state(NODE).used_cores != 0


async def test_a_binding_that_may_still_land_keeps_its_device_until_settled() -> None:
    api = FakeAPI()
    extender = extender_with(api, "a", "b")
    # The Binding times out on its way, and the API then refuses every write.
    api.faults, api.then = ["none", "late"], "fail"
    assert "failed" in await extender.binder.bind(args("a"))
    assert device_taken(extender)  # it may still land
    assert extender.binder.metrics.unsettled._value.get() == 1
    assert "may still land" in await extender.binder.bind(args("a"))
    assert "only 0 devices free" in await extender.binder.bind(args("b"))
    api.then = "none"
    # The API is back: a's next bind removes the old annotations (so the old Binding can no
    # longer land) and binds it again.
    assert await extender.binder.bind(args("a")) == ""
    with pytest.raises(Conflict):
        api.in_flight.pop()()  # the old Binding arrives: its precondition fails
    bound = msgspec.convert(api.pods["a"], Pod)
    found = assignment(bound, None)
    assert found is not None and found.node == NODE == bound.spec.nodeName


async def test_a_late_binding_lands_on_the_held_device() -> None:
    api = FakeAPI()
    extender = extender_with(api, "a", "b")
    api.faults, api.then = ["none", "late"], "fail"
    assert "failed" in await extender.binder.bind(args("a"))
    api.then = "none"
    api.in_flight.pop()()  # lands: a is bound with the ids it wrote
    assert api.pods["a"]["spec"]["nodeName"] == NODE
    assert "only 0 devices free" in await extender.binder.bind(args("b"))  # a's is the only one
    assert await extender.binder.bind(args("a")) == ""  # its next bind finds it bound


async def test_the_hold_of_an_unsettled_binding_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(binding, "ANNOUNCED_SECONDS", 0.05)
    api = FakeAPI()
    extender = extender_with(api, "a")
    api.faults, api.then = ["none", "late"], "fail"
    assert "failed" in await extender.binder.bind(args("a"))
    assert device_taken(extender)
    await asyncio.sleep(0.2)
    assert not device_taken(extender)  # a Binding that old can no longer land


async def test_a_hold_that_ends_while_the_next_bind_settles_it_is_no_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(binding, "ANNOUNCED_SECONDS", 0.05)
    api = FakeAPI()
    extender = extender_with(api, "a")
    api.faults, api.then = ["none", "late"], "fail"
    assert "failed" in await extender.binder.bind(args("a"))
    read = api.get_pod

    async def slow_read(namespace: str, name: str) -> Pod:
        await asyncio.sleep(0.1)  # the hold's time runs out meanwhile
        return await read(namespace, name)

    monkeypatch.setattr(api, "get_pod", slow_read)
    api.then = "none"
    assert await extender.binder.bind(args("a")) == ""


def watched(api: FakeAPI, extender: Extender, name: str) -> Pod:
    """The pod as the watch shows it now (and, through the views, the extender)."""
    pod = msgspec.convert(api.pods[name], Pod)
    for view in extender.views:
        view.apply_pod(pod)
    return pod


def counting_reads(api: FakeAPI, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    reads: list[str] = []
    read = api.get_pod

    async def counted(namespace: str, name: str) -> Pod:
        reads.append(name)
        return await read(namespace, name)

    monkeypatch.setattr(api, "get_pod", counted)
    return reads


@pytest.mark.parametrize("behind", [False, True])
async def test_a_pod_the_watch_shows_pending_is_bound_reading_it_only_if_the_copy_is_behind(
    monkeypatch: pytest.MonkeyPatch, behind: bool
) -> None:
    api = FakeAPI()
    extender = extender_with(api, "a")
    watched(api, extender, "a")
    if behind:  # the pod changed since the watch showed it
        api.pods["a"]["metadata"]["resourceVersion"] = str(next(api.version))
    reads = counting_reads(api, monkeypatch)
    assert await extender.binder.bind(args("a")) == ""
    assert reads == (["a"] if behind else [])
    found = assignment(msgspec.convert(api.pods["a"], Pod), None)
    assert found is not None and found.node == NODE == api.pods["a"]["spec"]["nodeName"]
    assert extender.ledger.reservation("uid-a") is not None  # held once, until the watch shows it


async def test_a_watch_copy_of_a_pod_bound_since_is_answered_as_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = FakeAPI()
    extender = extender_with(api, "a", "b")
    watched(api, extender, "a")
    api.faults = ["none", "lost"]  # bound, but kube-scheduler never hears so: it binds again
    assert "failed" in await extender.binder.bind(args("a")) or api.pods["a"]["spec"]["nodeName"]
    assert api.pods["a"]["spec"]["nodeName"] == NODE
    reads = counting_reads(api, monkeypatch)
    assert await extender.binder.bind(args("a")) == ""  # from the API's copy: bound already
    assert reads == ["a"]
    assert "only 0 devices free" in await extender.binder.bind(args("b"))  # held once


def started(api: FakeAPI) -> Extender:
    """An extender (re)started on `api`: its lists of the nodes and pods, as its watches read."""
    extender = wire(api, Catalog.builtin())  # type: ignore[arg-type]
    for view in extender.views:
        view.replace_nodes([node("inf1", "inf1.6xlarge")])  # 4 devices of 4 cores
        view.replace_pods([msgspec.convert(p, Pod) for p in api.pods.values()])
    extender.synced.set()
    return extender


async def test_a_stale_hold_read_back_after_a_restart_never_frees_a_bound_pods_cores() -> None:
    """A bind gives up on its annotation patch (no answer: it never sent the Binding, and
    disowns the ids) and the patch lands later; another pod is bound onto those cores. A
    restarted extender reads the first pod's ids back as a bind that may still land, over the
    second pod's: both count, and the second's cores never go to another pod (found by
    tests/property/test_binding_model.py, which the last change to set-aside pods broke)."""
    api = FakeAPI()
    for name, limits in (("late", {NEURONCORE: 1}), ("whole", {NEURON: 1})):
        body = pod_json(name, limits, uid=f"uid-{name}")
        body["metadata"]["resourceVersion"] = str(next(api.version))
        api.pods[name] = body
    extender = started(api)

    def bind(name: str) -> ExtenderBindingArgs:
        return ExtenderBindingArgs(name, "default", f"uid-{name}", "inf1")

    api.faults = ["late"]
    assert "failed" in await extender.binder.bind(bind("late"))
    api.in_flight.pop()()  # its annotations land, on a pod still pending
    assert await extender.binder.bind(bind("whole")) == ""
    whole = assignment(msgspec.convert(api.pods["whole"], Pod), None)
    late = handoff.decode(api.pods["late"]["metadata"]["annotations"])  # (pending: announced)
    assert whole is not None and late is not None and late.core_mask & whole.core_mask
    extender = started(api)  # the restart
    assert whole.core_mask & ~extender.ledger.state("inf1").used_cores == 0
    assert await extender.binder.bind(bind("late")) == ""
    again = assignment(msgspec.convert(api.pods["late"], Pod), None)
    assert again is not None and not again.core_mask & whole.core_mask, (again, whole)


async def test_a_retried_bind_of_a_pod_bound_with_a_request_it_cannot_serve_is_done() -> None:
    """kube-scheduler retries a bind whose answer it did not get. The pod is bound to that node
    already, and its request is one the extender refuses (a sidecar asking for a device): the
    bind happened, and is answered so, not with an error the server could not handle."""
    api = FakeAPI()
    body = pod_json("s", {NEURON: 1}, uid="uid-s", node=NODE, init_limits=[{NEURON: 1}])
    body["spec"]["initContainers"][0]["restartPolicy"] = "Always"
    body["metadata"]["resourceVersion"] = str(next(api.version))
    api.pods["s"] = body
    extender = extender_with(api)
    assert await extender.binder.bind(args("s")) == ""
