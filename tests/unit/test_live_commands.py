"""`status` and `why` as commands: what they make of bad kubeconfigs and of API servers that
cannot be reached, refuse, stall or lie (a stand-in HTTP server for each), and the JSON fields
docs/operations.md documents. Against the real cluster: tests/e2e/test_status.py."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner, Result

from neuron_scheduler.cli import app, kubectl_plugin
from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.handoff import encode
from neuron_scheduler.core.resources import NEURON, NeuronRequest
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.kube.kueue import Workload
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import KUEUE_ADMISSION_GATE, KUEUE_TOPOLOGY_GATE
from neuron_scheduler.live import commands, snapshot
from neuron_scheduler.live.diagnosis import diagnose, diagnosis_json
from neuron_scheduler.live.dranodes import DraNode, dra_json
from neuron_scheduler.live.fleet import fleet_json, fleet_view
from neuron_scheduler.live.gated import gated_json, gated_view
from neuron_scheduler.live.workloadstatus import workload_report
from tests.builders import node, node_json, pod, pod_json
from tests.testbed.process import free_port

ROOT = Path(__file__).resolve().parents[2]
Answer = Callable[[str], tuple[int, bytes]]  # path with query -> (status, body)


def kubeconfig(tmp_path: Path, server: str, **cluster: str) -> Path:
    path = tmp_path / "kubeconfig"
    document = {
        "apiVersion": "v1",
        "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
        "users": [{"name": "u", "user": {"token": "t"}}],
    }
    path.write_text(json.dumps(document))
    return path


@contextmanager
def api_server(answer: Answer) -> Iterator[str]:
    """A plain-HTTP stand-in for kube-apiserver that answers every GET with `answer`."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = answer(self.path)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def listing(items: list[dict[str, Any]], token: str = "") -> bytes:
    return json.dumps({"metadata": {"continue": token}, "items": items}).encode()


def cluster_answer(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Answer:
    def answer(path: str) -> tuple[int, bytes]:
        if path.startswith("/api/v1/nodes"):
            return 200, listing(nodes)
        if path.startswith("/api/v1/pods"):
            return 200, listing(pods)
        for p in pods:
            meta = p["metadata"]
            if path == f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}":
                return 200, json.dumps(p).encode()
        status = {"kind": "Status", "reason": "NotFound", "message": "not found"}
        return 404, json.dumps(status).encode()

    return answer


def run(*args: str, plugin: bool = False) -> Result:
    return CliRunner().invoke(kubectl_plugin if plugin else app, list(args))


