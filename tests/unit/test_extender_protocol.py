"""The extender's HTTP protocol as kube-scheduler speaks it, over a real socket on 127.0.0.1.

Filter and prioritize need only the cache, so they run here without an API server; bind runs
against the real kube-apiserver in tests/e2e.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, NamedTuple

import msgspec
import pytest
import uvicorn

from neuron_scheduler.core.allocation import torus_count_warning
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON as DEV
from neuron_scheduler.core.resources import NEURONCORE as CORE
from neuron_scheduler.extender.http import build_apps
from neuron_scheduler.extender.verbs.wire import ExtenderArgs
from neuron_scheduler.extender.wiring import Extender, wire
from neuron_scheduler.kube.client import KubeAPI
from neuron_scheduler.kube.config import KubeConfig
from tests.builders import node, node_json, pod, pod_json
from tests.testbed.process import free_port

WARNING_7 = torus_count_warning("trn1.32xlarge", 7)
# Filter and prioritize never call the API; bind's 400s come before any call.
NO_API = KubeAPI(KubeConfig("http://127.0.0.1:9"))


class Served(NamedTuple):
    url: str  # the verbs (and /healthz, /readyz)
    metrics_url: str  # /healthz, /readyz, /metrics
    extender: Extender


def _serve(app: Any) -> tuple[str, uvicorn.Server, threading.Thread]:
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    ext = wire(NO_API, Catalog.builtin())
    ledger = ext.ledger
    ledger.replace_nodes(
        [
            node("inf1-a", "inf1.6xlarge"),
            node("inf2-a", "inf2.48xlarge"),
            node("trn1-a", "trn1.32xlarge"),
            node("trn1-b", "trn1.32xlarge"),
        ]
    )
    # inf2-a: devices 1,3,5,7,9,11 taken: no 2 contiguous devices left.
    ledger.apply_pod(
        pod(
            "spread",
            {DEV: 6},
            node="inf2-a",
            annotations={"AWS_NEURON_IDS": "1,3,5,7,9,11", "NEURON_RESOURCE_TYPE": DEV},
        )
    )
    app, side = build_apps(ext, body_limit=1 << 20)
    (url, main, main_thread), (metrics_url, other, other_thread) = _serve(app), _serve(side)
    yield Served(url, metrics_url, ext)
    for server, thread in ((main, main_thread), (other, other_thread)):
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def extender(served: Served) -> tuple[str, Extender]:
    return served.url, served.extender


def post(base: str, path: str, body: bytes | Any, expect: int = 200) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        base + path, data=data, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == expect
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        assert error.code == expect, error.read()
        return json.loads(error.read())


def cache_args(pod_body: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {"Pod": pod_body, "Nodes": None, "NodeNames": names}


def full_args(pod_body: dict[str, Any], nodes: list[dict[str, Any]]) -> dict[str, Any]:
    return {"Pod": pod_body, "Nodes": {"metadata": {}, "items": nodes}, "NodeNames": None}


ALL = ["inf1-a", "inf2-a", "trn1-a", "trn1-b"]
NODE_OBJECTS = [
    node_json("inf1-a", "inf1.6xlarge"),
    node_json("inf2-a", "inf2.48xlarge"),
    node_json("trn1-a", "trn1.32xlarge"),
    node_json("trn1-b", "trn1.32xlarge"),
]


@pytest.mark.parametrize("mode", ["names", "nodes"])
def test_filter_torus_warning_goes_to_unresolvable(
    extender: tuple[str, Extender], mode: str
) -> None:
    base, _ = extender
    body = pod_json("p7", {DEV: 7})
    args = cache_args(body, ALL) if mode == "names" else full_args(body, NODE_OBJECTS)
    result = post(base, "/filter", args)
    assert result["FailedAndUnresolvableNodes"]["trn1-a"] == WARNING_7
    assert result["FailedAndUnresolvableNodes"]["trn1-b"] == WARNING_7
    assert "inf1-a" in result["FailedAndUnresolvableNodes"]  # 4 devices only
    assert result["FailedNodes"]["inf2-a"] == "needs 7 devices; only 6 devices free"
    assert result["NodeNames"] == []
    # Answered in the request's form; never null where kube-scheduler reads.
    assert result["Nodes"] is None if mode == "names" else result["Nodes"]["items"] == []
    assert result["Error"] == ""


@pytest.mark.parametrize("mode", ["names", "nodes"])
def test_filter_two_devices_fit_rings_not_tori(extender: tuple[str, Extender], mode: str) -> None:
    base, _ = extender
    body = pod_json("p2", {DEV: 2})
    args = cache_args(body, ALL) if mode == "names" else full_args(body, NODE_OBJECTS)
    result = post(base, "/filter", args)
    # 2 devices: fine on the empty inf1 chain, refused on tori (not 1/4/8/16), and inf2-a has
    # no two contiguous free devices.
    assert result["NodeNames"] == ["inf1-a"]
    if mode == "nodes":
        assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["inf1-a"]
    assert "largest free contiguous run is 1" in result["FailedNodes"]["inf2-a"]


def test_filter_passes_in_the_request_order_around_refusals(
    extender: tuple[str, Extender],
) -> None:
    """The nodes that pass are found against the few refused (judging.filter): they keep the
    request's order whatever falls between them, unknown names included, and each refusal is
    counted under its own outcome."""
    base, ext = extender

    def counted() -> dict[str, float]:
        registry = ext.metrics.registry
        return {
            outcome: registry.get_sample_value(
                "neuron_scheduler_filter_nodes_total", {"outcome": outcome}
            )
            or 0.0
            for outcome in ("fits", "no_fit", "unresolvable", "not_in_cache")
        }

    before = counted()
    names = ["trn1-b", "inf2-a", "inf1-a", "ghost", "trn1-a"]
    result = post(base, "/filter", cache_args(pod_json("two", {DEV: 2}), names))
    # Two devices: rings only (inf1-a); inf2-a has no two contiguous free; tori take 1/4/8/16.
    assert result["NodeNames"] == ["inf1-a"]
    assert set(result["FailedAndUnresolvableNodes"]) == {"trn1-a", "trn1-b"}
    assert set(result["FailedNodes"]) == {"inf2-a", "ghost"}
    four = post(base, "/filter", cache_args(pod_json("four", {DEV: 4}), names))
    assert four["NodeNames"] == ["trn1-b", "inf1-a", "trn1-a"]  # inf2-a, ghost between them
    assert (
        set(four["FailedNodes"]) == {"inf2-a", "ghost"} and not four["FailedAndUnresolvableNodes"]
    )
    after = counted()
    assert after["fits"] - before["fits"] == 1 + 3
    assert after["no_fit"] - before["no_fit"] == 2  # inf2-a, twice
    assert after["unresolvable"] - before["unresolvable"] == 2  # the tori, for two devices
    assert after["not_in_cache"] - before["not_in_cache"] == 2


def test_filter_without_neuron_request_passes_everything(extender: tuple[str, Extender]) -> None:
    base, _ = extender
    result = post(base, "/filter", cache_args(pod_json("web", {"cpu": 1}), ALL))
    assert result["NodeNames"] == ALL and result["FailedNodes"] == {}


def test_filter_mixed_kinds_is_refused_everywhere(extender: tuple[str, Extender]) -> None:
    base, _ = extender
    result = post(base, "/filter", cache_args(pod_json("mix", [{DEV: 1}, {CORE: 2}]), ALL))
    assert result["NodeNames"] == []
    assert all(
        "more than one Neuron resource kind" in r
        for r in result["FailedAndUnresolvableNodes"].values()
    )


def test_filter_refuses_a_sidecar_asking_for_neuron_resources_everywhere(
    extender: tuple[str, Extender],
) -> None:
    """kubelet keeps a sidecar's devices (an init container with restartPolicy: Always) beside
    the app containers' for the pod's whole life, not reused as a finished init container's:
    counted as one, the pod would hold devices nobody knows of. An init container that runs to
    completion is served as before."""
    base, _ = extender
    body = pod_json("side", [{DEV: 1}], init_limits=[{DEV: 1}])
    result = post(base, "/filter", cache_args(body, ALL))
    assert result["NodeNames"] == ["inf1-a", "inf2-a", "trn1-a", "trn1-b"]
    body["spec"]["initContainers"][0]["restartPolicy"] = "Always"
    result = post(base, "/filter", cache_args(body, ALL))
    assert result["NodeNames"] == []
    assert all(
        "init container 'init0' is a sidecar (restartPolicy: Always)" in reason
        for reason in result["FailedAndUnresolvableNodes"].values()
    ), result


def test_filter_unknown_node_name_is_a_resolvable_failure(extender: tuple[str, Extender]) -> None:
    base, _ = extender
    result = post(base, "/filter", cache_args(pod_json("p", {CORE: 1}), ["new-node"]))
    assert result["FailedNodes"] == {"new-node": "node is not in neuron-scheduler's cache yet"}


def test_full_node_list_judges_nodes_the_cache_has_not_seen(
    extender: tuple[str, Extender],
) -> None:
    """Without nodeCacheCapable, a node kube-scheduler knows before our watch does is judged
    from the request's own copy; a node without Neuron resources can never fit."""
    base, _ = extender
    nodes = [node_json("fresh-inf2", "inf2.24xlarge"), node_json("cpu-only", "m5.large")]
    one = post(base, "/filter", full_args(pod_json("one", {DEV: 1}), nodes))
    assert one["NodeNames"] == ["fresh-inf2"]
    assert one["FailedAndUnresolvableNodes"] == {"cpu-only": "node advertises no Neuron resources"}
    seven = post(base, "/filter", full_args(pod_json("seven", {DEV: 7}), nodes))
    assert seven["NodeNames"] == []
    assert "fresh-inf2" in seven["FailedAndUnresolvableNodes"]  # inf2.24xlarge has 6 devices
    scores = post(base, "/prioritize", full_args(pod_json("six", {DEV: 6}), nodes))
    by_node = {s["Host"]: s["Score"] for s in scores}
    assert by_node["cpu-only"] == 0 and by_node["fresh-inf2"] > 0
    # A node object that makes no sense costs that node only, not the whole answer.
    odd = node_json("odd", "inf2.24xlarge")
    odd["status"]["capacity"]["aws.amazon.com/neuron"] = "lots"
    odd["metadata"]["labels"] = ["not", "a", "map"]
    result = post(base, "/filter", full_args(pod_json("one", {DEV: 1}), [*nodes, odd]))
    assert result["NodeNames"] == ["fresh-inf2"]
    assert "cannot read the node" in result["FailedAndUnresolvableNodes"]["odd"]


