"""prioritize after a filter answers from what the filter kept (issue 50), and only while that
still stands: the same pod, exactly the nodes that passed, and no decision dropped in between (a
bind, a pod landing); any other request is decoded and judged."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON as DEV
from neuron_scheduler.core.resources import NEURONCORE as CORE
from neuron_scheduler.core.resources import Unit
from neuron_scheduler.extender.verbs.wire import ExtenderArgs, next_request
from neuron_scheduler.extender.wiring import Extender, wire
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.config import KubeConfig
from tests.builders import node, pod, pod_json

NO_API = KubeAPI(KubeConfig("http://127.0.0.1:9"))
NAMES = ["inf2-a", "inf2-b", "inf2-c"]


POD = pod_json("p", {DEV: 2})  # (each pod_json has a uid of its own)


def body_of(names: list[str], asker: dict[str, Any] = POD, **fields: Any) -> bytes:
    """A request as kube-scheduler encodes one with nodeCacheCapable."""
    sent = {"Pod": asker, "Nodes": None, "NodeNames": names, **fields}
    return msgspec.json.encode(sent)


@pytest.fixture
def extender() -> Extender:
    ext = wire(NO_API, Catalog.builtin())
    ext.ledger.replace_nodes([node(name, "inf2.48xlarge") for name in NAMES])
    return ext


def filtered(ext: Extender, body: bytes) -> list[str]:
    return ext.judge.filter(msgspec.json.decode(body, type=ExtenderArgs), body).passed


def judged(ext: Extender, body: bytes) -> bytes:
    """prioritize's answer the long way: the request decoded and judged."""
    args = msgspec.json.decode(body, type=ExtenderArgs)
    return msgspec.json.encode(ext.judge.prioritize(args, body))


def from_filter(ext: Extender) -> float:
    value: float = ext.metrics.prioritize_from_filter._value.get()
    return value


def test_after_a_filter_every_node_passed_the_answer_is_the_judged_one(
    extender: Extender,
) -> None:
    body = body_of(NAMES)
    assert filtered(extender, body) == NAMES
    decisions = extender.ledger.decisions
    answer = extender.judge.answer_as_filtered(body)
    assert answer is not None
    assert extender.ledger.decisions == decisions  # nothing decided again
    assert from_filter(extender) == 1
    assert answer == judged(extender, body)
    assert [h["Host"] for h in msgspec.json.decode(answer)] == NAMES


def test_after_a_filter_some_nodes_failed_the_passed_ones_are_answered(
    extender: Extender,
) -> None:
    full = pod("full", {DEV: 12})
    extender.ledger.reserve(full, "inf2-c", Placement(tuple(range(12)), tuple(range(24)), 0))
    assert filtered(extender, body_of(NAMES)) == ["inf2-a", "inf2-b"]
    prioritized = body_of(["inf2-a", "inf2-b"])  # what kube-scheduler sends next
    answer = extender.judge.answer_as_filtered(prioritized)
    assert answer is not None
    assert answer == judged(extender, prioritized)
    # The nodes filter was asked about are not the ones that passed: judged.
    assert extender.judge.answer_as_filtered(body_of(NAMES)) is None


def test_a_bind_between_filter_and_prioritize_is_seen(extender: Extender) -> None:
    """A bind on inf2-b (10 of its 12 devices) between the two calls: the free pair left there
    now fits the pod exactly; prioritize must say so, not what filter saw."""
    body = body_of(NAMES)
    assert filtered(extender, body) == NAMES
    before = {h["Host"]: h["Score"] for h in msgspec.json.decode(judged(extender, body))}
    big = pod("big", {DEV: 10})
    extender.ledger.reserve(big, "inf2-b", Placement(tuple(range(10)), tuple(range(20)), 0))
    assert extender.judge.answer_as_filtered(body) is None
    after = {h["Host"]: h["Score"] for h in msgspec.json.decode(judged(extender, body))}
    assert after["inf2-b"] != before["inf2-b"]  # (else this test could not fail)
    assert from_filter(extender) == 0


