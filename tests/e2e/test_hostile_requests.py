"""Issue 15, part 4: more than 10,000 hostile requests to the real extender, as a caller holding
kube-scheduler's client certificate (the worst case: a leaked certificate) would send them.

The extender is the shared Stack's (the chart's least-privilege ServiceAccount, HTTPS with client
certificates). It must answer every request without a 5xx and without a traceback in its log,
keep answering /healthz, grow by less than 50 MB, and leave the cluster and its ledger as they
were: every bind here is for a pod that does not exist, or one it must refuse.
"""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from neuron_scheduler.core import handoff
from neuron_scheduler.core.planrecord import PLAN_ANNOTATION
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE
from tests.builders import pod_json
from tests.e2e import hostile
from tests.e2e.harness import Scenario, ids, wait_for
from tests.e2e.hostile import NO_ANSWER, Caller, Tally, post
from tests.testbed import ExtenderProcess, KubeError, Stack

pytestmark = pytest.mark.e2e

SCHEMA_EXAMPLES = 2000  # per verb family; each is also sent cut short
RSS_GROWTH_MB = 50
MANY = 100_000


class Probe:
    """/healthz sampled from a thread all along: every answer's latency, and every failure."""

    def __init__(self, extender: ExtenderProcess) -> None:
        self.extender = extender
        self.samples: list[float] = []
        self.failures: list[str] = []
        self.answered_at: list[float] = []
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.extender.healthz_seconds())
                self.answered_at.append(time.monotonic())
            except OSError as error:
                self.failures.append(str(error))
            self._stop.wait(0.02)

    @contextmanager
    def running(self) -> Iterator[None]:
        thread = threading.Thread(target=self._run, daemon=True)
        started = time.monotonic()
        self.answered_at.append(started)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join(60)

    @property
    def p99(self) -> float:
        return statistics.quantiles(self.samples, n=100)[98]

    @property
    def longest_silence(self) -> float:
        times = self.answered_at
        return max(b - a for a, b in itertools.pairwise(times))


def ledger_view(extender: ExtenderProcess) -> dict[str, float]:
    """The extender's per-node view as it exports it."""
    keep = ("neuron_scheduler_node_", "neuron_scheduler_cached_pods")
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in extender.metrics().splitlines()
        if line.startswith(keep)
    }


def cluster_pods(scenario: Scenario) -> dict[str, Any]:
    """Every pod's placement and annotations, and this test's pods' resourceVersions."""
    listed = scenario.cp.request("GET", "/api/v1/pods")["items"]
    view = {}
    for pod in listed:
        meta = pod["metadata"]
        mine = meta["namespace"] == scenario.namespace
        view[meta["uid"]] = (
            pod["spec"].get("nodeName"),
            meta.get("annotations", {}),
            meta["resourceVersion"] if mine else None,
        )
    return view