def test_values_nested_past_the_limit_where_nothing_reads_are_read_as_absent(
    extender: tuple[str, Extender],
) -> None:
    """Without nodeCacheCapable, kube-scheduler sends each Node whole, managedFields included
    (it strips them from pods only), and whoever may patch a Node may nest them 10,000 deep:
    that node is judged as any other, and so is every other node of the request."""
    base, _ = extender
    nodes = [node_json("fresh-inf2", "inf2.24xlarge"), node_json("deep-inf2", "inf2.24xlarge")]
    nodes[1]["metadata"]["managedFields"] = [{"fieldsV1": "DEEP"}]
    text = json.dumps(full_args(pod_json("one", {DEV: 1}), nodes)).encode()
    body = text.replace(b'"DEEP"', b'{"f:x":' * 5000 + b"{}" + b"}" * 5000)
    with pytest.raises(RecursionError):
        msgspec.json.decode(body)  # what the verb decoded before
    result = post(base, "/filter", body)
    assert result["NodeNames"] == ["fresh-inf2", "deep-inf2"], result
    scores = post(base, "/prioritize", body)
    assert {s["Host"] for s in scores} == {"fresh-inf2", "deep-inf2"}


def test_prioritize_scores_tight_fits_higher(extender: tuple[str, Extender]) -> None:
    base, _ = extender
    scores = post(base, "/prioritize", cache_args(pod_json("p", {DEV: 4}), ALL))
    by_host = {s["Host"]: s["Score"] for s in scores}
    assert by_host["inf1-a"] == 10  # 4 of 4 devices
    assert by_host["inf2-a"] == 0  # does not fit
    # The only pod the cluster has shown asks for 6 devices, which a torus never serves: by
    # demand alone a row of an empty trn1 wastes nothing (core.demand), but a pod of 4 devices
    # or fewer scores no higher than best-fit does, and 4 of a free 16 is a loose fit.
    assert by_host["trn1-a"] == 2
    assert all(0 <= s <= 10 for s in by_host.values())