@pytest.mark.parametrize(
    "other",
    [
        body_of(NAMES, pod_json("q", {DEV: 2})),  # another pod
        body_of(NAMES, {**POD, "metadata": {**POD["metadata"], "resourceVersion": "9"}}),
        body_of(list(reversed(NAMES))),  # the same nodes in another order
        body_of(NAMES[:2]),  # fewer nodes
        body_of(NAMES, Nodes={"metadata": {}, "items": []}),  # a NodeList too
        json.dumps({"Pod": POD, "Nodes": None, "NodeNames": NAMES}).encode(),  # spaces
        b'{"Pod":7,' + body_of(NAMES)[1:],  # the same, after a "Pod" of the wrong type
        b'{"Pod": nul',  # not JSON
        b'{"Pod": 7}',  # JSON of another shape
    ],
)
def test_any_other_request_is_judged(extender: Extender, other: bytes) -> None:
    """Only the very bytes kube-scheduler sends are answered from filter's: anything else is
    decoded and judged (and answered 400 if it does not decode, as before)."""
    assert filtered(extender, body_of(NAMES)) == NAMES
    assert extender.judge.answer_as_filtered(body_of(NAMES)) is not None
    assert extender.judge.answer_as_filtered(other) is None


def test_new_demand_between_filter_and_prioritize_is_seen(extender: Extender) -> None:
    """A pod of a shape not seen before changes the demand weights placement goes by: the
    ledger drops all kept verdicts (other objects now, none of their decisions dropped). A
    one-core pod then keeps whole the devices 8-device pods need."""
    body = body_of(NAMES, pod_json("one", {CORE: 1}))
    assert filtered(extender, body) == NAMES
    before = judged(extender, body)
    version = extender.ledger.demand.version
    extender.ledger.demand.record(Unit.DEVICE, 8)
    assert extender.ledger.demand.version != version
    assert extender.judge.answer_as_filtered(body) is None
    assert judged(extender, body) != before  # (else this test could not fail)


def test_a_filter_without_a_neuron_request_keeps_nothing(extender: Extender) -> None:
    body = body_of(NAMES)
    assert filtered(extender, body) == NAMES
    plain = msgspec.json.encode({"Pod": pod_json("plain", {}), "NodeNames": NAMES})
    assert filtered(extender, plain) == NAMES
    assert extender.judge.answer_as_filtered(body) is None  # the last filter was another's
    assert extender.judge.answer_as_filtered(plain) is None


def test_the_next_request_is_the_filter_request_with_the_passed_names() -> None:
    body = body_of(NAMES)
    assert next_request(body, NAMES, list(NAMES)) is body
    assert next_request(body, NAMES, NAMES[:2]) == body_of(NAMES[:2])
    spaced = json.dumps({"Pod": POD, "Nodes": None, "NodeNames": NAMES}).encode()
    assert next_request(spaced, NAMES, list(NAMES)) is spaced  # the same bytes decode the same
    assert next_request(spaced, NAMES, NAMES[:2]) is None  # not a form whose names it can replace


@pytest.mark.parametrize("held_devices", [10, 12])
def test_ids_held_until_a_time_that_passes_during_a_filter_leave_no_stale_mark(
    held_devices: int,
) -> None:
    """A bind's announced ids (written on a pod not bound yet) are held until a deadline, which
    can pass inside a filter: between its read of the kept marks and its deciding the nodes that
    had none. The node they were on then fits as it does now (not refused as unknown to the
    cache), and prioritize is answered as judging now would (no score kept from before)."""
    ext = wire(NO_API, Catalog.builtin())
    ledger = ext.ledger
    now = [1_000_000.0]
    ledger.wall_clock = lambda: now[0]
    ledger.replace_nodes([node("a", "inf2.48xlarge")])
    ids = ",".join(map(str, range(held_devices)))
    annotations = {
        "AWS_NEURON_IDS": ids,
        "NEURON_NODE": "a",
        "NEURON_ALLOC_TIME": str(int(now[0] * 1e9)),
        "NEURON_RESOURCE_TYPE": DEV,
    }
    ledger.apply_pod(pod("x", {DEV: held_devices}, scheduler="nobody", annotations=annotations))
    (until,) = [announced.until for _, announced in ledger._announced.items()]
    filtered(ext, body_of(["a"]))  # a's mark kept while the ids are held
    ledger.replace_nodes([node("a", "inf2.48xlarge"), node("b", "inf2.48xlarge")])
    deciding = ledger.fill_verdicts

    def fill_later(*args: Any, **kwargs: Any) -> Any:
        now[0] = until + 1  # the hold ends as filter decides b
        return deciding(*args, **kwargs)

    ledger.fill_verdicts = fill_later  # type: ignore[method-assign]
    body = body_of(["a", "b"])
    result = ext.judge.filter(msgspec.json.decode(body, type=ExtenderArgs), body)
    ledger.fill_verdicts = deciding  # type: ignore[method-assign]
    assert result.passed == ["a", "b"], (result.failed, result.unresolvable)
    kept = ext.judge.answer_as_filtered(body)
    assert kept is None or kept == judged(ext, body)
