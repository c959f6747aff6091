"""Our extender on a testbed control plane, wired like the Helm chart wires it.

The extender runs as its own process with a ServiceAccount token bound to the chart's ClusterRole
rules (charts/neuron-scheduler/files/extender-rules.yaml), never as admin; `my-scheduler` calls it.
Used by the end-to-end tests and by `neuron-scheduler cluster`.
"""

from __future__ import annotations

import json
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from .controlplane import ControlPlane, Scheduler
from .process import ManagedProcess, free_ports

REPO = Path(__file__).resolve().parents[2]  # tests/testbed/stack.py -> the checkout
RULES = REPO / "charts" / "neuron-scheduler" / "files" / "extender-rules.yaml"
ROLE = "neuron-scheduler-extender"


class ExtenderProcess:
    """The extender as a separate process, restartable and killable like a real pod."""

    def __init__(
        self,
        cp: ControlPlane,
        kubeconfig: Path,
        port: int | None = None,
        *,
        name: str = "extender",
        extra_args: Sequence[str] = (),
        tls: tuple[Path, Path, Path] | None = None,
    ) -> None:
        """extra_args go to the `extender` command (e.g. --leader-elect); name names the log;
        tls: (CA, certificate, key) to serve HTTPS with, the CA to check it."""
        self.cp = cp
        self.port = port or free_ports(1)[0]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._ssl = ssl.create_default_context(cafile=str(tls[0])) if tls else None
        if tls:
            extra_args = [*extra_args, "--tls-cert", str(tls[1]), "--tls-key", str(tls[2])]
        self.process = ManagedProcess(
            "extender",
            [
                sys.executable,
                "-m",
                "neuron_scheduler",
                "extender",
                "--kubeconfig",
                str(kubeconfig),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "info",
                *extra_args,
            ],
            cp.log_dir / f"{name}.log",
        )

    def start(self, timeout: float = 60.0) -> None:
        self.process.start()
        deadline = time.monotonic() + timeout
        while not self._ready():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"extender not ready after {timeout:.0f}s:\n{self.process.log_tail()}"
                )
            time.sleep(0.1)

    def _ready(self) -> bool:
        if not self.process.alive():
            raise RuntimeError(f"extender exited:\n{self.process.log_tail()}")
        try:
            with urllib.request.urlopen(
                self.url + "/readyz", timeout=2, context=self._ssl
            ) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        self.process.stop(kill=True)

    def call(self, verb: str, body: bytes | object, timeout: float = 30.0) -> tuple[int, Any]:
        """POST a verb as kube-scheduler does; (HTTP status, decoded JSON answer)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(
            f"{self.url}/{verb}",
            data=data,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self._ssl) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"null")

    def bind(self, pod: dict[str, Any], node: str) -> str:
        """Bind a pod (as the API server returned it) to a node: the extender's Error."""
        meta = pod["metadata"]
        args = {
            "PodName": meta["name"],
            "PodNamespace": meta["namespace"],
            "PodUID": meta["uid"],
            "Node": node,
        }
        status, answer = self.call("bind", args)
        assert status == 200, (status, answer)
        return str(answer["Error"])

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("the extender process has no VmRSS line")

    def healthz_seconds(self) -> float:
        start = time.perf_counter()
        with urllib.request.urlopen(self.url + "/healthz", timeout=30, context=self._ssl) as answer:
            answer.read()
        return time.perf_counter() - start

    def metrics(self) -> str:
        with urllib.request.urlopen(
            self.url + "/metrics", timeout=5, context=self._ssl
        ) as response:
            return str(response.read().decode())

    def metric(self, name: str) -> float:
        """Sum of every sample whose line starts with `name` (name plus labels, if given)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total


class Stack:
    """A control plane, the extender with least privilege, and a `my-scheduler` using it."""

    def __init__(self, cp: ControlPlane, extender_port: int | None = None) -> None:
        self.cp = cp
        if not RULES.exists():
            raise FileNotFoundError(
                f"{RULES} not found: the testbed runs from a repository checkout"
            )
        rules = yaml.safe_load(RULES.read_text())
        cp.request(
            "POST",
            "/apis/rbac.authorization.k8s.io/v1/clusterroles",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": ROLE},
                "rules": rules,
            },
        )
        credentials = cp.service_account("kube-system", "neuron-scheduler")
        cp.request(
            "POST",
            "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": ROLE},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": ROLE,
                },
                "subjects": [
                    {
                        "kind": "ServiceAccount",
                        "name": "neuron-scheduler",
                        "namespace": "kube-system",
                    }
                ],
            },
        )
        self.extender_token = credentials.token
        self.extender_kubeconfig = (
            credentials.kubeconfig_path
        )  # least privilege, for more extenders
        self.extender = ExtenderProcess(cp, credentials.kubeconfig_path, extender_port)
        self.extender.start()
        self.scheduler: Scheduler | None = None
        self.node_cache_capable = True

    def use_scheduler(self, node_cache_capable: bool) -> Scheduler:
        """(Re)start `my-scheduler` with the extender in the given node mode."""
        if self.scheduler is not None and self.node_cache_capable == node_cache_capable:
            return self.scheduler
        if self.scheduler is not None:
            self.scheduler.stop()
        self.node_cache_capable = node_cache_capable
        self.scheduler = self.cp.start_scheduler(self.extender.url, node_cache_capable)
        return self.scheduler

    def logs(self) -> dict[str, Path]:
        return {**self.cp.log_paths, "extender": self.extender.process.log_path}

    def stop(self) -> None:
        self.extender.process.stop()
