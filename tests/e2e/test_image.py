"""The image, run as the chart runs it (issue 19).

`make image` builds it from the Dockerfile without pulling from any image registry
(tools/image/build.sh); rootful podman runs it here (tools/image/podman.sh). As in the chart's pod
specs: a read-only root file system with /tmp a small tmpfs (the chart's emptyDir), every
capability dropped, no privilege escalation; the extender as uid 65532 with its service account
token and TLS secret mounted where a pod has them, the device plugin as uid 0 with the host's
/dev and /sys mounted read-only under /host and kubelet's device-plugins directory read-write.
The containers share the host's network: the testbed's API server listens on 127.0.0.1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from neuron_scheduler.core.resources import NEURON, NEURONCORE, NEURONDEVICE
from tests.builders import node_json, pod_json
from tests.e2e.chart import device_plugin_credentials
from tests.e2e.harness import ROOT
from tests.e2e.test_deviceplugin_kubelet import KubeletPeer
from tests.testbed import ControlPlane, ManagedProcess, Stack
from tests.testbed.deviceplugin import fake_tree
from tests.testbed.stack import ExtenderProcess

pytestmark = pytest.mark.e2e

PODMAN = str(ROOT / "tools" / "image" / "podman.sh")
SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
TLS = "/etc/neuron-scheduler/tls"  # the chart's mount of the extender's Secret
PLUGIN_DIR = "/var/lib/kubelet/device-plugins"


def _make(*args: str) -> str:
    """The last line `make` prints: the thing it built."""
    result = subprocess.run(
        ["make", "--no-print-directory", "-s", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, (
        f"make {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    )
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def image() -> str:
    """tools/image.mk exports the name to `make test`; run alone, the test builds it."""
    name = os.environ.get("NEURON_SCHEDULER_IMAGE") or _make("image")
    exists = subprocess.run([PODMAN, "image", "exists", name], check=False)
    assert exists.returncode == 0, f"{name} is not in podman's storage: run `make image`"
    return name


def secret_volume(directory: Path, files: Mapping[str, str | Path]) -> Path:
    """Files as the kubelet mounts a Secret or a projected token: mode 0644, by name."""
    directory.mkdir(parents=True)
    for name, content in files.items():
        target = directory / name
        if isinstance(content, Path):
            shutil.copyfile(content, target)
        else:
            target.write_text(content)
        target.chmod(0o644)
    return directory


def in_cluster(
    cp: ControlPlane, directory: Path, token: str
) -> tuple[dict[Path, str], dict[str, str]]:
    """The service account volume and environment a pod gets: (mounts, env)."""
    files = {"token": token, "ca.crt": cp.ca_path, "namespace": "kube-system"}
    volume = secret_volume(directory, files)
    port = cp.server_url.rsplit(":", 1)[1]
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}
    return {volume: f"{SERVICE_ACCOUNT}:ro"}, env


class Container:
    """`podman run` of the image in the foreground: its output is the ManagedProcess's log."""

    def __init__(
        self,
        image: str,
        args: Sequence[str],
        log: Path,
        *,
        user: str,
        mounts: Mapping[Path, str],
        env: Mapping[str, str],
    ) -> None:
        self.name = f"neuron-scheduler-e2e-{uuid.uuid4().hex[:8]}"
        self.process = ManagedProcess(
            "container",
            [
                *(PODMAN, "run", "--rm", "--name", self.name, "--network", "host"),
                *("--user", user, "--cap-drop", "ALL", "--security-opt", "no-new-privileges"),
                # Only /tmp is writable (podman's --read-only would also make /run and /var/tmp so).
                *("--read-only", "--read-only-tmpfs=false", "--tmpfs", "/tmp:size=16m,mode=1777"),
                *(f"--volume={host}:{target}" for host, target in mounts.items()),
                *(f"--env={key}={value}" for key, value in env.items()),
                image,
                *args,
            ],
            log,
        )

    def exec(self, *command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PODMAN, "exec", self.name, *command], capture_output=True, text=True, check=False
        )

    def stop(self) -> None:
        # SIGTERM reaches the container through podman run; rm covers a podman killed before that.
        self.process.stop(timeout=10)
        subprocess.run([PODMAN, "rm", "--force", "--ignore", self.name], capture_output=True)


class ExtenderContainer(ExtenderProcess):
    """The testbed's extender client (ports, TLS, readiness, verbs) around the image's extender,
    started with the chart's arguments and mounts."""

    def __init__(self, stack: Stack, image: str, workdir: Path) -> None:
        super().__init__(stack.cp, stack.extender_kubeconfig, pki=stack.pki)
        assert stack.pki is not None
        mounts, env = in_cluster(stack.cp, workdir / "serviceaccount", stack.extender_token)
        tls = {"tls.crt": stack.pki.server_cert, "tls.key": stack.pki.server_key}
        tls_volume = secret_volume(workdir / "tls", {**tls, "ca.crt": stack.pki.ca})
        self.container = Container(
            image,
            [
                "extender",
                f"--port={self.port}",
                f"--metrics-port={self.metrics_port}",
                "--log-level=info",
                "--scheduler-name=my-scheduler",
                f"--tls-cert={TLS}/tls.crt",
                f"--tls-key={TLS}/tls.key",
                f"--client-ca={TLS}/ca.crt",
            ],
            workdir / "extender.log",
            user="65532:65532",
            mounts={**mounts, tls_volume: f"{TLS}:ro"},
            env={**env, "POD_NAME": "extender-image", "POD_NAMESPACE": "kube-system"},
        )
        self.process = self.container.process


