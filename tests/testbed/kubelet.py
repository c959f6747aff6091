"""A real kubelet on 127.0.0.1: the upstream kubelet (the `kubelet` of the tools/kube multi-call
binary) against the upstream fake CRI runtime (tools/kube/fakecri, built next to it).

    ca = NodeCA(workdir / "node-ca")
    with ControlPlane(kubebin, workdir, extra_apiserver_args=ca.apiserver_args) as cp:
        node = Kubelet(cp, ca, "node-a", instance_type="inf1.6xlarge")
        node.start()              # the Node registers and turns Ready
        ...                       # a device plugin serves in node.plugin_dir
        node.close()

The kubelet runs as root and would change the host: it sets six kernel tunables, creates
/var/lib/kubelet, /var/log/pods, /var/log/containers and /run/mount whatever --root-dir says, and
its device manager only ever looks in /var/lib/kubelet/device-plugins. So it runs in a mount
namespace of its own (`unshare --mount --propagation private`), where
- /var/lib, /var/log and /run are overlays whose writes land in the node's directory,
- each kernel tunable is a file already holding the value the kubelet wants (so it writes none),
- /var/lib/kubelet/device-plugins is a bind mount of `plugin_dir`, where a device plugin outside
  the namespace serves and finds kubelet.sock.
The namespace ends with the kubelet process. Its working directory is an empty directory with a
sentinel file: kubelet's log cleanup removes `<container LogPath>*`, which is every file there
when a runtime leaves LogPath empty (fakecri never does). `host_changes()` reports anything that
leaked all the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .controlplane import ControlPlane, StartupError
from .process import ManagedProcess, free_ports

# What the kubelet sets unless they already hold these values (setupKernelTunables in
# pkg/kubelet/cm/container_manager_linux.go).
KERNEL_TUNABLES = {
    "vm/overcommit_memory": "1",
    "vm/panic_on_oom": "0",
    "kernel/panic": "10",
    "kernel/panic_on_oops": "1",
    "kernel/keys/root_maxkeys": "1000000",
    "kernel/keys/root_maxbytes": "25000000",
}
# Where the kubelet writes whatever --root-dir says: overlaid inside its namespace.
OVERLAID = ("/var/lib", "/var/log", "/run")
# A constant in the kubelet (pluginapi.DevicePluginPath); no flag moves it.
KUBELET_DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
# Paths the kubelet would create on the host; none may appear.
HOST_PATHS = (
    "/var/lib/kubelet",
    "/var/log/pods",
    "/var/log/containers",
    "/usr/libexec/kubernetes",
    "/run/mount",
    "/etc/kubernetes",
)
SENTINEL = "SENTINEL"
# Safety net against a hang, never a performance bound: a kubelet is Ready in about a second.
PATIENCE = 60.0


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode:
        raise StartupError(f"openssl {' '.join(args)}: {result.stderr.strip()}")


class NodeCA:
    """A client CA for kubelet identities. The API server must trust it: start the control plane
    with `extra_apiserver_args=ca.apiserver_args`."""

    EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.cert = directory / "node-ca.crt"
        self.key = directory / "node-ca.key"
        if not self.cert.is_file():
            _openssl(
                *("req", "-x509", *self.EC, "-keyout", str(self.key), "-out", str(self.cert)),
                *("-days", "2", "-subj", "/CN=neuron-scheduler-testbed-node-ca"),
            )

    @property
    def apiserver_args(self) -> list[str]:
        return [f"--client-ca-file={self.cert}"]

    def issue(self, node: str, directory: Path) -> tuple[Path, Path]:
        """(certificate, key) of `system:node:<node>` in group system:nodes, as the Node
        authorizer expects."""
        cert, key, csr = (directory / f"{node}.{ext}" for ext in ("crt", "key", "csr"))
        subject = f"/O=system:nodes/CN=system:node:{node}"
        _openssl("req", *self.EC, "-keyout", str(key), "-out", str(csr), "-subj", subject)
        _openssl(
            *("x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key)),
            *("-set_serial", f"0x{secrets.token_hex(8)}", "-out", str(cert), "-days", "2"),
        )
        return cert, key


def host_address() -> str:
    """One of this machine's own non-loopback IPv4 addresses: the kubelet refuses a loopback
    --node-ip. Nothing is sent to it; the kubelet serves on 127.0.0.1 only."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        # A UDP connect only picks the source address of the route to it; no packet leaves.
        probe.connect(("203.0.113.1", 9))
        address = str(probe.getsockname()[0])
    except OSError:  # no default route
        address = ""
    finally:
        probe.close()
    if not address or address.startswith("127."):
        listed = subprocess.run(
            ["ip", "-4", "-o", "addr", "show", "scope", "global"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        address = listed[listed.index("inet") + 1].split("/")[0] if "inet" in listed else ""
    if not address:
        raise StartupError("no non-loopback IPv4 address on this machine for --node-ip")
    return address


@dataclass(frozen=True)
class HostState:
    """What the kubelet must leave as it was."""

    tunables: dict[str, str]
    paths: frozenset[str]

    @classmethod
    def read(cls) -> HostState:
        return cls(
            {t: Path("/proc/sys", t).read_text().strip() for t in KERNEL_TUNABLES},
            frozenset(p for p in HOST_PATHS if os.path.lexists(p)),
        )


class Kubelet:
    """One real node: fakecri and a kubelet registering `name`, as root, in a mount namespace of
    its own. Directories are under a short temporary directory (unix socket paths are limited to
    about 108 bytes); `close()` removes it."""

    def __init__(
        self,
        cp: ControlPlane,
        ca: NodeCA,
        name: str,
        *,
        instance_type: str,
        labels: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
    ) -> None:
        self.cp = cp
        self.name = name
        self.kubebin = cp.kubebin
        self.fakecri_bin = self.kubebin.parent / "fakecri"
        self.labels = {"node.kubernetes.io/instance-type": instance_type, **(labels or {})}
        self.dir = Path(tempfile.mkdtemp(prefix="kn-", dir="/tmp"))
        self.root_dir = self.dir / "root"
        self.plugin_dir = self.root_dir / "device-plugins"
        self.pod_resources_socket = self.root_dir / "pod-resources" / "kubelet.sock"
        self.cri_socket = self.dir / "cri.sock"
        self.cwd = self.dir / "cwd"
        log_dir = log_dir or cp.log_dir
        self.host_before = HostState.read()
        self.ready_seconds = 0.0  # kubelet start -> Node Ready, of the last start
        self._ca = ca
        self.fakecri = ManagedProcess(
            "fakecri",
            [str(self.fakecri_bin), "-endpoint", f"unix://{self.cri_socket}"],
            log_dir / f"fakecri-{name}.log",
            cwd=self.cwd,
        )
        self.kubelet = ManagedProcess(
            "kubelet",
            [
                *("unshare", "--mount", "--propagation", "private"),
                *("/bin/sh", str(self.dir / "namespace.sh")),
                *(str(self.kubebin), "kubelet"),
                f"--config={self.dir / 'config.json'}",
                f"--kubeconfig={self.dir / 'kubeconfig'}",
                f"--root-dir={self.root_dir}",
                f"--cert-dir={self.root_dir / 'pki'}",  # default /var/lib/kubelet/pki
                f"--hostname-override={name}",
                f"--node-ip={host_address()}",
                "--node-labels=" + ",".join(f"{k}={v}" for k, v in self.labels.items()),
                "--v=2",
            ],
            log_dir / f"kubelet-{name}.log",
            cwd=self.cwd,
        )

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start fakecri and the kubelet; return once the Node is Ready."""
        if os.geteuid() != 0:
            raise StartupError("the real kubelet needs root (mount namespace, device manager)")
        for binary in (self.kubebin, self.fakecri_bin):
            if not os.access(binary, os.X_OK):
                raise StartupError(f"{binary} not found: build it with `make kube-bin`")
        self._write_files()
        self.fakecri.start()
        self._wait(self.fakecri, "its CRI socket", self.cri_socket.exists)
        self.start_kubelet()

    def start_kubelet(self) -> None:
        """Returns once this kubelet has posted the Node's status (Ready). After a restart the
        Node still shows the last kubelet's status (Ready, a device plugin's resources) until
        the new one posts its own, which shows those resources as 0 until the plugin registers
        again: a wait for them could otherwise pass on the old status and then see 0."""
        # (the Ready condition's heartbeat: posted every second here, nodeStatusUpdateFrequency)
        before = self._ready_condition().get("lastHeartbeatTime")

        def posted_ready() -> bool:
            condition = self._ready_condition()
            return condition.get("status") == "True" and (
                condition.get("lastHeartbeatTime") != before
            )

        began = time.monotonic()
        self.kubelet.start()
        self._wait(self.kubelet, f"Node {self.name} Ready, posted by this kubelet", posted_ready)
        self.ready_seconds = time.monotonic() - began

    def stop_kubelet(self) -> None:
        """SIGTERM, as a service manager stops it; fakecri and the containers it records stay."""
        self.kubelet.stop(timeout=10.0)

    def stop(self) -> None:
        self.kubelet.stop(timeout=10.0)
        self.fakecri.stop()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The kubelet stopped (SIGSTOP) inside the block: what happens meanwhile in the API
        reaches it afterwards, in order, through its watch."""
        pid = self.kubelet.pid
        assert pid is not None and self.kubelet.alive(), "the kubelet is not running"
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def close(self, *, delete_node: bool = True) -> None:
        """Stop both, delete the Node (nothing else would mark it NotReady), remove the node's
        directory."""
        self.stop()
        if delete_node and self.cp.running:
            # Already gone, or the control plane is stopping.
            with contextlib.suppress(Exception):
                self.cp.request("DELETE", f"/api/v1/nodes/{self.name}")
        shutil.rmtree(self.dir, ignore_errors=True)

    def _wait(self, proc: ManagedProcess, what: str, check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + PATIENCE
        while not check():
            if not proc.alive():
                raise StartupError(
                    f"{proc.name} exited with code {proc.returncode} before {what}; log "
                    f"{proc.log_path}:\n{proc.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise StartupError(
                    f"{proc.name}: no {what} after {PATIENCE:.0f}s; log {proc.log_path}:\n"
                    f"{proc.log_tail()}"
                )
            time.sleep(0.05)

    # --- files ----------------------------------------------------------------------------

    def _write_files(self) -> None:
        for d in (self.plugin_dir, self.cwd, self.dir / "pod-logs", self.dir / "volume-plugins"):
            d.mkdir(parents=True, exist_ok=True)
        (self.cwd / SENTINEL).write_text("the kubelet's working directory must keep this file\n")
        tunables = self.dir / "tunables"
        tunables.mkdir(exist_ok=True)
        for tunable, value in KERNEL_TUNABLES.items():
            (tunables / tunable.replace("/", ".")).write_text(value + "\n")
        cert, key = self._ca.issue(self.name, self.dir)
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "testbed",
                    "cluster": {
                        "server": self.cp.server_url,
                        "certificate-authority": str(self.cp.ca_path),
                    },
                }
            ],
            "users": [
                {
                    "name": self.name,
                    "user": {"client-certificate": str(cert), "client-key": str(key)},
                }
            ],
            "contexts": [{"name": "node", "context": {"cluster": "testbed", "user": self.name}}],
            "current-context": "node",
        }
        (self.dir / "kubeconfig").write_text(json.dumps(kubeconfig, indent=2) + "\n")
        (self.dir / "config.json").write_text(json.dumps(self._config(), indent=2) + "\n")
        (self.dir / "namespace.sh").write_text(self._namespace_script())

    def _config(self) -> dict[str, Any]:
        port, healthz = free_ports(2)
        endpoint = f"unix://{self.cri_socket}"
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": endpoint,
            "imageServiceEndpoint": endpoint,
            # No container engine, no QoS cgroups, nothing reserved; cgroup v1 hosts allowed.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            "podLogsDir": str(self.dir / "pod-logs"),  # default /var/log/pods
            "volumePluginDir": str(self.dir / "volume-plugins"),  # default under /usr/libexec
            "resolvConf": "",
            "address": "127.0.0.1",
            "port": port,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": healthz,
            "readOnlyPort": 0,
            # Loopback only, and nothing here calls the kubelet's own API.
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "registerNode": True,
            # Device plugin capacity reaches the Node within a second instead of ten.
            "nodeStatusUpdateFrequency": "1s",
            # The control plane's, as a cluster's nodes run with its gates.
            "featureGates": dict(self.cp.feature_gates),
        }

    def _namespace_script(self) -> str:
        q = shlex.quote
        lines = [
            "#!/bin/sh",
            "# Run by `unshare --mount --propagation private`: every mount below belongs to this",
            "# namespace only and ends with the kubelet. A failed mount stops here, before exec.",
            "set -eu",
        ]
        for tunable in KERNEL_TUNABLES:
            held = self.dir / "tunables" / tunable.replace("/", ".")
            lines.append(f"mount -n --bind {q(str(held))} {q('/proc/sys/' + tunable)}")
        for path in OVERLAID:
            layer = self.dir / "overlay" / path.strip("/").replace("/", "-")
            upper, work = layer / "upper", layer / "work"
            lines.append(f"mkdir -p {q(str(upper))} {q(str(work))}")
            options = f"lowerdir={path},upperdir={upper},workdir={work}"
            lines.append(f"mount -n -t overlay overlay -o {q(options)} {q(path)}")
        lines.append(f"mkdir -p {KUBELET_DEVICE_PLUGIN_DIR}")
        lines.append(f"mount -n --bind {q(str(self.plugin_dir))} {KUBELET_DEVICE_PLUGIN_DIR}")
        lines.append(f"cd {q(str(self.cwd))}")
        lines.append('exec "$@"')
        return "\n".join(lines) + "\n"

    # --- reading the node -----------------------------------------------------------------

    def node(self) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self.cp.request("GET", f"/api/v1/nodes/{self.name}")
        except Exception:
            return None
        return found

    def _ready_condition(self) -> dict[str, Any]:
        """The Node's Ready condition as the kubelet last posted it ({} before the first)."""
        conditions = ((self.node() or {}).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c.get("type") == "Ready"), {})

    def ready(self) -> bool:
        return self._ready_condition().get("status") == "True"

    def wait_allocatable(self, expected: Mapping[str, int]) -> float:
        """Until the Node's capacity and allocatable show these counts (from a device plugin,
        which registers its resources one by one); the seconds it took."""
        began = time.monotonic()

        def shown() -> bool:
            status = (self.node() or {}).get("status") or {}
            return all(
                str((status.get(field) or {}).get(resource)) == str(count)
                for field in ("capacity", "allocatable")
                for resource, count in expected.items()
            )

        self._wait(self.kubelet, f"{dict(expected)} on {self.name}", shown)
        return time.monotonic() - began

    def created_containers(self) -> list[dict[str, Any]]:
        """Every CreateContainer fakecri has received, oldest first (pod, container, envs,
        devices, mounts)."""
        return list(self._fakecri_lines())

    def _fakecri_lines(self) -> Iterator[dict[str, Any]]:
        try:
            text = self.fakecri.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return
        for line in text.splitlines():
            if not line.startswith("{"):
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("call") == "CreateContainer":
                yield record

    def held(self) -> dict[tuple[str, str, str], dict[str, list[int]]]:
        """kubelet's pod resources List: (namespace, pod, container) -> resource -> sorted ids,
        for containers that hold devices."""
        import grpc

        from neuron_scheduler.deviceplugin.podresources.v1 import api_pb2, api_pb2_grpc

        with grpc.insecure_channel(f"unix://{self.pod_resources_socket}") as channel:
            stub = api_pb2_grpc.PodResourcesListerStub(channel)
            answer = stub.List(api_pb2.ListPodResourcesRequest(), timeout=10)
        found: dict[tuple[str, str, str], dict[str, list[int]]] = {}
        for pod in answer.pod_resources:
            for container in pod.containers:
                ids: dict[str, list[int]] = {}
                for devices in container.devices:
                    ids.setdefault(devices.resource_name, []).extend(
                        int(i) for i in devices.device_ids
                    )
                if ids:
                    key = (pod.namespace, pod.name, container.name)
                    found[key] = {r: sorted(v) for r, v in ids.items()}
        return found

    def host_changes(self) -> list[str]:
        """What the kubelet changed outside its directory: should always be empty."""
        now = HostState.read()
        changes = [
            f"/proc/sys/{t}: {self.host_before.tunables[t]} -> {v}"
            for t, v in now.tunables.items()
            if v != self.host_before.tunables[t]
        ]
        changes += [f"{p} created" for p in sorted(now.paths - self.host_before.paths)]
        if not (self.cwd / SENTINEL).is_file():
            changes.append(f"{self.cwd / SENTINEL} deleted")
        mounts = Path("/proc/self/mountinfo").read_text()
        if str(self.dir) in mounts:
            changes.append(f"mounts of {self.dir} visible on the host")
        return changes
