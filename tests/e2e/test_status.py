"""`status` and `why` against the testbed (issue 19): pods bound through the real kube-scheduler
and the extender, read back by the commands a person runs, and through the kubectl plugin by the
real kubectl binary.

The commands run as processes, as a person runs them. What they print is compared with the pods'
own annotations (what the extender wrote at bind) and with the core allocator fed those ids, never
with the ledger the commands use.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from neuron_scheduler.core.allocation import NodeState, Placement, allocate, largest_free_run
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import core_mask_of_devices, format_ids, ids_mask
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest
from neuron_scheduler.core.topology import Topology
from tests.e2e.chart import apply
from tests.e2e.harness import ROOT, Scenario, ids
from tests.testbed import ControlPlane

ONE_MODE = pytest.mark.parametrize("mode", [True], ids=["nodeCacheCapable"], indirect=True)
PLUGIN = Path(sys.executable).parent / "kubectl-neuron"


@functools.cache
def viewer_kubeconfig(cp: ControlPlane) -> Path:
    """A ServiceAccount bound to the ClusterRole docs/operations.md gives people for these
    commands (get and list on nodes and pods), applied from that page: the commands must need
    no more than it grants, and the account gets nothing else."""
    page = (ROOT / "docs" / "operations.md").read_text()
    blocks = [b.split("```", 1)[0] for b in page.split("```yaml\n")[1:]]
    (role,) = [yaml.safe_load(b) for b in blocks if "name: neuron-viewer" in b]
    credentials = cp.service_account("neuron-viewers", "viewer")
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "neuron-viewer"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": role["metadata"]["name"],
        },
        "subjects": [{"kind": "ServiceAccount", "name": "viewer", "namespace": "neuron-viewers"}],
    }
    apply(cp, [role, binding])  # server-side: a retry after a failed first call is harmless
    for verb, resource, allowed in (
        ("list", "pods", "yes"),
        ("get", "nodes", "yes"),
        ("patch", "pods", "no"),
        ("get", "secrets", "no"),
    ):
        answer = cp.kubectl(
            "auth",
            "can-i",
            verb,
            resource,
            "-A",
            kubeconfig=credentials.kubeconfig_path,
            check=False,
        )
        assert answer.stdout.strip() == allowed, (verb, resource, answer.stdout, answer.stderr)
    return credentials.kubeconfig_path


def command(scenario: Scenario, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neuron_scheduler", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(viewer_kubeconfig(scenario.cp)), "COLUMNS": "120"},
        timeout=300,
    )


def kubectl(scenario: Scenario, *args: str) -> subprocess.CompletedProcess[str]:
    """The real kubectl, with the plugin on PATH and the cluster in KUBECONFIG, as its users
    run it."""
    assert PLUGIN.is_file(), f"{PLUGIN} missing: `make sync` installs the kubectl-neuron script"
    env = {
        **os.environ,
        "PATH": f"{PLUGIN.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "KUBECONFIG": str(viewer_kubeconfig(scenario.cp)),
        "NO_PROXY": "127.0.0.1,localhost",
        "COLUMNS": "120",
    }
    return subprocess.run(
        [str(scenario.cp.kubebin), "kubectl", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def as_json(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def pinned_pod(
    scenario: Scenario, name: str, node: str, limits: dict[str, int], priority_class: str = ""
) -> None:
    body = scenario.pod_body(name, limits, priority_class=priority_class)
    body["spec"]["nodeSelector"]["kubernetes.io/hostname"] = node
    scenario.cp.request("POST", f"/api/v1/namespaces/{scenario.namespace}/pods", body)
    scenario.wait_bound(name)


def annotated(pod: dict[str, Any]) -> dict[str, Any]:
    """What status must show for a pod: exactly its annotations."""
    return {
        "pod": f"{pod['metadata']['namespace']}/{pod['metadata']['name']}",
        "unit": "core"
        if pod["metadata"]["annotations"]["NEURON_RESOURCE_TYPE"] == NEURONCORE
        else "device",
        "ids": ids(pod),
        "devices": ids(pod, "NEURON_DEVS"),
        "cores": ids(pod, "NEURON_CORES"),
    }


@dataclass
class AnnotatedNode:
    """A node as sim.report.draw_node reads one (name, topology, pods' placements), built from
    the annotations only."""

    name: str
    topology: Topology
    pods: dict[str, Placement] = field(default_factory=dict)


def same_picture_as_the_simulator(path: Path, node: AnnotatedNode, scratch: Path) -> bool:
    """The simulator's own node picture of these placements, byte for byte."""
    import matplotlib.pyplot as plt

    from neuron_scheduler.sim.report import draw_node

    fig, ax = plt.subplots(figsize=(3.2, 3.4))
    draw_node(ax, node)  # type: ignore[arg-type]  # duck-typed as the simulator's SimNode
    expected = scratch / "expected.png"
    fig.savefig(expected, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path.read_bytes() == expected.read_bytes()


@ONE_MODE
def test_status_shows_every_pods_ids_exactly_as_annotated(
    scenario: Scenario, tmp_path: Path
) -> None:
    torus = scenario.add_node("trn1.32xlarge")
    ring = scenario.add_node("inf2.48xlarge")
    for name, node, limits in [
        ("half", torus, {NEURON: 8}),
        ("row", torus, {NEURON: 4}),
        ("one", torus, {NEURON: 1}),
        ("cores", ring, {NEURONCORE: 3}),
        ("pair", ring, {NEURON: 2}),
    ]:
        pinned_pod(scenario, name, node, limits)
    pods = {p["metadata"]["name"]: p for p in scenario.pods()}
    catalog = Catalog.builtin()

    for node, names in [(torus, ["half", "row", "one"]), (ring, ["cores", "pair"])]:
        shown = as_json(command(scenario, "status", "--node", node, "--json"))
        assert shown["version"] == 1
        (view,) = shown["nodes"]
        assert view["name"] == node
        expected = sorted((annotated(pods[n]) for n in names), key=lambda p: p["cores"])
        assert [{k: p[k] for k in expected[0]} for p in view["pods"]] == expected
        assert view["ids_unknown"] == [] and view["held"]["cores"] == []
        topology = catalog.resolve(view["instance_type"], view["devices"]).topology
        used = ids_mask(c for p in expected for c in p["cores"])
        busy = ids_mask(d for p in expected for d in p["devices"])
        assert core_mask_of_devices(busy, topology.cores_per_device) & used == used
        assert view["free_devices"] == topology.devices - busy.bit_count()
        assert view["free_cores"] == topology.total_cores - used.bit_count()
        assert view["largest_free_block"] == largest_free_run(topology, busy)
        # "Could take one now", per size: what the allocator says of the annotated ids.
        for row in shown["summary"]["could_take_one_now"]:
            request = NeuronRequest(row["resource"], row["count"])
            fits = isinstance(allocate(topology, NodeState(used), request), Placement)
            assert row["nodes_now"] == int(fits), row

    # The terminal view of the torus: a line per pod with its annotated ids.
    text = command(scenario, "status", "--node", torus)
    assert text.returncode == 0, text.stderr
    assert "trn1.32xlarge  torus, 16 devices x 2 cores" in text.stdout
    for name in ("half", "row", "one"):
        pod = annotated(pods[name])
        line = next((x for x in text.stdout.splitlines() if f" {pod['pod']} " in x), "")
        assert f"devices {format_ids(pod['devices'])}  cores {format_ids(pod['cores'])}" in line, (
            text.stdout
        )

    # --report: the simulator's own picture of the annotated placements, and the same JSON.
    report = tmp_path / "report"
    pictured = command(scenario, "status", "--node", torus, "--report", str(report))
    assert pictured.returncode == 0, pictured.stderr
    on_torus = [annotated(pods[n]) for n in ("half", "row", "one")]
    drawn = AnnotatedNode(
        torus,
        catalog.resolve("trn1.32xlarge", 16).topology,
        {p["pod"]: Placement(tuple(p["devices"]), tuple(p["cores"]), 0) for p in on_torus},
    )
    assert same_picture_as_the_simulator(report / "nodes" / f"{torus}.png", drawn, tmp_path)
    assert (report / "device-maps.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = json.loads((report / "status.json").read_text())
    direct = as_json(command(scenario, "status", "--node", torus, "--json"))
    assert written["nodes"] == direct["nodes"]

    # The kubectl plugin, found by the real kubectl on PATH, reaching the cluster through
    # KUBECONFIG as kubectl's users expect.
    via_kubectl = as_json(kubectl(scenario, "neuron", "status", "--node", torus, "--json"))
    assert via_kubectl["nodes"] == direct["nodes"]
    listed = kubectl(scenario, "plugin", "list")
    assert str(PLUGIN) in listed.stdout, listed.stdout + listed.stderr


@ONE_MODE
def test_why_names_the_pods_holding_the_cheapest_block(scenario: Scenario) -> None:
    """A trn1.32xlarge: one half held by a high-priority 8-device pod, the other by three
    ordinary pods (4 + 1 + 1 devices). An 8-device pod of priority 0 stays pending (no pod has a
    lower priority: kube-scheduler preempts nothing). `why` names the three pods of the other
    half as what blocks it (one pod of priority 1000 weighs more than three of priority 0) and
    says preemption at its priority frees nothing."""
    node = scenario.add_node("trn1.32xlarge")
    high = scenario.priority_class("high", 1000)
    pinned_pod(scenario, "big-high", node, {NEURON: 8}, priority_class=high)
    for name, count in [("row", 4), ("one", 1), ("two", 1)]:
        pinned_pod(scenario, name, node, {NEURON: count})
    scenario.create_pod("waiting", {NEURON: 8})
    scenario.wait_event("waiting", "FailedScheduling")
    pods = {p["metadata"]["name"]: p for p in scenario.pods()}
    ns = scenario.namespace
    assert not pods["waiting"]["spec"].get("nodeName")

    answer = as_json(command(scenario, "why", "waiting", "-n", ns, "--json"))
    assert answer["version"] == 1
    assert answer["pod"] == f"{ns}/waiting"
    assert answer["request"] == {"resource": NEURON, "count": 8}
    verdicts = {n["node"]: n for n in answer["nodes"]}
    here = verdicts[node]
    assert here["verdict"] == "blocked"
    assert here["reason"] == "needs 8 devices; only 2 devices free"
    # The block: exactly the half big-high does not hold; its holders: exactly the three pods
    # whose annotations put them there, in the order of their ids.
    blockers = sorted(["row", "one", "two"], key=lambda n: ids(pods[n], "NEURON_DEVS"))
    other_half = sorted(set(range(16)) - set(ids(pods["big-high"], "NEURON_DEVS")))
    assert {d for n in blockers for d in ids(pods[n], "NEURON_DEVS")} <= set(other_half)
    blocking = here["blocking"]
    assert blocking["devices"] == other_half
    assert blocking["cores"] == sorted(c for d in other_half for c in (2 * d, 2 * d + 1))
    assert blocking["pods"] == blocking["holding_the_block"] == [f"{ns}/{n}" for n in blockers]
    rows = "rows 2-3" if other_half[0] == 8 else "rows 0-1"
    assert blocking["where"] == rows
    assert here["preemption"] is None
    # Nodes of other tests are not this pod's candidates: its nodeSelector keeps it off them.
    assert all(v["verdict"] == "excluded" for name, v in verdicts.items() if name != node)

    # What a person reads, through kubectl as well: "<node> ...: rows 2-3 ... held by pods ...".
    for result in (
        command(scenario, "why", "pod/waiting", "-n", ns),
        kubectl(scenario, "neuron", "why", "waiting", "-n", ns),
    ):
        assert result.returncode == 0, result.stderr
        line = next((x for x in result.stdout.splitlines() if "to fit:" in x), "")
        pods_text = ", ".join(f"{ns}/{n}" for n in blockers)
        assert (
            f"to fit: {rows} (devices {format_ids(other_half)}) are held by pods {pods_text}"
            in (line)
        ), result.stdout

    # What it cannot answer: one line on stderr, a non-zero exit, no traceback.
    scenario.create_pod("plain", {}, scheduler="nobody-schedules-this")
    for args, code, message in [
        (("why", "nobody", "-n", ns), 1, f"pod {ns}/nobody not found"),
        (("why", "row", "-n", ns), 1, f"pod {ns}/row is not pending: it is bound to node {node}"),
        (("why", "plain", "-n", ns), 1, f"pod {ns}/plain requests no Neuron resources"),
        (("why", "Bad_Name", "-n", ns), 2, "is not a pod name"),
        (("status", "--node", "no-such-node"), 1, "node no-such-node: not found"),
    ]:
        result = command(scenario, *args)
        assert result.returncode == code, result
        assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
        assert len(result.stderr.splitlines()) == 1, result.stderr
    through_kubectl = kubectl(scenario, "neuron", "why", "nobody", "-n", ns)
    assert through_kubectl.returncode == 1
    assert through_kubectl.stderr.strip() == f"error: pod {ns}/nobody not found"