def test_extender_image_serves_probes_and_filters_against_the_control_plane(
    stack: Stack, image: str, tmp_path: Path
) -> None:
    cp = stack.cp
    suffix = uuid.uuid4().hex[:6]
    big, small = f"image-trn1-{suffix}", f"image-inf2-{suffix}"
    for name, instance_type in ((big, "trn1.32xlarge"), (small, "inf2.xlarge")):
        cp.request("POST", "/api/v1/nodes", node_json(name, instance_type))
    extender = ExtenderContainer(stack, image, tmp_path)
    try:
        extender.start()  # until /readyz: its pod and node caches are synced
        with urllib.request.urlopen(extender.metrics_url + "/healthz", timeout=10) as answer:
            assert answer.status == 200
        # What the chart promises the container: not root, root file system read-only, /tmp not.
        assert extender.container.exec("id", "-u").stdout.strip() == "65532"
        read_only = extender.container.exec("touch", "/opt/neuron-scheduler/x")
        assert "Read-only file system" in read_only.stderr, read_only
        assert extender.container.exec("touch", "/tmp/x").returncode == 0

        # kube-scheduler's filter call, with its client certificate: four devices fit the trn1
        # node (16 devices), not the inf2.xlarge (1), and the answer is the source tree's.
        args = {"Pod": pod_json(f"four-{suffix}", {NEURON: 4}), "NodeNames": [big, small]}
        status, answer = extender.call("filter", args)
        assert status == 200, answer
        assert answer["NodeNames"] == [big], answer
        refused = {**answer["FailedNodes"], **answer["FailedAndUnresolvableNodes"]}
        assert list(refused) == [small] and "inf2.xlarge has 1" in refused[small], answer
        assert answer == stack.extender.call("filter", args)[1]
        assert "neuron_scheduler" in extender.metrics()
    finally:
        extender.container.stop()
        for name in (big, small):
            cp.request("DELETE", f"/api/v1/nodes/{name}")


def test_device_plugin_image_registers_the_fake_tree_with_the_kubelet(
    control_plane: ControlPlane, image: str, tmp_path: Path
) -> None:
    cp = control_plane
    node = f"image-dp-{uuid.uuid4().hex[:6]}"
    cp.request("POST", "/api/v1/nodes", node_json(node, "trn1.32xlarge"))
    dev, sys_root = fake_tree(tmp_path / "host", devices=16, cores=2)
    (tmp_path / "pod-resources").mkdir()
    (tmp_path / "opt-aws").mkdir()
    # Unix socket paths must stay under ~108 bytes; pytest's tmp paths can be longer.
    plugin_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    peer = KubeletPeer(
        Path(_make("-f", "tools/kubeletpeer.mk", "kubeletpeer-bin")),
        plugin_dir,
        tmp_path / "kubeletpeer.log",
    )
    # As the chart runs it: with its own ServiceAccount, bound to the rendered ClusterRole.
    token = device_plugin_credentials(cp, node=node).token
    mounts, env = in_cluster(cp, tmp_path / "serviceaccount", token)
    plugin = Container(
        image,
        [
            "device-plugin",
            f"--plugin-dir={PLUGIN_DIR}",
            "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock",
            "--dev-root=/host/dev",
            "--sys-root=/host/sys",
            "--logical-nc-config=/host/opt/aws/neuron/logical_nc_config",
            "--log-level=info",
        ],
        tmp_path / "device-plugin.log",
        user="0:0",
        mounts={
            **mounts,
            plugin_dir: PLUGIN_DIR,
            tmp_path / "pod-resources": "/var/lib/kubelet/pod-resources:ro",
            dev: "/host/dev:ro",
            sys_root: "/host/sys:ro",
            tmp_path / "opt-aws": "/host/opt/aws:ro",
        },
        env={**env, "NODE_NAME": node},
    )
    try:
        plugin.process.start()
        registered = peer.wait_registered()
        assert all(r["get_preferred_allocation_available"] for r in registered.values())
        # ListAndWatch from the fake sysfs: 16 devices of 2 cores each, all healthy.
        assert peer.devices(NEURONCORE) == {str(c): "Healthy" for c in range(32)}
        assert peer.devices(NEURON) == {str(d): "Healthy" for d in range(16)}
        assert peer.devices(NEURONDEVICE) == {str(d): "Healthy" for d in range(16)}
        assert plugin.process.alive(), plugin.process.log_tail()
    finally:
        plugin.stop()
        peer.stop()
        shutil.rmtree(plugin_dir, ignore_errors=True)
        cp.request("DELETE", f"/api/v1/nodes/{node}")