def test_prioritize_after_filter_is_answered_from_it_over_http(
    extender: tuple[str, Extender],
) -> None:
    """The prioritize verb asks the judge for filter's kept answer before decoding (issue 50):
    the same answer as judged, counted; a request for other nodes is judged."""
    base, ext = extender
    counted = ext.metrics.prioritize_from_filter
    before = counted._value.get()
    asker = pod_json("again", {DEV: 1})
    # Encoded as Go encodes them (no spaces): the names are matched as text.
    passed = post(base, "/filter", msgspec.json.encode(cache_args(asker, ALL)))["NodeNames"]
    assert passed == ["inf1-a", "inf2-a", "trn1-a", "trn1-b"]
    kept = post(base, "/prioritize", msgspec.json.encode(cache_args(asker, passed)))
    assert counted._value.get() == before + 1
    judged = ext.judge.prioritize(msgspec.convert(cache_args(asker, passed), ExtenderArgs))
    assert kept == msgspec.to_builtins(judged)
    post(base, "/prioritize", msgspec.json.encode(cache_args(asker, passed[:2])))
    assert counted._value.get() == before + 1


def test_prioritize_claims_answers_every_node_and_zero_for_pods_without_our_claims(
    extender: tuple[str, Extender],
) -> None:
    """The DRA scoring entry is asked about every pod: without --dra-driver (here), or for a pod
    with no claim of ours, every node scores 0 (tests/unit/test_dra_prioritize.py scores the
    rest)."""
    base, _ = extender
    for body in (pod_json("p", {DEV: 4}), pod_json("q", {})):
        for verb in ("/prioritize-claims", "/prioritize-claims-packing"):
            scores = post(base, verb, cache_args(body, ALL))
            assert {s["Host"]: s["Score"] for s in scores} == dict.fromkeys(ALL, 0)


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/filter", b"{not json", 400, "not JSON"),
        ("/filter", {"Pod": "nope", "NodeNames": []}, 400, "malformed request"),
        ("/filter", {"Pod": None, "NodeNames": ["a"]}, 400, "no Pod"),
        ("/filter", {"Pod": {}, "Nodes": None, "NodeNames": None}, 400, "neither NodeNames"),
        ("/prioritize", [], 400, "malformed"),
        ("/bind", {"PodName": "x"}, 400, "bind needs"),
        ("/preempt", {}, 400, "no Pod"),
        ("/preempt", {"Pod": {"metadata": {"name": "p"}}}, 400, "neither"),
        ("/unknown", {}, 404, "unknown path"),
    ],
)
def test_bad_requests_get_json_errors(
    extender: tuple[str, Extender], path: str, body: Any, status: int, message: str
) -> None:
    base, _ = extender
    result = post(base, path, body, expect=status)
    assert message in result["Error"]
    # The server keeps serving.
    assert post(base, "/filter", cache_args(pod_json("p", {CORE: 1}), ["inf1-a"]))["NodeNames"]


