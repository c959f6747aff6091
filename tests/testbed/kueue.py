"""Kueue (and JobSet's controller) on a testbed control plane: real controllers with real webhooks,
run as processes on this machine (test tooling only, built by tools/kueue.mk).

Both are controller-runtime managers whose webhooks are Service-based and whose certificates
their own cert rotator makes (open-policy-agent/cert-controller). Outside a pod they need three
things (../shared/design/kueue-facts.md):
1. kube-apiserver resolving a webhook Service through its EndpointSlices, not its ClusterIP
   (nothing serves ClusterIPs here): `--enable-aggregator-routing=true`, which the testbed's
   control plane always sets.
2. An EndpointSlice for the webhook Service at a non-loopback address of this machine (the
   apiserver refuses endpoints in 127.0.0.0/8), where the controller serves its webhooks on a
   free port. The certificate names `<service>.<namespace>.svc`, the name the apiserver verifies.
3. The certificate files: the rotator writes them into the Secret only (a kubelet would mount
   it); until they are in its certDir it waits for ever. They are copied there once the Secret
   is filled.

Each runs under its own ServiceAccount with the ClusterRoles and Roles its manifests give it, as
an install does.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import ipaddress
import json
import os
import socket
import struct
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from .client import KubeError
from .controlplane import ControlPlane, find_built
from .process import ManagedProcess, free_ports
from .stack import install_crds

KUEUE_NAMESPACE = "kueue-system"
JOBSET_NAMESPACE = "jobset-system"
CERT_FILES = ("ca.crt", "ca.key", "tls.crt", "tls.key")
# What an install applies besides the CRDs (not its Deployment: the process runs here; not
# Kueue's visibility API, whose feature gate is off).
KINDS = (
    "Namespace",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "Secret",
    "Service",
)
WEBHOOK_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
SIOCGIFADDR = 0x8915
JOBSET_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")


def find_kueue_bin(repo_root: str | os.PathLike[str] | None = None) -> Path:
    """The directory tools/kueue.mk builds (binaries and rendered manifests)."""
    return find_built("KUEUE_BIN_DIR", "kueue-bin", repo_root)


def host_address() -> str:
    """This machine's first IPv4 address outside the loopback and link-local ranges: where the
    API server may be sent to a webhook."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                answer = fcntl.ioctl(
                    probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue  # no IPv4 address on this interface
        address = ipaddress.IPv4Address(answer[20:24])
        if not (address.is_loopback or address.is_link_local):
            return str(address)
    raise RuntimeError(
        "no non-loopback IPv4 address on this machine: the API server refuses webhook "
        "endpoints on loopback, so Kueue's webhooks cannot be reached"
    )