def peak_rss_mb(extender: ExtenderProcess) -> float:
    for line in Path(f"/proc/{extender.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def traceback_lines(extender: ExtenderProcess, offset: int) -> list[str]:
    text = extender.process.log_path.read_text(errors="replace")[offset:]
    return [line for line in text.splitlines() if "Traceback (most recent call last)" in line]


class World:
    """The scenario's nodes and pods: some bound by the extender, the rest binds must refuse."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        extender = scenario.stack.extender
        self.nodes = [
            scenario.add_node("inf1.6xlarge"),
            scenario.add_node("trn1.32xlarge"),
            scenario.add_node("inf2.48xlarge"),
        ]
        self.bound = []
        for i, (node, limits) in enumerate(
            zip(self.nodes, [{NEURON: 2}, {NEURONCORE: 5}, {NEURONDEVICE: 3}], strict=True)
        ):
            pod = scenario.create_pod(f"held{i}", limits, scheduler="nobody")
            assert extender.bind(pod, node) == ""
            self.bound.append(scenario.pod(f"held{i}"))
        namespace = scenario.namespace

        def refusable(name: str, limits: dict[str, int], **kwargs: Any) -> dict[str, Any]:
            body = pod_json(name, limits, namespace=namespace, **kwargs)
            del body["metadata"]["uid"], body["status"]
            created: dict[str, Any] = scenario.cp.request(
                "POST", f"/api/v1/namespaces/{namespace}/pods", body
            )
            return created

        # Each pending pod is one a bind must refuse, whatever node it names.
        self.refusable = [
            refusable("foreign", {NEURON: 1}, scheduler="other-scheduler"),
            refusable(
                "nowhere", {NEURONCORE: 1}, scheduler="nobody", node_selector={"no-such-label": "x"}
            ),
            refusable("cpu-only", {"cpu": 1}, scheduler="nobody"),
        ]
        self.pods = self.bound + self.refusable
        self.strings = [
            namespace,
            *self.nodes,
            *(p["metadata"]["name"] for p in self.pods),
            *(p["metadata"]["uid"] for p in self.pods),
        ]
        self.filter_args = {
            "Pod": pod_json("p", {NEURONCORE: 2}, namespace=namespace),
            "NodeNames": self.nodes,
        }

    def binds(self) -> Iterator[dict[str, str]]:
        """Binds with missing, wrong and right UIDs against real pods and nodes, all refused."""
        for pod in self.pods:
            meta = pod["metadata"]
            uids = [meta["uid"], "", "0" * 36, meta["uid"].upper(), meta["uid"] + " ", None]
            for node in [*self.nodes, "unknown-node", ""]:
                for uid in uids:
                    args = {
                        "PodName": meta["name"],
                        "PodNamespace": meta["namespace"],
                        "Node": node,
                    }
                    if uid is not None:
                        args["PodUID"] = uid
                    yield args
                    yield {**args, "PodNamespace": "default"}
                    yield {k: v for k, v in args.items() if k != "PodName"}


def quantity_bodies(world: World) -> Iterator[bytes]:
    for verb_args in (world.filter_args,):
        for value in hostile.QUANTITIES:
            for resource in (NEURON, NEURONCORE, NEURONDEVICE):
                for where in ("containers", "initContainers"):
                    for kind in ("limits", "requests"):
                        body = json.loads(json.dumps(verb_args))
                        pod = body["Pod"]
                        pod["spec"].setdefault(where, [{"name": "x", "resources": {}}])
                        pod["spec"][where][0]["resources"] = {kind: {resource: value}}
                        yield json.dumps(body).encode()


def many_containers(world: World) -> Iterator[bytes]:
    mixes = [
        ([{NEURONCORE: 1}] * 50, [{NEURONCORE: 2}] * 50),
        ([{NEURON: 1}] * 50, [{NEURON: 16}] * 50),
        ([{NEURON: 1}] * 25 + [{NEURONCORE: 1}] * 25, [{NEURONDEVICE: 1}] * 50),
        ([{"cpu": 1}] * 50, [{NEURONCORE: 10**6}] * 50),
        ([{NEURONCORE: 0}] * 50, None),
    ]
    for containers, init in mixes:
        pod = pod_json("wide", containers, namespace=world.scenario.namespace, init_limits=init)
        for names in (world.nodes, [*world.nodes, "unknown"] * 10):
            yield json.dumps({"Pod": pod, "NodeNames": names}).encode()
            items = [{"metadata": {"name": n}} for n in names]
            yield json.dumps({"Pod": pod, "Nodes": {"items": items}}).encode()


def malformed(world: World) -> Iterator[bytes]:
    good = json.dumps(world.filter_args).encode()
    step = max(1, len(good) // 300)
    for cut in range(0, len(good), step):
        yield good[:cut]
    yield from [
        b"",
        b"null",
        b"[]",
        b"{}",
        b"0",
        b'"x"',
        b"true",
        b"{,}",
        b"{'Pod': 1}",
        b"\xef\xbb\xbf{}",
        b"NaN",
        b"Infinity",
        b'{"Pod": NaN}',
        b'{"NodeNames": [1e999]}',
        b"{}" * 1000,
        b'{"Pod": {}, "Pod": null, "NodeNames": []}',
        b"/* c */ {}",
        b'{"NodeNames": ["a",]}',
        b"\x00" * 100,
        bytes(range(256)),
        b'{"NodeNames": ["\\ud800"]}',
        b'{"NodeNames": ["\\u0000"]}',
        b'{"NodeNames": ["\xed\xa0\x80"]}',
        b'{"Pod": {"metadata": {"name": "\xc0\xaf"}}, "NodeNames": []}',
        b'{"NodeNames": "' + b"a" * 100_000 + b'"}',
        b" " * 100_000,
        b"\n" * 10_000,
    ]


def deep(world: World) -> Iterator[tuple[str, bytes]]:
    for depth in (10, 100, 1000, 10_000, 100_000):
        arrays, objects = b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth
        for nested in (arrays, objects):
            for verb in ("filter", "prioritize"):
                yield verb, b'{"Pod": {"spec": ' + nested + b'}, "NodeNames": []}'
                yield verb, b'{"Pod": {"metadata": {"labels": ' + nested + b"}}}"
                yield verb, b'{"NodeNames": ' + nested + b"}"
            yield "bind", b'{"PodName": ' + nested + b"}"


def unicode_bodies(world: World) -> Iterator[tuple[str, bytes]]:
    texts = [*hostile.HOSTILE_STRINGS, "\u0000" * 1000, "\U0010ffff", "\ud7ff", "\u2028\u2029"]
    for text in texts:
        pod = pod_json(
            text or "x",
            {NEURONCORE: 1},
            namespace=text,
            annotations={text: text, "AWS_NEURON_IDS": text},
            labels={text: text},
            node_selector={text: text},
        )
        pod["spec"]["containers"][0]["name"] = text
        pod["spec"]["containers"][0]["resources"]["limits"][text] = text
        for ascii_only in (True, False):
            dump = json.dumps
            yield (
                "filter",
                dump(
                    {"Pod": pod, "NodeNames": [text, *world.nodes]}, ensure_ascii=ascii_only
                ).encode(),
            )
            yield (
                "prioritize",
                dump({"Pod": pod, "NodeNames": [text] * 100}, ensure_ascii=ascii_only).encode(),
            )
            yield (
                "bind",
                dump(
                    {"PodName": text, "PodNamespace": text, "PodUID": text, "Node": text},
                    ensure_ascii=ascii_only,
                ).encode(),
            )
            yield (
                "bind",
                dump(
                    {
                        "PodName": "held0",
                        "PodNamespace": world.scenario.namespace,
                        "PodUID": text,
                        "Node": text,
                    },
                    ensure_ascii=ascii_only,
                ).encode(),
            )


def odd_requests() -> Iterator[tuple[str, str, bytes]]:
    methods = ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "BREW", "CONNECT"]
    paths = [
        "/filter",
        "/prioritize",
        "/bind",
        "/preempt",
        "/",
        "/unknown",
        "/filter/",
        "/filter/x",
        "/FILTER",
        "//filter",
        "/filter?x=1",
        "/filter#x",
        "/%66ilter",
        "/../filter",
        "/metrics",
        "/healthz",
        "/readyz",
        "/" + "a" * 4000,
        "/filter%00",
        "/%C3%A9",
        "/%ff",
    ]
    for method in methods:
        for path in paths:
            yield method, path, b"{}"
    for path in paths:
        yield "POST", path, b'{"NodeNames": []}'


def test_node_names_with_newlines_or_nul_cannot_forge_a_log_line(stack: Stack) -> None:
    """Issue 35: the extender writes what a request names (NodeNames, the pod's name) escaped,
    so a caller cannot add lines of its choosing to its log."""
    extender = stack.extender
    scenario = Scenario(stack)
    try:
        node = scenario.add_node("inf1.6xlarge")
        marker = f"forged-{scenario.id}"
        forged = f"2001-01-01 00:00:00,000 WARNING neuron_scheduler.extender: {marker}"
        names = [f"{node}\n{forged}", f"{node}\r{forged}", f"{node}\x00{forged}", "x" * 50_000]
        offset = extender.process.log_path.stat().st_size
        # More devices than an inf1.6xlarge has: no node passes, so filter logs at INFO what it
        # refused, and why (with a node that passed, its lines are DEBUG).
        for verb in ("filter", "prioritize"):
            body = {"Pod": pod_json(f"p\n{forged}", {NEURON: 8}), "NodeNames": [node, *names]}
            status, _ = extender.call(verb, body)
            assert status == 200, verb
        victims = {name: {"Pods": [{"UID": "u"}], "NumPDBViolations": 0} for name in names}
        status, _ = extender.call(
            "preempt", {"Pod": pod_json("p", {NEURON: 1}), "NodeNameToMetaVictims": victims}
        )
        assert status == 200
        log = extender.process.log_path.read_bytes()[offset:]
        text = log.decode(errors="replace")
        assert "\\n" + forged in text  # logged, escaped
        assert b"\x00" not in log and b"\r" not in log
        assert not [line for line in text.splitlines() if line.startswith(("2001", marker))]
        assert max(len(line) for line in text.splitlines()) < 20_000
    finally:
        scenario.cleanup()


@pytest.mark.compat
def test_a_stolen_extender_token_may_change_only_our_pod_annotations(stack: Stack) -> None:
    """The chart's admission policy `<extender>-pod-writes`: `pods patch` is cluster-wide, and a
    pod update may change container images; the extender's token may change only our annotation
    keys and the autoscalers' do-not-disrupt marks. Every other test runs the extender under the
    same policy, so each patch it really sends passes it."""
    cp = stack.cp
    name = f"stolen-{time.monotonic_ns()}"
    created = cp.request(
        "POST", "/api/v1/namespaces/default/pods", pod_json(name, {}, scheduler="nobody")
    )
    path = f"/api/v1/namespaces/default/pods/{name}"
    as_extender = cp.client_for(stack.extender_token)

    def write(body: dict[str, Any], subresource: str = "") -> KubeError | None:
        try:
            as_extender.request(
                "PATCH", path + subresource, body, content_type="application/merge-patch+json"
            )
        except KubeError as error:
            return error
        return None

    try:
        ours = {"neuron-scheduler.io/woken": "1", "karpenter.sh/do-not-disrupt": "true"}
        assert write({"metadata": {"annotations": ours}}) is None
        image = {"spec": {"containers": [{"name": "c0", "image": "attacker.example/evil:1"}]}}
        # The policy is enforced from its binding's first reconcile on: wait for a refusal.
        refused = wait_for(lambda: write(image), "the policy to refuse an image change", 30)
        assert refused.status == 403 and "may not change a pod's spec" in str(refused), refused
        for body, text in (
            ({"metadata": {"labels": {"evil": "yes"}}}, "spec, labels"),
            ({"metadata": {"annotations": {"other.example/key": "x"}}}, "not other.example/key"),
            ({"metadata": {"finalizers": ["example.com/hold"]}}, "finalizers"),
        ):
            error = write(body)
            assert error is not None and error.status == 403 and text in str(error), (body, error)
        # A status write cannot change the spec, but it can change labels, annotations and
        # finalizers (only owners are kept), and the extender may patch pods/status
        # cluster-wide (nominations, DisruptionTarget): the policy sees those writes too.
        for body, text in (
            ({"metadata": {"labels": {"evil": "yes"}}}, "spec, labels"),
            ({"metadata": {"annotations": {"other.example/key": "x"}}}, "not other.example/key"),
            ({"metadata": {"finalizers": ["example.com/hold"]}}, "finalizers"),
        ):
            error = write(body, "/status")
            assert error is not None and error.status == 403 and text in str(error), (body, error)
        assert write({"status": {"nominatedNodeName": "n1"}}, "/status") is None
        pod = cp.request("GET", path)
        assert "evil" not in pod["metadata"].get("labels", {})
        assert not pod["metadata"].get("finalizers")
        assert pod["spec"]["containers"][0]["image"] == created["spec"]["containers"][0]["image"]
        assert "other.example/key" not in pod["metadata"]["annotations"]
    finally:
        cp.request("DELETE", path)


def test_only_the_extender_writes_consolidation_plans(stack: Stack) -> None:
    """The chart's admission policy `<extender>-plans`: the leader evicts what a plan on a pod
    names, so nobody else may add or change one, on create or update; anyone may remove one
    (that cancels it). The extender's own plans pass (test_consolidation)."""
    cp = stack.cp
    plan = {PLAN_ANNOTATION: '{"v":1}'}
    name = f"planner-{time.monotonic_ns()}"
    path = f"/api/v1/namespaces/default/pods/{name}"
    body = pod_json(name, {NEURON: 1}, scheduler="nobody", annotations=plan)

    def refused() -> KubeError | None:
        try:
            cp.request("POST", "/api/v1/namespaces/default/pods", body)
        except KubeError as error:
            return error
        cp.request("DELETE", path)
        return None

    # The policy is enforced from its binding's first reconcile on: wait for a refusal.
    error = wait_for(refused, "the policy to refuse a plan written by someone else", 30)
    assert error.status == 403 and "only neuron-scheduler's extender writes" in str(error)
    cp.request("POST", "/api/v1/namespaces/default/pods", pod_json(name, {}, scheduler="nobody"))
    try:
        with pytest.raises(KubeError) as caught:
            cp.request(
                "PATCH",
                path,
                {"metadata": {"annotations": plan}},
                content_type="application/merge-patch+json",
            )
        assert caught.value.status == 403
        # Nor through the status subresource, which may change annotations too (whoever may
        # write pods' status: other schedulers and controllers).
        with pytest.raises(KubeError) as caught:
            cp.request(
                "PATCH",
                path + "/status",
                {"metadata": {"annotations": plan}},
                content_type="application/merge-patch+json",
            )
        assert caught.value.status == 403
        # Nor through a Binding, whose annotations the API server copies onto the pod.
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "annotations": plan},
            "target": {"apiVersion": "v1", "kind": "Node", "name": "nowhere"},
        }
        for binding_path in (path + "/binding", "/api/v1/namespaces/default/bindings"):
            with pytest.raises(KubeError) as caught:
                cp.request("POST", binding_path, binding)
            assert caught.value.status == 403, (binding_path, caught.value)
            assert "only neuron-scheduler's extender writes" in str(caught.value), caught.value
        assert PLAN_ANNOTATION not in cp.request("GET", path)["metadata"].get("annotations", {})
        # The extender may write one (it would patch only a pending Neuron pod's); removing one
        # is anyone's.
        as_extender = cp.client_for(stack.extender_token)
        as_extender.request(
            "PATCH",
            path,
            {"metadata": {"annotations": plan}},
            content_type="application/merge-patch+json",
        )
        cp.request(
            "PATCH",
            path,
            {"metadata": {"annotations": {PLAN_ANNOTATION: None}}},
            content_type="application/merge-patch+json",
        )
    finally:
        cp.request("DELETE", path)