def one_error_line(result: Result, code: int) -> str:
    """The result is exactly one `error:` line on stderr and exit `code`, nothing raised."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    assert not isinstance(result.exception, Exception) or isinstance(
        result.exception, SystemExit
    ), result.exception
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[1, 2", "is not valid YAML"),
        ("just a string", "missing or malformed entry"),
        (None, "cannot read kubeconfig"),
    ],
    ids=["not-yaml", "not-a-mapping", "missing"],
)
def test_a_kubeconfig_that_cannot_be_read_is_one_line_exit_2(
    tmp_path: Path, content: str | None, message: str
) -> None:
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_text(content)
    for command in (["status"], ["why", "some-pod"]):
        assert message in one_error_line(run(*command, "--kubeconfig", str(path)), 2)


def test_certificate_data_that_is_not_base64_and_a_server_that_is_not_a_url(
    tmp_path: Path,
) -> None:
    bad_data = kubeconfig(tmp_path, "https://127.0.0.1:1", **{"certificate-authority-data": "!x"})
    line = one_error_line(run("status", "--kubeconfig", str(bad_data)), 2)
    assert "not base64" in line
    not_url = kubeconfig(tmp_path, "not a url\x1b[31m")
    line = one_error_line(run("status", "--kubeconfig", str(not_url)), 2)
    assert "'not a url?[31m' is not an http(s) URL" in line


def test_names_the_api_server_would_refuse_are_refused_before_asking(tmp_path: Path) -> None:
    config = str(kubeconfig(tmp_path, f"http://127.0.0.1:{free_port()}"))
    assert "is not a pod name" in one_error_line(run("why", "Bad_Name", "--kubeconfig", config), 2)
    assert "only pods" in one_error_line(run("why", "node/x", "--kubeconfig", config), 2)
    line = one_error_line(run("why", "p", "-n", "a/b", "--kubeconfig", config), 2)
    assert "is not a namespace name" in line


# --- API servers that do not answer as they should -------------------------------------------


def test_an_unreachable_api_server_is_one_line_exit_1(tmp_path: Path) -> None:
    config = str(kubeconfig(tmp_path, f"http://127.0.0.1:{free_port()}"))
    for command in (["status"], ["why", "p"]):
        line = one_error_line(run(*command, "--kubeconfig", config), 1)
        assert line.startswith("error: cannot read the cluster: Cannot connect to host")


def test_refused_access_says_which_access_is_needed(tmp_path: Path) -> None:
    forbidden = json.dumps({"kind": "Status", "reason": "Forbidden", "message": "no\nway"})
    with api_server(lambda _: (403, forbidden.encode())) as url:
        line = one_error_line(run("status", "--kubeconfig", str(kubeconfig(tmp_path, url))), 1)
    assert line == (f"error: cannot read the cluster: no way; {commands.RBAC_HINT}"), line


def test_answers_that_are_not_lists_or_never_end_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with api_server(lambda _: (200, b'{"items": "not a list"')) as url:
        config = str(kubeconfig(tmp_path, url))
        assert "cannot read the cluster" in one_error_line(run("status", "--kubeconfig", config), 1)
    monkeypatch.setattr(snapshot, "PAGE", 2)
    monkeypatch.setattr(snapshot, "MOST_NODES", 10)
    pages = 0

    def endless(_: str) -> tuple[int, bytes]:
        nonlocal pages
        pages += 1
        items = [node_json(f"n{pages}-{i}", "trn1.32xlarge") for i in range(2)]
        return 200, listing(items, token=f"page-{pages}")

    with api_server(endless) as url:
        line = one_error_line(run("status", "--kubeconfig", str(kubeconfig(tmp_path, url))), 1)
    assert "more than 10 objects" in line
    assert pages <= 10 // 2 + 1


def test_an_api_server_that_never_answers_is_given_up_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commands, "REQUEST_SECONDS", 0.3)
    release = threading.Event()

    def stall(_: str) -> tuple[int, bytes]:
        release.wait(10)
        return 200, listing([])

    with api_server(stall) as url:
        try:
            result = run("status", "--kubeconfig", str(kubeconfig(tmp_path, url)))
        finally:
            release.set()
    assert (
        one_error_line(result, 1)
        == f"error: cannot read the cluster: no answer from {url} within 0.3s"
    )


# --- answers ---------------------------------------------------------------------------------


def test_status_and_why_through_the_plugin_entry_point(tmp_path: Path) -> None:
    nodes = [node_json("trn-a", "trn1.32xlarge"), node_json("cpu", "m5.large")]
    waiting = pod_json("big", {NEURON: 32}, namespace="ml")
    with api_server(cluster_answer(nodes, [waiting])) as url:
        config = str(kubeconfig(tmp_path, url))
        status = run("status", "--json", "--kubeconfig", config, plugin=True)
        why = run("why", "big", "-n", "ml", "--json", "--kubeconfig", config, plugin=True)
        missing = run("why", "gone", "-n", "ml", "--kubeconfig", config, plugin=True)
        no_node = run("status", "--node", "cpu", "--kubeconfig", config)
    assert status.exit_code == 0, status.stderr
    document = json.loads(status.stdout)
    assert [n["name"] for n in document["nodes"]] == ["trn-a"]
    assert document["summary"]["nodes_without_neuron"] == 1
    assert why.exit_code == 0, why.stderr
    (answer,) = json.loads(why.stdout)["nodes"]
    assert (answer["node"], answer["verdict"]) == ("trn-a", "never")
    assert one_error_line(missing, 1) == "error: pod ml/gone not found"
    assert one_error_line(no_node, 1) == "error: node cpu: advertises no Neuron resources"


def kueue_group(count: int = 4) -> list[dict[str, Any]]:
    """A Kueue pod group of UltraServer members, as Kueue's webhook leaves them until it admits
    their Workload: its two gates (TopologyAwareScheduling is on by default)."""
    return [
        pod_json(
            f"member-{i}",
            {NEURON: 16},
            namespace="ml",
            labels={
                "kueue.x-k8s.io/queue-name": "team-a",
                "kueue.x-k8s.io/pod-group-name": "train",
            },
            annotations={
                "kueue.x-k8s.io/pod-group-total-count": str(count),
                "neuron-scheduler.io/gang": "train",
                "neuron-scheduler.io/gang-size": str(count),
            },
            gates=[KUEUE_ADMISSION_GATE, KUEUE_TOPOLOGY_GATE],
        )
        for i in range(count)
    ]


def ultraserver_nodes() -> list[dict[str, Any]]:
    """One UltraServer of 4 trn2u nodes."""
    labels = {
        "neuron.amazonaws.com/ultraserver-mode": "1_2_4",
        "neuron.amazonaws.com/ultraserver-server-id-4": "a" * 16,
    }
    return [node_json(f"trn2u-{i}", "trn2u.48xlarge", labels=labels) for i in range(4)]


RETRY = "job ml/train needs 1 free UltraServer of 4 nodes for its 4 members, 0 free"


def checked_workload() -> dict[str, Any]:
    """kueue_group()'s Workload with quota, sent back by the placement check (Retry), and a
    second check whose message is escaped and cut when shown."""
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {"name": "train", "namespace": "ml", "uid": "w1"},
        "status": {
            "conditions": [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved"}],
            "admission": {"clusterQueue": "cq", "podSetAssignments": []},
            "admissionChecks": [
                {"name": "neuron-placement", "state": "Retry", "message": RETRY},
                {"name": "other", "state": "Pending", "message": "line\n\x1b[31mred" + "x" * 900},
            ],
        },
    }


def test_why_and_status_name_the_gates_kueues_workload_and_its_queue(tmp_path: Path) -> None:
    """Issue 48: `why` on a gated pod said its request fitted and it waited for "something else";
    it names the gates, and for Kueue's, the Workload and its LocalQueue. `status` lists the
    gated pods apart from the jobs waiting for room."""
    nodes = ultraserver_nodes()
    other = pod_json("lab", {NEURON: 1}, namespace="ml", gates=["example.com/wait"])
    with api_server(cluster_answer(nodes, [*kueue_group(), other])) as url:
        config = str(kubeconfig(tmp_path, url))
        why = run("why", "member-0", "-n", "ml", "--json", "--kubeconfig", config)
        text = run("why", "member-0", "-n", "ml", "--kubeconfig", config)
        status = run("status", "--json", "--kubeconfig", config)
        status_text = run("status", "--kubeconfig", config)
    assert why.exit_code == 0, why.stderr
    answer = json.loads(why.stdout)
    assert answer["scheduling_gates"] == {
        "gates": [KUEUE_ADMISSION_GATE, KUEUE_TOPOLOGY_GATE],
        "more_gates": 0,
        "kueue_workload": "train",
        "kueue_queue": "team-a",
    }
    assert "nothing is reserved for it while its members are gated" in answer["job"]
    assert answer["consolidation"] is None and answer["capacity"] is None
    flat = " ".join(text.stdout.split())
    assert (
        "Held back by scheduling gates kueue.x-k8s.io/admission, kueue.x-k8s.io/topology: "
        "Kueue's Workload ml/train in LocalQueue team-a is not admitted yet" in flat
    ), flat
    assert "Its devices are free now: it waits for its scheduling gates." in flat
    assert "pending for something else" not in flat
    assert status.exit_code == 0, status.stderr
    document = json.loads(status.stdout)
    assert document["ultraservers"]["waiting"] == []  # not the extender's to reserve for
    groups = document["gated"]["groups"]
    assert document["gated"]["pods"] == 5
    assert [(g["kueue_workload"], g["pods"], g["requests"]) for g in groups] == [
        (None, 1, [{"resource": NEURON, "count": 1}]),
        ("train", 4, [{"resource": NEURON, "count": 64}]),
    ]
    flat = " ".join(status_text.stdout.split())
    assert "5 pending Neuron pods held back by scheduling gates" in flat
    assert "scheduling gate example.com/wait (namespace ml): 1 pod, 1 aws.amazon.com/neuron" in flat


def test_why_on_a_gated_pod_says_what_its_workload_waits_for(tmp_path: Path) -> None:
    """For a pod Kueue holds back, `why` reads its Workload: quota, admission, and each
    admission check's state and message (the placement check's Retry says which block is
    missing). What the Workload says is escaped and bounded; a Workload that cannot be read is
    said so, and the rest of the answer stands."""
    nodes = ultraserver_nodes()
    workload = checked_workload()
    # A pod names its Workload in an annotation anyone may write: never a path to follow.
    forged = pod_json(
        "forged",
        {NEURON: 1},
        namespace="ml",
        annotations={"kueue.x-k8s.io/workload": "../../../../api/v1/namespaces/ml/secrets/x"},
        gates=[KUEUE_ADMISSION_GATE],
    )
    served = cluster_answer(nodes, [*kueue_group(), forged])
    path = "/apis/kueue.x-k8s.io/v1beta2/namespaces/ml/workloads/train"
    asked_for: list[str] = []

    def answer(asked: str) -> tuple[int, bytes]:
        asked_for.append(asked)
        return (200, json.dumps(workload).encode()) if asked == path else served(asked)

    with api_server(answer) as url:
        config = str(kubeconfig(tmp_path, url))
        why = run("why", "member-0", "-n", "ml", "--json", "--kubeconfig", config)
        text = run("why", "member-0", "-n", "ml", "--kubeconfig", config)
        not_followed = run("why", "forged", "-n", "ml", "--json", "--kubeconfig", config)
    assert not_followed.exit_code == 0, not_followed.stderr
    refused = json.loads(not_followed.stdout)["kueue_workload_status"]
    assert refused["unread"] == "that is not a Workload's name", refused
    assert not [a for a in asked_for if "secrets" in a or "workloads/.." in a], asked_for
    with api_server(served) as url:  # no such Workload (404)
        config = str(kubeconfig(tmp_path, url))
        unread = run("why", "member-0", "-n", "ml", "--json", "--kubeconfig", config)
    forbidden = {"kind": "Status", "reason": "Forbidden", "message": "workloads is forbidden"}
    for status_code, body in ((403, json.dumps(forbidden).encode()), (200, b"<html>proxy</html>")):

        def odd(asked: str, code: int = status_code, text: bytes = body) -> tuple[int, bytes]:
            return (code, text) if asked == path else served(asked)

        with api_server(odd) as url:
            config = str(kubeconfig(tmp_path, url))
            result = run("why", "member-0", "-n", "ml", "--json", "--kubeconfig", config)
            shown_text = run("why", "member-0", "-n", "ml", "--kubeconfig", config)
        assert result.exit_code == 0 and shown_text.exit_code == 0, result.stderr
        said = json.loads(result.stdout)["kueue_workload_status"]
        assert said["unread"] and said["admission_checks"] == [], said
        assert "Traceback" not in result.stderr + shown_text.stderr
        assert "Kueue's Workload ml/train: not read (" in " ".join(shown_text.stdout.split())
    assert why.exit_code == 0, why.stderr
    status = json.loads(why.stdout)["kueue_workload_status"]
    assert status["workload"] == "ml/train" and status["unread"] is None
    assert status["admitted"] is False and status["quota_reserved"] is True
    assert status["cluster_queue"] == "cq" and status["quota_message"] is None
    placement, other = status["admission_checks"]
    assert placement == {"name": "neuron-placement", "state": "Retry", "message": RETRY}
    assert other["message"].startswith("line \\x1b[31mred") and "\n" not in other["message"]
    assert other["message"].endswith("more characters)") and len(other["message"]) < 700
    flat = " ".join(text.stdout.split())
    assert "Kueue's Workload ml/train: not admitted; quota reserved in ClusterQueue cq" in flat
    assert f"admission check neuron-placement: Retry: {RETRY}" in flat, flat
    assert unread.exit_code == 0, unread.stderr
    missing = json.loads(unread.stdout)["kueue_workload_status"]
    assert missing["unread"] and missing["admission_checks"] == [], missing


def test_status_shows_what_kueue_says_of_each_gated_workload(tmp_path: Path) -> None:
    """`status` lists Kueue's gated groups with their Workloads' states, as `why` shows one:
    quota, admission, each admission check (the placement check's Retry names the missing
    block), escaped and bounded; each Workload is read by name (never a cluster-wide list: Kueue
    keeps one per job, pod templates and all). A Workload not there is said to be not found, a
    name from a pod's labels that is no Workload's is never followed, and a Workload that cannot
    be read says why: the rest of `status` stands."""
    nodes = ultraserver_nodes()
    # (pod sets our PodSpec cannot read: only the Workload's status is read)
    workload = {
        **checked_workload(),
        "spec": {"podSets": [{"name": "main", "count": 4, "template": {"spec": 7}}]},
    }

    def group(name: str, count: int) -> list[dict[str, Any]]:
        """A Kueue pod group of `count` members whose labels name the Workload `name`."""
        return [
            {
                **p,
                "metadata": {
                    **p["metadata"],
                    "name": f"{name.replace('/', '-')}-{i}",
                    "labels": {
                        "kueue.x-k8s.io/queue-name": "team-b",
                        "kueue.x-k8s.io/pod-group-name": name,
                    },
                },
            }
            for i, p in enumerate(kueue_group(count))
        ]

    forged = "../../../../api/v1/namespaces/ml/secrets/x"
    served = cluster_answer(nodes, [*kueue_group(), *group("absent", 2), *group(forged, 1)])
    path = "/apis/kueue.x-k8s.io/v1beta2/namespaces/ml/workloads/"
    asked_for: list[str] = []

    def answer(asked: str) -> tuple[int, bytes]:
        asked_for.append(asked)
        return (200, json.dumps(workload).encode()) if asked == path + "train" else served(asked)

    with api_server(answer) as url:
        config = str(kubeconfig(tmp_path, url))
        status = run("status", "--json", "--kubeconfig", config)
        text = run("status", "--kubeconfig", config)
    assert status.exit_code == 0 and text.exit_code == 0, status.stderr + text.stderr
    assert not [a for a in asked_for if "secrets" in a or ".." in a], asked_for
    assert not [a for a in asked_for if a.startswith("/apis/kueue.x-k8s.io/v1beta2/workloads")]
    groups = {g["kueue_workload"]: g for g in json.loads(status.stdout)["gated"]["groups"]}
    said = groups["train"]["kueue_workload_status"]
    assert (said["quota_reserved"], said["cluster_queue"], said["admitted"]) == (True, "cq", False)
    assert said["admission_checks"][0] == {
        "name": "neuron-placement",
        "state": "Retry",
        "message": RETRY,
    }
    escaped = said["admission_checks"][1]["message"]
    assert escaped.startswith("line \\x1b[31mred") and "\n" not in escaped, escaped
    assert escaped.endswith("more characters)") and len(escaped) < 700, escaped
    assert groups["absent"]["kueue_workload_status"]["unread"] == "not found"
    assert groups[forged]["kueue_workload_status"]["unread"] == "that is not a Workload's name"
    flat = " ".join(text.stdout.split())
    assert "Kueue's Workload ml/train: not admitted; quota reserved in ClusterQueue cq" in flat
    assert f"admission check neuron-placement: Retry: {RETRY}" in flat
    assert "Kueue's Workload ml/absent: not read (not found)" in flat

    forbidden = {"kind": "Status", "reason": "Forbidden", "message": "workloads is forbidden"}
    for code, body in ((403, json.dumps(forbidden).encode()), (200, b"<html>proxy</html>")):

        def odd(asked: str, code: int = code, body: bytes = body) -> tuple[int, bytes]:
            return (code, body) if asked.startswith(path) else served(asked)

        with api_server(odd) as url:
            config = str(kubeconfig(tmp_path, url))
            status = run("status", "--json", "--kubeconfig", config)
            text = run("status", "--kubeconfig", config)
        assert status.exit_code == 0 and text.exit_code == 0, status.stderr + text.stderr
        assert "Traceback" not in status.stderr + text.stderr
        groups = {g["kueue_workload"]: g for g in json.loads(status.stdout)["gated"]["groups"]}
        unread = groups["train"]["kueue_workload_status"]["unread"]
        assert unread.startswith("cannot read it: "), unread
        assert "Kueue's Workload ml/train: not read (cannot read it: " in " ".join(
            text.stdout.split()
        )


def test_report_writes_the_simulators_pictures_and_the_json(tmp_path: Path) -> None:
    nodes = [node_json("trn-a", "trn1.32xlarge"), node_json("a/../../x", "inf2.48xlarge")]
    with api_server(cluster_answer(nodes, [])) as url:
        config = str(kubeconfig(tmp_path, url))
        result = run("status", "--report", str(tmp_path / "report"), "--kubeconfig", config)
        blocked = tmp_path / "a-file"
        blocked.write_text("")
        unwritable = run("status", "--report", str(blocked), "--kubeconfig", config)
    assert result.exit_code == 0, result.stderr
    pictures = sorted(p.name for p in (tmp_path / "report" / "nodes").iterdir())
    assert pictures == ["a_.._.._x.png", "trn-a.png"]  # a node's name never leaves the directory
    assert (tmp_path / "report" / "device-maps.png").is_file()
    written = json.loads((tmp_path / "report" / "status.json").read_text())
    assert written["pictures_capped_at"] is None and len(written["nodes"]) == 2
    assert "cannot write the report" in one_error_line(unwritable, 2)


# --- the JSON is documented ------------------------------------------------------------------


def keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in keys(v)}
    if isinstance(value, list):
        return {k for v in value for k in keys(v)}
    return set()


def test_every_json_field_is_documented() -> None:
    ledger = Ledger(Catalog.builtin())
    ledger.replace_nodes([node(n, "trn1.32xlarge") for n in ("known", "unknown", "empty")])
    devices = tuple(range(16))
    placement = Placement(devices, tuple(range(32)), 0)
    ours = encode("known", NeuronRequest(NEURON, 16), placement, ["c0"], 1)
    waiting = pod("waiting", {NEURON: 4}, namespace="ml")
    ledger.replace_pods(
        [
            pod("ours", {NEURON: 16}, node="known", annotations=ours, phase="Running"),
            pod("theirs", {NEURON: 16}, node="unknown", phase="Running"),
            waiting,
        ]
    )
    diagnosis = diagnosis_json(diagnose(ledger, waiting))
    assert {n["verdict"] for n in diagnosis["nodes"]} == {"fits", "blocked"}
    fields = keys(fleet_json(fleet_view(ledger))) | keys(diagnosis)
    gated = [msgspec.convert(p, Pod) for p in kueue_group()]
    fields |= keys(diagnosis_json(diagnose(ledger, gated[0])))
    checked = msgspec.convert(
        {
            "metadata": {"name": "train", "namespace": "ml"},
            "status": {"admissionChecks": [{"name": "c", "state": "Retry", "message": "m"}]},
        },
        Workload,
    )
    report = workload_report(checked)
    fields |= keys(diagnosis_json(dataclasses.replace(diagnose(ledger, gated[0]), workload=report)))
    fields |= keys({"gated": gated_json(gated_view(gated))})
    dra = dra_json((DraNode("n", 40, (5,)),), None, "neuron.neuron-scheduler.io")
    fields |= keys({"dra": dra})
    fields.add("pictures_capped_at")
    text = (ROOT / "docs" / "operations.md").read_text()
    # `nodes[].pods[].cores` documents nodes, pods and cores.
    documented = {
        w for quoted in re.findall(r"`([^`\n]+)`", text) for w in re.findall(r"\w+", quoted)
    }
    assert fields - documented == set()
    assert {"nodes_now", "holding_the_block", "where", "version", "placement"} <= fields


def test_why_without_the_claim_crd_says_what_the_extender_does_on_plain_nodes(
    tmp_path: Path,
) -> None:
    """No UltraServerClaim CRD in the cluster (the API answers 404): the extender places a
    training job's members pod by pod on nodes without UltraServer labels, and `why` says so
    (not that the job waits for a claim nobody can write)."""
    nodes = [node_json(n, "trn1.32xlarge") for n in ("trn-a", "trn-b")]
    gang = {"neuron-scheduler.io/gang": "pair", "neuron-scheduler.io/gang-size": "2"}
    member = pod_json("pair-0", {NEURON: 16}, namespace="ml", annotations=gang)
    with api_server(cluster_answer(nodes, [member])) as url:
        config = str(kubeconfig(tmp_path, url))
        why = run("why", "pair-0", "-n", "ml", "--json", "--kubeconfig", config)
    assert why.exit_code == 0, why.stderr
    found = json.loads(why.stdout)
    assert {(n["node"], n["verdict"]) for n in found["nodes"]} == {
        ("trn-a", "fits"),
        ("trn-b", "fits"),
    }, found["nodes"]