class WebhookController:
    """One controller-runtime manager with Service-based webhooks, run here (see the module's
    docstring). `manifests`: what `kubectl kustomize config/default` renders for it."""

    def __init__(
        self,
        cp: ControlPlane,
        name: str,
        argv: Sequence[str],
        manifests: Path,
        namespace: str,
        account: str,
        service: str,
        secret: str,
        *,
        cert_dir: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.cp = cp
        self.name = name
        self.namespace = namespace
        self.account = account
        self.service = service
        self.secret = secret
        self.workdir = cp.workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cert_dir = cert_dir or self.workdir / "certs"
        self.cert_dir.mkdir(parents=True, exist_ok=True)
        self.docs = [d for d in yaml.safe_load_all(manifests.read_text()) if d]
        self.host = host_address()
        self.webhook_port, self.health_port = free_ports(2)
        self.argv = list(argv)
        self.env = dict(env or {})
        self.process: ManagedProcess | None = None
        self.started_seconds = 0.0  # from start(): install, process, certificates, ready
        self.serving_seconds = 0.0  # from the process's start until it is ready

    api_version = ""  # of its Configuration file

    def settings(self) -> dict[str, Any]:
        """Its own part of the Configuration file (the manager's part is `config`'s)."""
        return {}

    def flags(self, config: Path) -> list[str]:
        return [f"--config={config}"]

    def config(self) -> list[str]:
        """The Configuration file, written under workdir: probes on 127.0.0.1, no metrics, one
        replica, its webhooks here with their certificates from certDir; the flags naming it."""
        configuration = {
            "apiVersion": self.api_version,
            "kind": "Configuration",
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {
                "host": self.host,
                "port": self.webhook_port,
                "certDir": str(self.cert_dir),
            },
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": True},
            **self.settings(),
        }
        path = self.workdir / "config.yaml"
        path.write_text(json.dumps(configuration, indent=1))
        return self.flags(path)

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 180.0) -> None:
        began = time.monotonic()
        install_crds(self.cp, [d for d in self.docs if d["kind"] == "CustomResourceDefinition"])
        self._apply([d for d in self.docs if d["kind"] in KINDS])
        self._endpoints()
        credentials = self.cp.service_account(self.namespace, self.account)
        env = {**os.environ, **self.env, "KUBECONFIG": str(credentials.kubeconfig_path)}
        for key in ("NO_PROXY", "no_proxy"):
            env[key] = ",".join(filter(None, (env.get(key), "127.0.0.1", self.host)))
        self.process = ManagedProcess(
            self.name,
            [*self.argv, *self.config()],
            self.cp.log_dir / f"{self.name}.log",
            env=env,
            cwd=self.workdir,
        )
        # The webhook configurations last: until the controller serves, they would refuse every
        # write they match (their failurePolicy is Fail).
        self._apply([d for d in self.docs if d["kind"] in WEBHOOK_KINDS])
        self.process.start()
        launched = time.monotonic()
        deadline = launched + timeout
        copied = False
        while not (copied and self._ready() and self._injected()):
            if not self.process.alive():
                raise RuntimeError(f"{self.name} exited:\n{self.process.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready:\n{self.process.log_tail()}")
            copied = copied or self._copy_certs()
            time.sleep(0.2)
        self.started_seconds = time.monotonic() - began
        self.serving_seconds = time.monotonic() - launched

    def stop(self) -> None:
        """The process, then its webhook configurations (they would refuse what they match)."""
        if self.process is not None:
            self.process.stop()
        for doc in self.docs:
            if doc["kind"] in WEBHOOK_KINDS:
                path = f"/apis/admissionregistration.k8s.io/v1/{doc['kind'].lower()}s"
                with contextlib.suppress(KubeError):
                    self.cp.request("DELETE", f"{path}/{doc['metadata']['name']}")

    def logs(self) -> dict[str, Path]:
        return {self.name: self.process.log_path} if self.process is not None else {}

    # --- the three things --------------------------------------------------------------------

    def _apply(self, docs: list[dict[str, Any]]) -> None:
        if not docs:
            return
        self.cp.kubectl(
            "apply",
            "--server-side",
            "--force-conflicts",
            f"--field-manager={self.name}-install",
            "-f",
            "-",
            input=yaml.safe_dump_all(docs),
        )

    def _endpoints(self) -> None:
        """The webhook Service's one endpoint: this machine's address, the controller's port
        (port name "": the Service's port has none)."""
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": f"{self.service}-testbed",
                "namespace": self.namespace,
                "labels": {"kubernetes.io/service-name": self.service},
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [self.host], "conditions": {"ready": True}}],
            "ports": [{"name": "", "port": self.webhook_port, "protocol": "TCP"}],
        }
        self._apply([body])

    def _copy_certs(self) -> bool:
        """The Secret's certificate files into certDir, once the rotator has filled it."""
        try:
            found = self.cp.request(
                "GET", f"/api/v1/namespaces/{self.namespace}/secrets/{self.secret}"
            )
        except KubeError:
            return False
        data = found.get("data") or {}
        if not all(data.get(f) for f in CERT_FILES):
            return False
        for name in CERT_FILES:
            path = self.cert_dir / name
            path.write_bytes(base64.b64decode(data[name]))
            path.chmod(0o600)
        return True

    def _ready(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.health_port}/readyz"
            with urllib.request.urlopen(url, timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def _injected(self) -> bool:
        """Every webhook configuration carries the rotator's CA (the API server verifies the
        serving certificate with it)."""
        for doc in self.docs:
            if doc["kind"] not in WEBHOOK_KINDS:
                continue
            path = f"/apis/admissionregistration.k8s.io/v1/{doc['kind'].lower()}s"
            found = self.cp.request("GET", f"{path}/{doc['metadata']['name']}")
            if not all(w["clientConfig"].get("caBundle") for w in found["webhooks"]):
                return False
        return True


class Kueue(WebhookController):
    """Kueue v0.17.0 (tools/kueue) with the frameworks given, `manageJobsWithoutQueueName` off
    (only what names a LocalQueue is Kueue's), and waitForPodsReady on as SageMaker HyperPod's
    task governance runs it (`pods_ready_seconds`; admissions are not blocked meanwhile)."""

    def __init__(
        self,
        cp: ControlPlane,
        bin_dir: Path,
        *,
        frameworks: Sequence[str] = ("batch/job", "pod"),
        pods_ready_seconds: int = 300,
        name: str = "kueue",
    ) -> None:
        super().__init__(
            cp,
            name,
            [str(bin_dir / "kueue")],
            bin_dir / "kueue.yaml",
            KUEUE_NAMESPACE,
            "kueue-controller-manager",
            "kueue-webhook-service",
            "kueue-webhook-server-cert",
        )
        self.frameworks = list(frameworks)
        self.pods_ready_seconds = pods_ready_seconds

    api_version = "config.kueue.x-k8s.io/v1beta2"

    def settings(self) -> dict[str, Any]:
        return {
            "namespace": KUEUE_NAMESPACE,
            "manageJobsWithoutQueueName": False,
            "waitForPodsReady": {
                "timeout": f"{self.pods_ready_seconds}s",
                "blockAdmission": False,
                "requeuingStrategy": {
                    "timestamp": "Eviction",
                    "backoffLimitCount": 2,
                    "backoffBaseSeconds": 5,
                    "backoffMaxSeconds": 30,
                },
            },
            "integrations": {"frameworks": self.frameworks},
            # The visibility API (an aggregated API server of its own) is not installed.
            "featureGates": {"VisibilityOnDemand": False},
        }

    def flags(self, config: Path) -> list[str]:
        return [f"--config={config}", "--zap-log-level=2"]


class JobSetController(WebhookController):
    """JobSet v0.11.1's controller (tools/kueue/jobset), its webhooks served here.

    Its cert rotator reads the certificates from a fixed directory (JOBSET_CERT_DIR, no option),
    so one JobSet controller runs on a machine at a time: a lock file there says whose they are.
    Its namespace is its pod's service account's, else jobset-system (no option either).
    """

    api_version = "config.jobset.x-k8s.io/v1alpha1"

    def __init__(self, cp: ControlPlane, bin_dir: Path, name: str = "jobset") -> None:
        super().__init__(
            cp,
            name,
            [str(bin_dir / "jobset")],
            bin_dir / "jobset.yaml",
            JOBSET_NAMESPACE,
            "jobset-controller-manager",
            "jobset-webhook-service",
            "jobset-webhook-server-cert",
            cert_dir=JOBSET_CERT_DIR,
        )
        self._lock: int | None = None

    def start(self, timeout: float = 180.0) -> None:
        lock = os.open(JOBSET_CERT_DIR / ".lock", os.O_CREAT | os.O_RDWR, 0o600)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(lock)
                    raise TimeoutError(
                        f"another JobSet controller on this machine holds {JOBSET_CERT_DIR}"
                    ) from None
                time.sleep(1.0)
        self._lock = lock
        for name in CERT_FILES:  # another run's, which its rotator would take for its own
            (JOBSET_CERT_DIR / name).unlink(missing_ok=True)
        super().start(timeout)

    def stop(self) -> None:
        super().stop()
        if self._lock is not None:
            os.close(self._lock)  # (releases the lock)
            self._lock = None