HAND_OFF_REFUSED = "only neuron-scheduler's extender and device plugin write the Neuron hand-off"


@pytest.mark.compat
def test_only_the_extender_and_device_plugin_write_hand_off_annotations(stack: Stack) -> None:
    """The chart's admission policy `<extender>-hand-off`: a tenant who may create, update and
    bind pods in its namespace cannot add, change or remove the ids a pod holds, on create, on
    update, through status or through a Binding (both paths); its other annotations stay its
    own, NEURON_ALLOCATED among them (AWS's device plugin writes it). The extender and a cluster
    admin may write the ids. (The device plugin's corrections pass it in
    test_real_kubelet, which runs the plugin as the chart's ServiceAccount under it.)"""
    cp = stack.cp
    scenario = Scenario(stack)
    namespace = scenario.namespace
    tenant = cp.pod_user(
        namespace,
        "tenant",
        ["create", "update", "patch"],
        resources=("pods", "pods/status", "pods/binding", "bindings"),
    )
    pods = f"/api/v1/namespaces/{namespace}/pods"
    held = {"AWS_NEURON_IDS": "0", "NEURON_CORES": "0", "NEURON_NODE": "n1"}

    def as_tenant(method: str, path: str, body: dict[str, Any]) -> KubeError | None:
        try:
            if method == "POST":
                tenant.create(path, body)
            else:
                tenant.request(method, path, body, content_type="application/merge-patch+json")
        except KubeError as error:
            return error
        return None

    def annotate(values: dict[str, str | None]) -> dict[str, Any]:
        return {"metadata": {"annotations": values}}

    try:
        squat = pod_json(
            "squat", {NEURON: 1}, namespace=namespace, scheduler="nobody", annotations=held
        )

        def created() -> KubeError | None:
            error = as_tenant("POST", pods, squat)
            if error is None:  # (the policy not in force yet)
                cp.request("DELETE", f"{pods}/squat")
            return error

        error = wait_for(created, "the policy to refuse a tenant's pod with ids", 30)
        assert error.status == 403, error
        assert HAND_OFF_REFUSED in str(error), error
        assert "not AWS_NEURON_IDS, NEURON_CORES, NEURON_NODE" in str(error), error
        for key in sorted(set(handoff.OURS) - {handoff.ALLOCATED, handoff.ALLOCATED_CONTAINERS}):
            alone = pod_json(
                "alone", {}, namespace=namespace, scheduler="nobody", annotations={key: "0"}
            )
            error = as_tenant("POST", pods + "?dryRun=All", alone)
            assert error is not None and f"not {key}:" in str(error), (key, error)
        plain = pod_json("plain", {NEURON: 1}, namespace=namespace, scheduler="nobody")
        assert as_tenant("POST", pods, plain) is None
        path = f"{pods}/plain"
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": "plain", "annotations": held},
            "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
        }
        refused = {
            "an update": as_tenant("PATCH", path, annotate(held)),
            "a status write": as_tenant("PATCH", path + "/status", annotate(held)),
            "a Binding": as_tenant("POST", path + "/binding", binding),
            "a Binding by the older path": as_tenant(
                "POST", f"/api/v1/namespaces/{namespace}/bindings", binding
            ),
        }
        for how, error in refused.items():
            assert error is not None and error.status == 403, (how, error)
            assert HAND_OFF_REFUSED in str(error), (how, error)
        assert not set(held) & set(cp.request("GET", path)["metadata"].get("annotations", {}))
        # A cluster admin may repair them by hand, and the extender writes them at bind.
        cp.request("PATCH", path, annotate(held), content_type="application/merge-patch+json")
        as_extender = cp.client_for(stack.extender_token)
        as_extender.request(
            "PATCH",
            path,
            annotate({"NEURON_CORES": "1", "AWS_NEURON_IDS": "1"}),
            content_type="application/merge-patch+json",
        )
        # Once there, the tenant can neither change nor remove them...
        for values in ({"AWS_NEURON_IDS": "2"}, {"NEURON_NODE": None}, {"NEURON_DEVS": "0"}):
            error = as_tenant("PATCH", path, annotate(values))
            assert error is not None and error.status == 403, (values, error)
        # ... but the pod's other annotations are still its own, NEURON_ALLOCATED among them.
        mine = {"example.com/team": "a", "NEURON_ALLOCATED": "true"}
        assert as_tenant("PATCH", path, annotate(mine)) is None
        annotations = cp.request("GET", path)["metadata"]["annotations"]
        assert annotations["AWS_NEURON_IDS"] == "1" and annotations["NEURON_NODE"] == "n1"
        assert annotations["example.com/team"] == "a"
    finally:
        scenario.cleanup()