def test_body_over_the_limit_is_refused_before_reading(extender: tuple[str, Extender]) -> None:
    base, _ = extender
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(
            b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2097152\r\n\r\n"
        )
        reply = conn.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 413")
    assert "over the 1048576 limit" in reply


def test_chunked_body_over_the_limit_is_refused(extender: tuple[str, Extender]) -> None:
    """Without a Content-Length the limit is counted as the body arrives."""
    base, _ = extender
    port = int(base.rsplit(":", 1)[1])
    chunk = b"x" * 65536
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(
            b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        with contextlib.suppress(OSError):  # the server may answer and close mid-upload
            for _ in range(17):
                conn.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.sendall(b"0\r\n\r\n")
        reply = conn.recv(4096).decode()
    assert reply.startswith("HTTP/1.1 413")
    assert "over the 1048576 byte limit" in reply


def test_verbs_answer_only_post(extender: tuple[str, Extender]) -> None:
    base, _ = extender
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(base + "/filter", timeout=10)
    assert raised.value.code == 405
    assert raised.value.headers["allow"] == "POST"
    assert "use POST" in json.loads(raised.value.read())["Error"]


def test_a_bug_answers_500_and_the_server_keeps_serving(
    extender: tuple[str, Extender], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, ext = extender

    def broken(*_: Any) -> Any:
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(ext.judge, "prioritize", broken)
    result = post(base, "/prioritize", cache_args(pod_json("p", {CORE: 1}), ALL), expect=500)
    assert result["Error"] == "internal error: ZeroDivisionError: division by zero"
    monkeypatch.undo()
    assert len(post(base, "/prioritize", cache_args(pod_json("p", {CORE: 1}), ALL))) == 4


def test_quantity_that_is_not_a_number(extender: tuple[str, Extender]) -> None:
    """The API server admits no such pod: only a client that is not kube-scheduler sends one,
    and gets a 400 (issue 21; it used to be an unresolvable failure on every node)."""
    base, _ = extender
    body = pod_json("q", {CORE: 1})
    body["spec"]["containers"][0]["resources"]["limits"][CORE] = "lots"
    result = post(base, "/filter", cache_args(body, ["inf1-a"]), expect=400)
    assert "cannot read quantity 'lots'" in result["Error"]


def _hostile_bodies() -> list[tuple[str, str, bytes]]:
    """(verb, what, body): each class of body that once answered 500 (issue 21)."""
    # The pod's limit is the only "1" in it: replaced below by hostile quantities.
    args = json.dumps(cache_args(pod_json("p", {CORE: 1}), ["inf1-a"]))
    deep = b"[" * 100_000 + b"]" * 100_000
    bodies = []
    for verb in ("filter", "prioritize"):
        bodies += [
            (verb, "invalid UTF-8", b'{"Pod": {"metadata": {"name": "\xff"}}, "NodeNames": []}'),
            (verb, "invalid UTF-8 node name", b'{"Pod": {}, "NodeNames": ["\xff"]}'),
            (verb, "node names nested past the limit", b'{"NodeNames": ' + deep + b"}"),
            (verb, "cut off past the limit", b'{"Pod": {"x": ' + b"[" * 5000),
            (verb, "an open string past the limit", b'{"Pod": {"x": ' + deep[:5000] + b'"\\"'),
            (verb, "a Unicode digit", args.replace('"1"', '"\u00b2k"').encode()),
            (verb, "5,000 digits", args.replace('"1"', "1" + "0" * 5000).encode()),
            (verb, "1e100 cores", args.replace('"1"', '"1e100"').encode()),
        ]
    preempt = json.dumps(
        {
            "Pod": pod_json("p", {CORE: 1}),
            "NodeNameToMetaVictims": {"inf1-a": {"Pods": [{"UID": "v"}], "NumPDBViolations": 0}},
        }
    )
    bodies += [
        ("preempt", "invalid UTF-8", b'{"Pod": {}, "NodeNameToMetaVictims": {"\xff": {}}}'),
        ("preempt", "a Unicode digit", preempt.replace('"1"', '"\u00b2k"').encode()),
        ("preempt", "1e100 cores", preempt.replace('"1"', '"1e100"').encode()),
        ("preempt", "a UID that is a number", preempt.replace('"v"', "7").encode()),
        ("preempt", "victims that are a string", preempt.replace('[{"UID": "v"}]', '"v"').encode()),
        ("preempt", "no victims map", b'{"Pod": {"metadata": {"name": "p"}}}'),
    ]
    bodies += [
        ("bind", "invalid UTF-8", b'{"PodName": "\xff", "PodNamespace": "d", "PodUID": "u"}'),
        ("bind", "a name nested past the limit", b'{"PodName": ' + deep + b"}"),
        ("bind", "5,000 digits", b'{"PodName": 1' + b"0" * 5000 + b"}"),
        (
            "bind",
            "a path for a name",
            b'{"PodName": "../../nodes/x", "PodNamespace": "d", "PodUID": "u", "Node": "n"}',
        ),
        (
            "bind",
            "a line break",
            b'{"PodName": "p", "PodNamespace": "d", "PodUID": "u", "Node": "n\\nTraceback"}',
        ),
        (
            "bind",
            "a 100 kB node name",
            b'{"PodName": "p", "PodNamespace": "d", "PodUID": "u", '
            b'"Node": "' + b"n" * 100_000 + b'"}',
        ),
        (
            "bind",
            "a UID with a space",
            b'{"PodName": "p", "PodNamespace": "d", "PodUID": "u 1", "Node": "n"}',
        ),
    ]
    return bodies


@pytest.mark.parametrize(("verb", "what", "body"), _hostile_bodies())
def test_hostile_bodies_are_400s_with_one_line(
    extender: tuple[str, Extender],
    caplog: pytest.LogCaptureFixture,
    verb: str,
    what: str,
    body: bytes,
) -> None:
    base, _ = extender
    with caplog.at_level(logging.ERROR, "neuron_scheduler"):
        result = post(base, f"/{verb}", body, expect=400)
    assert "\n" not in result["Error"] and len(result["Error"]) < 400, result
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], what


def test_health_ready_and_metrics(served: Served) -> None:
    base, ext = served.url, served.extender
    for url in (base, served.metrics_url):
        with urllib.request.urlopen(url + "/healthz") as response:
            assert response.status == 200
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(url + "/readyz")
        assert raised.value.code == 503
    ext.synced.set()
    for url in (base, served.metrics_url):
        with urllib.request.urlopen(url + "/readyz") as response:
            assert response.status == 200
    # /metrics only on its own port: probes and Prometheus need no client certificate.
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(base + "/metrics")
    assert raised.value.code == 404
    # A filter of this test's own (a size no torus allows), whatever ran before it.
    post(base, "/filter", cache_args(pod_json("p7", {DEV: 7}), ["trn1-a"]))
    with urllib.request.urlopen(served.metrics_url + "/metrics") as response:
        text = response.read().decode()
    assert 'neuron_scheduler_node_free_devices{node="inf2-a"} 6.0' in text
    assert 'neuron_scheduler_filter_nodes_total{outcome="unresolvable"}' in text
    assert 'neuron_scheduler_request_seconds_count{verb="filter"}' in text
