"""The device plugin against a real kubelet-side peer (tools/kubeletpeer, upstream v1beta1 API in
Go) and a real kube-apiserver: registration, ListAndWatch, GetPreferredAllocation, Allocate and
the pod annotations, with the plugin run as its CLI command over a fake /dev and /sys tree.

Both binaries are built through make (cached outside the repo after the first build). The
control plane is the session's (tests/e2e/conftest.py); the last test adds our extender and
my-scheduler, so the annotations are the ones a real bind writes.
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.builders import node_json
from tests.e2e.chart import device_plugin_credentials
from tests.e2e.harness import remove_pods_and_nodes
from tests.testbed import ControlPlane, ManagedProcess, Stack

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NEURON = "aws.amazon.com/neuron"
NEURONCORE = "aws.amazon.com/neuroncore"
NEURONDEVICE = "aws.amazon.com/neurondevice"
RESOURCES = (NEURONCORE, NEURON, NEURONDEVICE)
# Safety net against a hang, never a performance bound: a healthy run answers in milliseconds.
PATIENCE = 60.0

Json = dict[str, Any]


def _make(makefile: str, target: str) -> Path:
    result = subprocess.run(
        ["make", "--no-print-directory", "-f", makefile, target],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"make {target} failed:\n{result.stdout}\n{result.stderr}"
    path = Path(result.stdout.strip().splitlines()[-1])
    assert path.is_file(), f"make {target} printed {path}, which does not exist"
    return path


@pytest.fixture(scope="session")
def peer_binary() -> Path:
    return _make("tools/kubeletpeer.mk", "kubeletpeer-bin")


class KubeletPeer:
    """The Go peer as a child process: JSON commands on stdin, results and events on stdout."""

    def __init__(self, binary: Path, plugin_dir: Path, log: Path) -> None:
        self._log = log.open("a")
        self.proc = subprocess.Popen(
            [str(binary), "-dir", str(plugin_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.events: list[Json] = []
        self._results: dict[int, queue.Queue[Json]] = {}
        self._next_id = 0
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.wait_event(lambda e: e["event"] == "listening")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message: Json = json.loads(line)
            self._log.write(line)
            self._log.flush()
            if "id" in message:
                self._results[int(message["id"])].put(message)
            else:
                with self._changed:
                    self.events.append(message)
                    self._changed.notify_all()

    def call(self, op: str, **args: Any) -> Json:
        self._next_id += 1
        ident = self._next_id
        self._results[ident] = queue.Queue()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": ident, "op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._results[ident].get(timeout=PATIENCE)

    def wait_event(self, match: Callable[[Json], bool], after: int = 0) -> Json:
        """The first event from index `after` on that matches."""
        deadline = time.monotonic() + PATIENCE
        with self._changed:
            while True:
                for event in self.events[after:]:
                    if match(event):
                        return event
                left = deadline - time.monotonic()
                assert left > 0, f"no matching event; got {self.events[after:]}"
                self._changed.wait(left)

    def wait_registered(self, after: int = 0) -> dict[str, Json]:
        def registered(resource: str) -> Callable[[Json], bool]:
            return lambda e: e["event"] == "registered" and e["resource"] == resource

        return {r: self.wait_event(registered(r), after) for r in RESOURCES}

    def devices(self, resource: str, after: int = 0) -> dict[str, str]:
        event = self.wait_event(
            lambda e: e["event"] == "devices" and e["resource"] == resource, after
        )
        return {d["id"]: d["health"] for d in event["devices"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the peer exits when its input ends, like a stopped kubelet
            self.proc.wait(PATIENCE)
        self._reader.join(PATIENCE)
        self._log.close()


def fake_tree(root: Path, devices: int, cores: int) -> tuple[Path, Path]:
    dev, sys_root = root / "dev", root / "sys"
    dev.mkdir(parents=True)
    for d in range(devices):
        (dev / f"neuron{d}").touch()
        entry = sys_root / "class/neuron_device" / f"neuron{d}"
        entry.mkdir(parents=True)
        (entry / "core_count").write_text(f"{cores}\n")
    return dev, sys_root


def neuron_pod(
    name: str,
    node: str,
    resource: str,
    containers: dict[str, int],
    annotations: dict[str, str] | None = None,
) -> Json:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": annotations or {}},
        "spec": {
            "nodeName": node,
            "schedulerName": "my-scheduler",
            "containers": [
                {
                    "name": cname,
                    "image": "busybox",
                    "resources": {"limits": {resource: str(count)}},
                }
                for cname, count in containers.items()
            ],
        },
    }


def scheduler_annotations(
    node: str, resource: str, ids: str, cores: str, devices: str, containers: dict[str, str]
) -> dict[str, str]:
    """What the extender writes at bind."""
    return {
        "AWS_NEURON_IDS": ids,
        "NEURON_RESOURCE_TYPE": resource,
        "NEURON_ALLOC_TIME": str(time.time_ns()),
        "NEURON_ALLOCATED": "false",
        "NEURON_CORES": cores,
        "NEURON_DEVS": devices,
        "NEURON_NODE": node,
        "NEURON_CONTAINER_IDS": json.dumps(containers, separators=(",", ":")),
    }


class Node:
    """One fake Neuron node: API object, device tree, plugin process and kubelet peer."""

    def __init__(
        self,
        cp: ControlPlane,
        peer_binary: Path,
        workdir: Path,
        instance_type: str,
        devices: int,
        cores: int,
    ) -> None:
        self.cp = cp
        self.name = f"node-{uuid.uuid4().hex[:8]}"
        self.namespace = f"ns-{uuid.uuid4().hex[:8]}"
        cp.client.ensure_namespace(self.namespace)
        cp.client.create(
            "/api/v1/nodes",
            node_json(self.name, instance_type, devices=devices, cores=devices * cores),
        )
        self.workdir = workdir
        self.dev, self.sys = fake_tree(workdir / "tree", devices, cores)
        # Unix socket paths must stay under ~108 bytes; pytest's tmp paths can be longer.
        self.plugin_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
        self.peer_binary = peer_binary
        self.peer = self.start_peer()
        self.plugin = ManagedProcess(
            "device-plugin",
            [
                sys.executable,
                "-m",
                "neuron_scheduler",
                "device-plugin",
                "--node-name",
                self.name,
                "--plugin-dir",
                str(self.plugin_dir),
                "--dev-root",
                str(self.dev),
                "--sys-root",
                str(self.sys),
                "--kubeconfig",
                # As the chart runs it: its own ServiceAccount, bound to the rendered ClusterRole.
                str(device_plugin_credentials(cp, node=self.name).kubeconfig_path),
                "--logical-nc-config",
                str(workdir / "no-lnc-file"),
                "--health-interval",
                "0.2",
                "--log-level",
                "debug",
            ],
            workdir / "device-plugin.log",
        )
        self.plugin.start()

    def start_peer(self) -> KubeletPeer:
        return KubeletPeer(self.peer_binary, self.plugin_dir, self.workdir / "kubeletpeer.log")

    def create_pod(self, body: Json) -> Json:
        result: Json = self.cp.client.create(f"/api/v1/namespaces/{self.namespace}/pods", body)
        return result

    def annotations(self, pod: str) -> dict[str, str]:
        got: Json = self.cp.client.get(f"/api/v1/namespaces/{self.namespace}/pods/{pod}")
        return dict(got["metadata"].get("annotations") or {})

    def log(self) -> str:
        return self.plugin.log_tail(200)

    def wait_log(self, text: str, after: str = "") -> None:
        """Until the plugin has logged `text` (after the last line containing `after`)."""
        deadline = time.monotonic() + PATIENCE

        def seen() -> bool:
            log = self.log()
            return text in (log.split(after)[-1] if after else log)

        while not seen():
            assert self.plugin.alive(), self.log()
            assert time.monotonic() < deadline, f"no {text!r} in the plugin log:\n{self.log()}"
            time.sleep(0.05)

    def close(self) -> None:
        self.peer.stop()
        self.plugin.stop()
        shutil.rmtree(self.plugin_dir, ignore_errors=True)
        # The session's control plane is shared: later tests would see this node.
        remove_pods_and_nodes(self.cp, self.namespace, [self.name])


@pytest.fixture
def make_node(
    control_plane: ControlPlane, peer_binary: Path, tmp_path: Path
) -> Iterator[Callable[[str, int, int], Node]]:
    nodes: list[Node] = []

    def make(instance_type: str, devices: int, cores: int) -> Node:
        node = Node(
            control_plane, peer_binary, tmp_path / f"n{len(nodes)}", instance_type, devices, cores
        )
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.close()


def test_seed_flow_cores_2_3_on_inf2(make_node: Callable[[str, int, int], Node]) -> None:
    node = make_node("inf2.48xlarge", 12, 2)
    node.create_pod(
        neuron_pod(
            "seed",
            node.name,
            NEURONCORE,
            {"main": 2},
            scheduler_annotations(node.name, NEURONCORE, "2,3", "2,3", "1", {"main": "2,3"}),
        )
    )
    registered = node.peer.wait_registered()
    assert all(r["get_preferred_allocation_available"] for r in registered.values())
    assert not any(r["pre_start_required"] for r in registered.values())
    cores = node.peer.devices(NEURONCORE)
    assert cores == {str(c): "Healthy" for c in range(24)}
    assert node.peer.devices(NEURON) == {str(d): "Healthy" for d in range(12)}
    assert node.peer.devices(NEURONDEVICE) == {str(d): "Healthy" for d in range(12)}

    admitted = node.peer.call("admit", resource=NEURONCORE, size=2)
    assert "error" not in admitted, admitted
    assert admitted["preferred"] == ["2", "3"]
    assert admitted["ids"] == ["2", "3"]
    response = admitted["response"]
    assert response["devices"] == [
        {"container_path": "/dev/neuron1", "host_path": "/dev/neuron1", "permissions": "rw"}
    ]
    assert response["envs"]["NEURON_RT_VISIBLE_CORES"] == "2,3"
    assert node.annotations("seed")["NEURON_ALLOCATED"] == "true"


def test_device_request_on_trn1_gets_its_row(make_node: Callable[[str, int, int], Node]) -> None:
    node = make_node("trn1.32xlarge", 16, 2)
    node.create_pod(
        neuron_pod(
            "row",
            node.name,
            NEURON,
            {"train": 4},
            scheduler_annotations(
                node.name,
                NEURON,
                "4,5,6,7",
                "8,9,10,11,12,13,14,15",
                "4,5,6,7",
                {"train": "4,5,6,7"},
            ),
        )
    )
    node.peer.wait_registered()
    result = node.peer.call("allocate", resource=NEURON, containers=[["4", "5", "6", "7"]])
    assert "error" not in result, result
    (response,) = result["responses"]
    assert [d["host_path"] for d in response["devices"]] == [f"/dev/neuron{d}" for d in range(4, 8)]
    assert response["envs"]["NEURON_RT_VISIBLE_CORES"] == "8,9,10,11,12,13,14,15"
    assert response["envs"]["AWS_NEURON_VISIBLE_DEVICES"] == "4,5,6,7"
    assert node.annotations("row")["NEURON_ALLOCATED"] == "true"


def test_kubelet_restart_registers_again_within_5s(
    make_node: Callable[[str, int, int], Node],
) -> None:
    node = make_node("inf2.48xlarge", 12, 2)
    node.peer.wait_registered()
    node.peer.stop()
    began = time.monotonic()
    node.peer = node.start_peer()  # removes every socket in the directory, as kubelet does
    node.peer.wait_registered()
    assert time.monotonic() - began < 5.0, node.log()
    # The new kubelet gets the full device list on its new streams.
    assert len(node.peer.devices(NEURONCORE)) == 24


def test_device_that_loses_its_dev_node_turns_unhealthy(
    make_node: Callable[[str, int, int], Node],
) -> None:
    node = make_node("inf2.48xlarge", 12, 2)
    node.peer.wait_registered()
    node.peer.devices(NEURON)
    seen = len(node.peer.events)
    (node.dev / "neuron3").unlink()
    devices = node.peer.devices(NEURON, after=seen)
    assert devices["3"] == "Unhealthy"
    assert sum(h == "Healthy" for h in devices.values()) == 11
    cores = node.peer.devices(NEURONCORE, after=seen)
    assert cores["6"] == cores["7"] == "Unhealthy"
    seen = len(node.peer.events)
    (node.dev / "neuron3").touch()
    assert node.peer.devices(NEURON, after=seen)["3"] == "Healthy"
    assert "neuron3 is unhealthy" in node.log()


def test_two_pods_of_one_size_each_get_their_own_ids(
    make_node: Callable[[str, int, int], Node],
) -> None:
    node = make_node("inf2.48xlarge", 12, 2)
    for name, cores, device in (("first", "4,5", "2"), ("second", "6,7", "3")):
        node.create_pod(
            neuron_pod(
                name,
                node.name,
                NEURONCORE,
                {"main": 2},
                scheduler_annotations(node.name, NEURONCORE, cores, cores, device, {"main": cores}),
            )
        )
    node.peer.wait_registered()
    every = [str(c) for c in range(24)]
    # With both pending, the preference is one pod's annotated set, never a mix.
    preferred = node.peer.call("preferred", resource=NEURONCORE, available=every, size=2)["ids"]
    assert preferred in (["4", "5"], ["6", "7"])

    # kubelet starts the pod bound second first: the ids decide, not the bind order.
    result = node.peer.call("allocate", resource=NEURONCORE, containers=[["6", "7"]])
    assert "error" not in result, result
    assert result["responses"][0]["envs"]["NEURON_RT_VISIBLE_CORES"] == "6,7"
    assert [d["host_path"] for d in result["responses"][0]["devices"]] == ["/dev/neuron3"]
    assert node.annotations("second")["NEURON_ALLOCATED"] == "true"
    assert node.annotations("first")["NEURON_ALLOCATED"] == "false"

    # The remaining pending pod is the only one the preference can point at now.
    left = [c for c in every if c not in ("6", "7")]
    assert node.peer.call("preferred", resource=NEURONCORE, available=left, size=2)["ids"] == [
        "4",
        "5",
    ]
    result = node.peer.call("allocate", resource=NEURONCORE, containers=[["4", "5"]])
    assert result["responses"][0]["envs"]["NEURON_RT_VISIBLE_CORES"] == "4,5"
    assert node.annotations("first")["NEURON_ALLOCATED"] == "true"


def test_multi_container_pod_gets_one_slice_per_container(
    make_node: Callable[[str, int, int], Node],
) -> None:
    node = make_node("inf2.48xlarge", 12, 2)
    node.create_pod(
        neuron_pod(
            "pair",
            node.name,
            NEURONCORE,
            {"a": 2, "b": 2},
            scheduler_annotations(
                node.name, NEURONCORE, "0,1,2,3", "0,1,2,3", "0,1", {"a": "0,1", "b": "2,3"}
            ),
        )
    )
    node.peer.wait_registered()
    first = node.peer.call("admit", resource=NEURONCORE, size=2)
    assert first["ids"] == ["0", "1"], first
    assert node.annotations("pair")["NEURON_ALLOCATED"] == "false"
    assert node.annotations("pair")["NEURON_ALLOCATED_CONTAINERS"] == "a"
    second = node.peer.call("admit", resource=NEURONCORE, size=2)
    assert second["ids"] == ["2", "3"], second
    assert second["response"]["envs"]["NEURON_RT_VISIBLE_CORES"] == "2,3"
    assert node.annotations("pair")["NEURON_ALLOCATED"] == "true"


def test_pod_placed_without_the_extender(make_node: Callable[[str, int, int], Node]) -> None:
    node = make_node("inf2.48xlarge", 12, 2)
    node.create_pod(
        neuron_pod(
            "ours",
            node.name,
            NEURONCORE,
            {"main": 2},
            scheduler_annotations(node.name, NEURONCORE, "0,1", "0,1", "0", {"main": "0,1"}),
        )
    )
    node.create_pod(neuron_pod("stray", node.name, NEURONCORE, {"main": 2}))
    node.peer.wait_registered()

    scattered = node.peer.call("allocate", resource=NEURONCORE, containers=[["4", "7"]])
    assert "my-scheduler" in scattered["error"]
    taken = node.peer.call("allocate", resource=NEURONCORE, containers=[["1", "2"]])
    assert "ns-" in taken["error"] and "my-scheduler" in taken["error"]
    # Contiguous ids nobody holds obey the ring rule: accepted, and no pod is marked for them.
    fine = node.peer.call("allocate", resource=NEURONCORE, containers=[["8", "9"]])
    assert fine["responses"][0]["envs"]["NEURON_RT_VISIBLE_CORES"] == "8,9"
    assert node.annotations("ours")["NEURON_ALLOCATED"] == "false"
    # Whole devices that hold another pod's cores are refused through the device resource too.
    device = node.peer.call("allocate", resource=NEURON, containers=[["0"]])
    assert "my-scheduler" in device["error"]


def test_plugin_waits_for_devices_and_kubelet(
    control_plane: ControlPlane, peer_binary: Path, tmp_path: Path
) -> None:
    """No /dev/neuron* and no kubelet at first: it says so and keeps waiting, then serves."""
    node = Node(control_plane, peer_binary, tmp_path, "inf2.xlarge", 1, 2)
    try:
        node.peer.stop()
        node.plugin.stop()
        shutil.rmtree(node.plugin_dir)
        node.plugin_dir.mkdir()
        tree = node.workdir / "tree"
        shutil.rmtree(tree)
        node.plugin.start()
        node.wait_log("is the Neuron driver loaded?")
        fake_tree(tree, 1, 2)
        node.wait_log("found 1 Neuron devices")
        node.wait_log("waiting for kubelet", after="found 1 Neuron devices")
        node.peer = node.start_peer()
        node.peer.wait_registered()
        assert node.peer.devices(NEURONCORE) == {"0": "Healthy", "1": "Healthy"}
        assert "Traceback" not in node.log()
    finally:
        node.close()


def test_seed_flow_through_the_extender(
    make_node: Callable[[str, int, int], Node], stack: Stack
) -> None:
    """Seed flow steps 1-11: my-scheduler and our extender bind and annotate, then kubelet's
    Allocate gets exactly those ids from the plugin."""
    if stack.scheduler is None:
        stack.use_scheduler(True)
    node = make_node("inf2.48xlarge", 12, 2)
    node.peer.wait_registered()

    def scheduled_pod(name: str) -> Json:
        body = neuron_pod(name, "", NEURONCORE, {"main": 2})
        body["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node.name}
        return body

    def bound(name: str) -> dict[str, str]:
        deadline = time.monotonic() + PATIENCE
        while True:
            pod: Json = node.cp.client.get(f"/api/v1/namespaces/{node.namespace}/pods/{name}")
            if pod["spec"].get("nodeName"):
                return dict(pod["metadata"]["annotations"])
            assert time.monotonic() < deadline, f"{name} not bound: {pod.get('status')}"
            time.sleep(0.1)

    node.create_pod(scheduled_pod("first"))
    assert bound("first")["AWS_NEURON_IDS"] == "0,1"
    assert node.peer.call("admit", resource=NEURONCORE, size=2)["ids"] == ["0", "1"]

    node.create_pod(scheduled_pod("seed"))
    annotations = bound("seed")
    assert annotations["AWS_NEURON_IDS"] == "2,3"
    assert annotations["NEURON_DEVS"] == "1"
    assert annotations["NEURON_ALLOCATED"] == "false"
    admitted = node.peer.call("admit", resource=NEURONCORE, size=2)
    assert admitted["ids"] == ["2", "3"], admitted
    response = admitted["response"]
    assert [d["host_path"] for d in response["devices"]] == ["/dev/neuron1"]
    assert response["envs"]["NEURON_RT_VISIBLE_CORES"] == "2,3"
    assert node.annotations("seed")["NEURON_ALLOCATED"] == "true"