def test_ten_thousand_hostile_requests(stack: Stack) -> None:
    extender = stack.extender
    scenario = Scenario(stack)
    try:
        world = World(scenario)
        run_attack(scenario, world, extender)
    finally:
        scenario.cleanup()


def run_attack(scenario: Scenario, world: World, extender: ExtenderProcess) -> None:
    # kube-scheduler checks the certificate's name through tlsConfig.serverName; the chain is
    # checked here too.
    context = scenario.stack.pki.client_context(check_hostname=False)
    log_offset = extender.process.log_path.stat().st_size
    # Earlier tests' deletions may still be reaching the extender's watch: a view that holds still.
    views = [ledger_view(extender)]
    while len(views) < 2 or views[-1] != views[-2]:
        time.sleep(0.5)
        views.append(ledger_view(extender))
        assert len(views) < 60, "the extender's ledger does not settle"
    before_ledger = views[-1]
    before_pods = cluster_pods(scenario)
    assert any(world.nodes[0] in key for key in before_ledger)
    rss_before = extender.rss_mb()
    tally = Tally()
    caller = Caller(extender.port, context, tally)
    probe = Probe(extender)
    began = time.monotonic()
    with probe.running():
        schema_attack(world, caller)
        caller.send_all(
            "malformed", [post(f"/{v}", b) for b in malformed(world) for v in ("filter", "bind")]
        )
        caller.send_all("deep", [post(f"/{v}", b) for v, b in deep(world)])
        caller.send_all(
            "quantities",
            [post(f"/{v}", b) for b in quantity_bodies(world) for v in ("filter", "prioritize")],
        )
        caller.send_all(
            "containers",
            [post(f"/{v}", b) for b in many_containers(world) for v in ("filter", "prioritize")],
        )
        caller.send_all("unicode", [post(f"/{v}", b) for v, b in unicode_bodies(world)])
        caller.send_all("binds", [post("/bind", b) for b in world.binds()])
        caller.send_all("methods", list(odd_requests()))
        many_nodes(world, caller)
        over_limit(extender, context, tally)
        slow(extender, context, world, tally)
        concurrent(extender, context, world, tally)
    seconds = time.monotonic() - began
    peak = peak_rss_mb(extender)
    # What the process still holds once it has given back what it freed (extender/memory.py
    # looks every few seconds).
    deadline = time.monotonic() + 30
    while extender.rss_mb() - rss_before >= RSS_GROWTH_MB and time.monotonic() < deadline:
        time.sleep(0.5)
    rss_after = extender.rss_mb()
    print(
        f"\nhostile requests in {seconds:.1f}s; RSS {rss_before:.0f} -> {rss_after:.0f} MB "
        f"(peak {peak:.0f}); "
        f"/healthz p99 {probe.p99 * 1000:.1f} ms over {len(probe.samples)} probes, longest "
        f"silence {probe.longest_silence:.2f}s"
    )
    for kind, statuses in tally.statuses.items():
        print(f"  {kind}: {sum(statuses.values())} {dict(sorted(statuses.items()))}")

    assert tally.total() >= 10_000, tally.total()
    assert not tally.server_errors(), tally.server_errors()
    # Only a client that hangs up or overflows the limit may go without an answer.
    assert set(tally.unanswered()) <= {"over-limit"}, tally.unanswered()
    assert extender.process.alive(), extender.process.log_tail()
    assert not traceback_lines(extender, log_offset), extender.process.log_tail(80)
    assert not probe.failures, probe.failures[:5]
    # kubelet restarts the extender after 3 failed probes 10 s apart (the chart's liveness probe).
    assert probe.longest_silence < 30, probe.longest_silence
    assert rss_after - rss_before < RSS_GROWTH_MB, (rss_before, rss_after)
    assert ledger_view(extender) == before_ledger
    assert cluster_pods(scenario) == before_pods
    for pod in world.bound:
        assert ids(scenario.pod(pod["metadata"]["name"])) == ids(pod)


