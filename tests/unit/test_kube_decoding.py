"""Kubernetes objects decode however deep kube-apiserver lets them nest (kube.decoding): a decode
that runs out of depth is done again with what nests past every field we read cut off."""

from __future__ import annotations

import gc
import json
import time

import msgspec
import pytest

from neuron_scheduler.kube.decoding import KEPT_LEVELS, decode, shallow
from neuron_scheduler.kube.objects import Node, Pod
from tests.builders import node_json, pod_json


def deep_fields(levels: int) -> str:
    """What whoever may patch a pod may write in its managedFields, kube-apiserver keeping it."""
    return '{"f:metadata":' + '{"f:a":' * levels + "{}" + "}" * levels + "}"


def with_managed_fields(body: dict[str, object], fields: str) -> str:
    text = json.dumps(body)
    entry = f'{{"manager":"m","operation":"Update","fieldsType":"FieldsV1","fieldsV1":{fields}}}'
    return text.replace('"metadata": {', f'"metadata": {{"managedFields": [{entry}], ', 1)


def test_a_pod_nested_past_any_recursion_limit_decodes_as_it_would_without() -> None:
    body = pod_json("p", {"aws.amazon.com/neuron": 1}, annotations={"NEURON_CORES": "0,1"})
    plain = msgspec.json.decode(json.dumps(body), type=Pod)
    deep = with_managed_fields(body, deep_fields(20_000))
    with pytest.raises(RecursionError):  # what every decode of such a pod met
        msgspec.json.decode(deep, type=Pod)
    assert decode(deep, Pod) == plain
    assert decode(deep.encode(), Pod) == plain
    page = '{"items":[' + ",".join([json.dumps(body), deep]) + "]}"
    assert decode(page, dict[str, list[Pod]])["items"] == [plain, plain]


def test_only_what_nests_past_the_kept_levels_is_cut() -> None:
    shallow_text = with_managed_fields(pod_json("p", {}), deep_fields(KEPT_LEVELS - 10))
    assert shallow(shallow_text) == shallow_text.encode()  # nothing that deep: unchanged
    # Brackets and escaped quotes inside strings are text, not nesting.
    tricky = '{"a": "[[{\\"]]", "b": [[1]], "c": "}"}'
    assert shallow(tricky, levels=2) == b'{"a": "[[{\\"]]", "b": [null], "c": "}"}'
    assert json.loads(shallow("[" * 500 + "]" * 500, levels=3)) == [[[None]]]
    with pytest.raises(msgspec.DecodeError):  # malformed stays malformed
        decode("[" * 5_000, list[int])


def test_an_unterminated_string_ends_the_pass_in_one_scan() -> None:
    """A quote that opens no whole string leaves the text as it is, for the decoder to refuse:
    each later quote started another scan to the end before, quadratic in the body (a 161 KB
    request body held the event loop 67 s). Compared by how the time grows, never by seconds."""

    def body(n: int) -> bytes:
        return b"[" * 1100 + b'"' + b'\\"' * n

    assert shallow(body(10)) == body(10)

    def seconds(n: int) -> float:
        best = float("inf")
        for _ in range(3):
            began = time.perf_counter()
            shallow(body(n))
            best = min(best, time.perf_counter() - began)
        return best

    small, large = seconds(5_000), seconds(40_000)
    assert large < 24 * small, (small, large)  # linear: 8; quadratic: 64


def test_a_decoded_pod_and_node_are_nothing_for_the_garbage_collector_to_scan() -> None:
    """The extender keeps every running pod it watches and every node: tracked by the cyclic
    collector, each pod was 15 objects that every full collection walked (issue 50). Its structs
    are gc=False and its lists tuples, so none is tracked once a young collection has looked at
    the tuples."""
    body = pod_json(
        "p",
        {"aws.amazon.com/neuron": 1},
        labels={"a": "b"},
        annotations={"NEURON_CORES": "0,1"},
    )
    body["spec"]["tolerations"] = [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}]
    pod = msgspec.json.decode(json.dumps(body), type=Pod)
    node = msgspec.json.decode(json.dumps(node_json("n", "trn2.48xlarge")), type=Node)
    gc.collect()  # (untracks tuples that hold nothing tracked)
    parts = [pod, pod.metadata, pod.spec, pod.status, *pod.spec.containers, pod.spec.tolerations]
    parts += [node, node.metadata, node.spec, node.status, node.spec.taints]
    assert [type(part).__name__ for part in parts if gc.is_tracked(part)] == []
