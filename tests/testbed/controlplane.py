"""A real etcd + kube-apiserver (+ kube-scheduler) on 127.0.0.1 for tests.

Built on the multi-call binary from tools/kube (`make kube-bin`). There is no
kubelet: create Nodes and Pods directly, delete pods with grace period 0, and
expect namespaces never to finish terminating. kube-controller-manager runs only
when a test starts it (`start_controller_manager`), with the controllers it names.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from .client import KubeClient, opener, write_kubeconfig
from .kubeversion import binary_version, gates_flag, needed_gates
from .manifests import scheduler_config
from .process import ManagedProcess, free_ports

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


class StartupError(RuntimeError):
    """A component exited or did not become ready; the message has its log tail."""


@dataclass(frozen=True)
class ServiceAccountCredentials:
    namespace: str
    name: str
    token: str
    kubeconfig_path: Path


def find_kubebin(repo_root: str | os.PathLike[str] | None = None) -> Path:
    """Locate the multi-call binary (tools/kube.mk)."""
    return find_built("KUBE_BIN", "kube-bin", repo_root)


def find_built(variable: str, target: str, repo_root: str | os.PathLike[str] | None = None) -> Path:
    """What a tools/*.mk fragment builds: $variable if set (the fragment exports it to make
    recipes), else `make target` in repo_root (default: cwd), which builds it on first use
    (minutes when cold) and prints its path on its last line."""
    env = os.environ.get(variable)
    if env:
        return Path(env)
    res = subprocess.run(
        ["make", "-s", "--no-print-directory", "-C", str(repo_root or Path.cwd()), target],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return Path(res.stdout.strip().splitlines()[-1])


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Loopback traffic must never go through a proxy configured for the registries.
    for key in ("NO_PROXY", "no_proxy"):
        extra = "127.0.0.1,localhost"
        env[key] = f"{env[key]},{extra}" if env.get(key) else extra
    return env


def _get_ok(url: str, *, token: str | None = None, cafile: Path | None = None) -> bool:
    req = urllib.request.Request(url)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with opener(cafile).open(req, timeout=2.0) as resp:
            return bool(resp.status == 200)
    except OSError:  # refused, TLS not up yet, or 5xx while checks are failing
        return False


def _wait_ready(proc: ManagedProcess, what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if not proc.alive():
            raise StartupError(
                f"{proc.name} exited with code {proc.returncode} before {what}; "
                f"log {proc.log_path}:\n{proc.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise StartupError(
                f"{proc.name}: no {what} after {timeout:.0f}s; log {proc.log_path}:\n"
                f"{proc.log_tail()}"
            )
        time.sleep(0.1)


class Scheduler:
    """A kube-scheduler process that can be stopped and restarted on its own."""

    def __init__(
        self, process: ManagedProcess, config_path: Path, port: int, startup_timeout: float
    ) -> None:
        self.process = process
        self.config_path = config_path
        self.port = port
        self.startup_timeout = startup_timeout

    def __repr__(self) -> str:
        return f"Scheduler(port={self.port}, process={self.process!r})"

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    @property
    def config(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.config_path.read_text())
        return result

    def start(self) -> None:
        """Start and wait until /readyz passes, which includes its informers having synced."""
        self.process.start()
        url = f"https://127.0.0.1:{self.port}/readyz"
        try:
            _wait_ready(self.process, "/readyz", lambda: _get_ok(url), self.startup_timeout)
        except BaseException:
            self.process.stop()
            raise

    def stop(self, timeout: float = 5.0, *, kill: bool = False) -> int | None:
        return self.process.stop(timeout, kill=kill)

    def restart(self) -> None:
        self.stop()
        self.start()

    def metrics(self, token: str) -> str:
        """Its /metrics text (the admin token passes the delegated authorization; the serving
        certificate is the self-signed one it made for 127.0.0.1)."""
        req = urllib.request.Request(f"https://127.0.0.1:{self.port}/metrics")
        req.add_header("Authorization", f"Bearer {token}")
        with opener(None).open(req, timeout=10.0) as resp:
            text: str = resp.read().decode()
        return text

    def alive(self) -> bool:
        return self.process.alive()


# What tests that run workloads need: Deployments recreate evicted pods, PodDisruptionBudgets get
# their status (disruptionsAllowed, which the Eviction API checks), owners' deletions reach pods.
WORKLOAD_CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "disruption-controller",
    "garbage-collector-controller",
)


class ControllerManager:
    """A kube-controller-manager process, stopped by the test that started it."""

    def __init__(self, process: ManagedProcess) -> None:
        self.process = process

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def stop(self) -> None:
        self.process.stop()


class ControlPlane:
    """etcd and kube-apiserver on free 127.0.0.1 ports, torn down on exit.

    with ControlPlane(kubebin, workdir) as cp:
        cp.request("POST", "/api/v1/nodes", builders.node_json("n1", "inf1.6xlarge"))
        cp.start_scheduler(extender_url="http://127.0.0.1:8888", node_cache_capable=True)

    workdir holds keys, kubeconfigs, etcd data and logs/<component>.log; etcd data
    and serving certs from a previous run there are discarded. With workdir None
    a temporary directory is used and removed by stop().

    Every component started here (and a testbed Kubelet) gets `feature_gates`: those the
    binary's version needs for the product's features (kubeversion.needed_gates) and the
    caller's on top.
    """

    def __init__(
        self,
        kubebin: str | os.PathLike[str],
        workdir: str | os.PathLike[str] | None = None,
        *,
        startup_timeout: float = 60.0,
        extra_apiserver_args: Sequence[str] = (),
        feature_gates: Mapping[str, bool] | None = None,
    ) -> None:
        self.kubebin = Path(kubebin).resolve()
        if not os.access(self.kubebin, os.X_OK):
            raise FileNotFoundError(f"kube multi-call binary not found: {self.kubebin}")
        self.version = binary_version(self.kubebin)
        self.feature_gates = {**needed_gates(self.version), **(feature_gates or {})}
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="ns-kube-")).resolve()
        self.startup_timeout = startup_timeout
        self.extra_apiserver_args = list(extra_apiserver_args)
        self.admin_token = secrets.token_hex(16)
        self.etcd_url = ""
        self.server_url = ""
        self.kubeconfig_path = self.workdir / "admin.kubeconfig"
        self.ca_path = self.workdir / "apiserver-certs" / "apiserver.crt"
        self.log_dir = self.workdir / "logs"
        self.startup_seconds = 0.0
        self._env = _child_env()
        self._etcd: ManagedProcess | None = None
        self._apiserver: ManagedProcess | None = None
        self._schedulers: list[Scheduler] = []
        self._controller_managers: list[ControllerManager] = []
        self._client: KubeClient | None = None

    # lifecycle -------------------------------------------------------------

    def __enter__(self) -> Self:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._client is not None

    def start(self) -> Self:
        if self.running:
            raise RuntimeError("control plane already started")
        began = time.monotonic()
        try:
            self._start()
        except BaseException:
            # Keep even a temporary workdir: the error message points at its logs.
            self._own_workdir = False
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def _start(self) -> None:
        self._etcd = self._apiserver = None
        self._schedulers = []
        self.workdir.mkdir(parents=True, exist_ok=True)
        for stale in ("etcd-data", "apiserver-certs"):
            shutil.rmtree(self.workdir / stale, ignore_errors=True)
        pki = self.workdir / "pki"
        pki.mkdir(exist_ok=True)
        sa_key, sa_pub = pki / "sa.key", pki / "sa.pub"
        self._openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(sa_key))
        self._openssl("ec", "-in", str(sa_key), "-pubout", "-out", str(sa_pub))
        tokens = self.workdir / "tokens.csv"
        tokens.write_text(f'{self.admin_token},admin,admin,"system:masters"\n')
        tokens.chmod(0o600)

        etcd_port, peer_port, api_port = free_ports(3)
        self.etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer_url = f"http://127.0.0.1:{peer_port}"
        self._etcd = self._process(
            "etcd",
            "--name=testbed",
            f"--data-dir={self.workdir / 'etcd-data'}",
            f"--listen-client-urls={self.etcd_url}",
            f"--advertise-client-urls={self.etcd_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=testbed={peer_url}",
            # Test data is disposable; fsync dominates etcd latency on shared disks.
            "--unsafe-no-fsync",
            "--log-level=warn",
        )
        self._etcd.start()
        _wait_ready(
            self._etcd, "/health", lambda: _get_ok(f"{self.etcd_url}/health"), self.startup_timeout
        )

        self.server_url = f"https://127.0.0.1:{api_port}"
        self._apiserver = self._process(
            "kube-apiserver",
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={api_port}",
            # A self-signed serving cert (and its CA) is generated here: ca_path.
            f"--cert-dir={self.ca_path.parent}",
            f"--token-auth-file={tokens}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={sa_pub}",
            f"--service-account-signing-key-file={sa_key}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            # Nothing serves the kubernetes Service endpoints; no controller-manager
            # creates default ServiceAccounts or lifts the not-ready taint.
            "--endpoint-reconciler-type=none",
            "--disable-admission-plugins=ServiceAccount,TaintNodesByCondition",
            "--allow-privileged=true",
            "--profiling=false",
            *gates_flag(self.feature_gates),
            # Webhooks and aggregated APIs behind a Service are reached at its EndpointSlices'
            # addresses: nothing serves ClusterIPs here (no kube-proxy). Kueue's webhooks need it
            # (tests/testbed/kueue.py); without such Services it changes nothing.
            "--enable-aggregator-routing=true",
            *self.extra_apiserver_args,
        )
        self._apiserver.start()
        _wait_ready(
            self._apiserver,
            "/readyz",
            lambda: _get_ok(f"{self.server_url}/readyz", token=self.admin_token),
            self.startup_timeout,
        )
        write_kubeconfig(
            self.kubeconfig_path,
            server_url=self.server_url,
            token=self.admin_token,
            user="admin",
            cafile=self.ca_path,
        )
        self._client = KubeClient(self.server_url, self.admin_token, cafile=self.ca_path)

    def stop(self) -> None:
        """Stop every component (SIGTERM, SIGKILL after 5 s), newest first. Idempotent.

        log_paths stay valid afterwards, for reporting a failed test.
        """
        self._client = None
        for p in reversed(self.processes):
            p.stop()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _openssl(self, *args: str) -> None:
        res = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise StartupError(f"openssl {' '.join(args)} failed: {res.stderr.strip()}")

    def _process(self, component: str, *args: str, log_name: str | None = None) -> ManagedProcess:
        return ManagedProcess(
            component,
            [str(self.kubebin), component, *args],
            self.log_dir / f"{log_name or component}.log",
            env=self._env,
            cwd=self.workdir,
        )

    # access ----------------------------------------------------------------

    @property
    def client(self) -> KubeClient:
        """Admin (system:masters) client."""
        if self._client is None:
            raise RuntimeError("control plane is not running")
        return self._client

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        """KubeClient.request as admin: decoded JSON, KubeError on non-2xx."""
        return self.client.request(method, path, body, content_type)

    @property
    def log_paths(self) -> dict[str, Path]:
        """component -> log file; schedulers are kube-scheduler, kube-scheduler-2, ..."""
        paths: dict[str, Path] = {}
        if self._etcd is not None:
            paths["etcd"] = self._etcd.log_path
        if self._apiserver is not None:
            paths["kube-apiserver"] = self._apiserver.log_path
        for s in self._schedulers:
            paths[s.log_path.stem] = s.log_path
        for m in self._controller_managers:
            paths[m.log_path.stem] = m.log_path
        return paths

    @property
    def processes(self) -> list[ManagedProcess]:
        procs = [p for p in (self._etcd, self._apiserver) if p is not None]
        procs += [m.process for m in self._controller_managers]
        return procs + [s.process for s in self._schedulers]

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl (from the same binary) as admin, or with the given kubeconfig."""
        res = subprocess.run(
            [
                str(self.kubebin),
                "kubectl",
                f"--kubeconfig={kubeconfig or self.kubeconfig_path}",
                *args,
            ],
            input=input,
            capture_output=True,
            text=True,
            env=self._env,
            check=False,
        )
        if check and res.returncode != 0:
            raise subprocess.CalledProcessError(res.returncode, res.args, res.stdout, res.stderr)
        return res

    # components on top ------------------------------------------------------

    def start_scheduler(
        self,
        extender_url: str | None = None,
        node_cache_capable: bool = False,
        scheduler_name: str = "my-scheduler",
        kubeconfig: str | os.PathLike[str] | None = None,
        *,
        extra_args: Sequence[str] = ("--v=2",),
        config: Mapping[str, Any] | None = None,
        feature_gates: Mapping[str, bool] | None = None,
    ) -> Scheduler:
        """Start a kube-scheduler serving one profile, with our extender if extender_url.

        Runs as admin unless kubeconfig is given. --v=2 logs each binding, which
        is what one reads when a test fails. A given config (e.g. the Helm chart's
        KubeSchedulerConfiguration) is used instead, with clientConnection.kubeconfig set.
        It gets the control plane's feature gates and `feature_gates` on top.
        """
        if not self.running:
            raise RuntimeError("control plane is not running")
        index = len(self._schedulers) + 1
        log_name = "kube-scheduler" if index == 1 else f"kube-scheduler-{index}"
        kc = Path(kubeconfig).resolve() if kubeconfig is not None else self.kubeconfig_path
        config_path = self.workdir / f"{log_name}.json"
        if config is not None:
            connection = {**config.get("clientConnection", {}), "kubeconfig": str(kc)}
            config = {**config, "clientConnection": connection}
        else:
            config = scheduler_config(
                scheduler_name=scheduler_name,
                extender_url=extender_url,
                node_cache_capable=node_cache_capable,
                kubeconfig=str(kc),
            )
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        (port,) = free_ports(1)
        proc = self._process(
            "kube-scheduler",
            f"--config={config_path}",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            # Lets /metrics accept the admin token; /readyz is always allowed.
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            *gates_flag({**self.feature_gates, **(feature_gates or {})}),
            *extra_args,
            log_name=log_name,
        )
        scheduler = Scheduler(proc, config_path, port, self.startup_timeout)
        self._schedulers.append(scheduler)
        scheduler.start()
        return scheduler

    def start_controller_manager(
        self, controllers: Sequence[str] = WORKLOAD_CONTROLLERS
    ) -> ControllerManager:
        """kube-controller-manager as admin, running only `controllers`, ready once its
        /healthz passes. The caller stops it (its controllers act on every namespace)."""
        if not self.running:
            raise RuntimeError("control plane is not running")
        (port,) = free_ports(1)
        kc = self.kubeconfig_path
        index = len(self._controller_managers) + 1
        proc = self._process(
            "kube-controller-manager",
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            f"--controllers={','.join(controllers)}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            # Controllers react within a second; the defaults wait for resyncs of many seconds.
            "--concurrent-deployment-syncs=2",
            "--concurrent-replicaset-syncs=2",
            *gates_flag(self.feature_gates),
            "--v=2",
            log_name=f"kube-controller-manager-{index}",
        )
        manager = ControllerManager(proc)
        self._controller_managers.append(manager)
        proc.start()
        url = f"https://127.0.0.1:{port}/healthz"
        try:
            _wait_ready(
                proc, "/healthz", lambda: _get_ok(url, token=self.admin_token), self.startup_timeout
            )
        except BaseException:
            proc.stop()
            raise
        return manager

    def service_account(
        self,
        namespace: str,
        name: str,
        *,
        expiration_seconds: int = 24 * 3600,
        kubeconfig_path: Path | None = None,
        node: str | None = None,
    ) -> ServiceAccountCredentials:
        """Create (if needed) a ServiceAccount, mint a token for it, write its kubeconfig.

        The token comes from the TokenRequest API, as a projected token would;
        grant it permissions with Roles/ClusterRoles and bindings via request().
        With `node`, the token is bound to a pod of that account on that node (created here,
        `<name>-<node>`), as kubelet mounts one into a DaemonSet's pod: the API server then
        names the node in the token's user (authentication.kubernetes.io/node-name), which
        admission policies check.
        """
        self.client.ensure_namespace(namespace)
        sa_path = f"/api/v1/namespaces/{namespace}/serviceaccounts"
        existing = self.client.get(sa_path)
        if not any(i["metadata"]["name"] == name for i in existing.get("items", [])):
            self.client.create(
                sa_path,
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}},
            )
        spec: dict[str, Any] = {"expirationSeconds": expiration_seconds}
        if node is not None:
            pods = f"/api/v1/namespaces/{namespace}/pods"
            listed = self.client.get(f"{pods}?fieldSelector=metadata.name={name}-{node}")
            pod = (
                listed["items"][0]
                if listed["items"]
                else self.client.create(
                    pods,
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {"name": f"{name}-{node}"},
                        "spec": {
                            "nodeName": node,
                            "serviceAccountName": name,
                            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}],
                        },
                    },
                )
            )
            meta = pod["metadata"]
            spec["boundObjectRef"] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": meta["name"],
                "uid": meta["uid"],
            }
        answer = self.client.create(
            f"{sa_path}/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        token: str = answer["status"]["token"]
        suffix = f"-{node}" if node is not None else ""
        path = kubeconfig_path or self.workdir / f"sa-{namespace}-{name}{suffix}.kubeconfig"
        write_kubeconfig(
            path,
            server_url=self.server_url,
            token=token,
            user=f"{namespace}-{name}",
            cafile=self.ca_path,
            namespace=namespace,
        )
        return ServiceAccountCredentials(namespace, name, token, path)

    def client_for(self, token: str) -> KubeClient:
        """A client authenticating with another token, e.g. a ServiceAccount's."""
        return KubeClient(self.server_url, token, cafile=self.ca_path)

    def pod_user(
        self,
        namespace: str,
        name: str,
        verbs: Sequence[str],
        resources: Sequence[str] = ("pods",),
    ) -> KubeClient:
        """A client for a ServiceAccount `name` allowed only `verbs` on `resources` (pods, or
        their subresources too) in `namespace`: a tenant who may write pods there and nothing
        else."""
        credentials = self.service_account(namespace, name)
        rules = [{"apiGroups": [""], "resources": list(resources), "verbs": list(verbs)}]
        self.grant(namespace, f"{name}-pods", rules, name)
        return self.client_for(credentials.token)

    def grant(self, namespace: str, role: str, rules: list[dict[str, Any]], account: str) -> None:
        """A Role `role` of these `rules` in `namespace`, bound to its ServiceAccount `account`."""
        rbac = f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}"
        self.request(
            "POST",
            f"{rbac}/roles",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": role},
                "rules": rules,
            },
        )
        self.request(
            "POST",
            f"{rbac}/rolebindings",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": role},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
            },
        )