def schema_attack(world: World, caller: Caller) -> None:
    """Bodies drawn from the wire schema with wrong types, nulls and missing fields in every
    field, each also sent cut short; a 5xx or a dropped connection fails at once, and
    hypothesis then shrinks the body to the smallest that does it."""
    configured = settings(
        max_examples=SCHEMA_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )

    def send(kind: str, verb: str, body: Any, cut: float) -> None:
        raw = json.dumps(body).encode()
        for each, name in ((raw, kind), (raw[: int(len(raw) * cut)], "truncated")):
            status, answer = caller.send(name, post(f"/{verb}", each))
            assert status not in (NO_ANSWER, 500, 502, 503), (verb, each[:200], status, answer)

    @configured
    @given(
        hostile.filter_bodies(world.strings),
        st.sampled_from(["filter", "prioritize"]),
        st.floats(0, 1),
    )
    def filters(body: Any, verb: str, cut: float) -> None:
        send("schema-filter", verb, body, cut)

    @configured
    @given(hostile.bind_bodies(world.strings), st.floats(0, 1))
    def binds(body: Any, cut: float) -> None:
        send("schema-bind", "bind", body, cut)

    filters()
    binds()


def many_nodes(world: World, caller: Caller) -> None:
    """100,000 node names, unknown and known, as names and as a NodeList."""
    pod = world.filter_args["Pod"]
    unknown = [f"no-such-node-{i}" for i in range(MANY)]
    known = (world.nodes * (MANY // len(world.nodes) + 1))[:MANY]
    requests = []
    for names in (unknown, known):
        for verb in ("filter", "prioritize"):
            requests.append(post(f"/{verb}", {"Pod": pod, "NodeNames": names}))
            items = [{"metadata": {"name": n}} for n in names]
            requests.append(post(f"/{verb}", {"Pod": pod, "Nodes": {"items": items}}))
    for request in requests:
        caller.send("100k-nodes", request)


def over_limit(extender: ExtenderProcess, context: Any, tally: Tally) -> None:
    limit = 64 * 1024 * 1024  # the extender's default --body-limit
    for chunked in (False, True):
        tally.add(
            "over-limit", hostile.oversized(extender.port, context, "/filter", limit + 1, chunked)
        )
    for length in (limit + 1, 10**12, 10**30):
        tally.add("over-limit", hostile.declared_only(extender.port, context, "/bind", length))


def slow(extender: ExtenderProcess, context: Any, world: World, tally: Tally) -> None:
    """Clients trickling their request (head and body) over about 3 s, and clients that stop
    halfway through a body and hang up."""
    body = json.dumps(world.filter_args).encode()
    for status in hostile.trickle(
        extender.port, context, "/filter", body, pieces=30, pause=0.1, connections=20, seconds=30
    ):
        tally.add("slow", status)
    hostile.abandoned(extender.port, context, "/filter", connections=20, seconds=2)


def concurrent(extender: ExtenderProcess, context: Any, world: World, tally: Tally) -> None:
    """500 connections at once, each with a request of its own."""
    requests = [
        post("/filter" if i % 3 else "/prioritize", world.filter_args)
        if i % 5
        else post(
            "/bind",
            {
                "PodName": f"ghost{i}",
                "PodNamespace": world.scenario.namespace,
                "PodUID": "u",
                "Node": world.nodes[0],
            },
        )
        for i in range(500)
    ]
    for status in hostile.burst(extender.port, context, requests, seconds=60):
        tally.add("burst-500", status)
