"""Our extender on a testbed control plane, wired like the Helm chart wires it.

The extender runs as its own process with a ServiceAccount token bound to the chart's ClusterRole
rules (charts/neuron-scheduler/files/extender-rules.yaml), never as admin; `my-scheduler` calls it.
Used by the end-to-end tests and by `neuron-scheduler cluster`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from neuron_scheduler.sim.kubescheduler import CHART, Profile

from .client import KubeClient, KubeError
from .controlplane import ControlPlane, Scheduler
from .manifests import scheduler_config
from .pki import Pki
from .process import ManagedProcess, free_ports

REPO = Path(__file__).resolve().parents[2]  # tests/testbed/stack.py -> the checkout
# The profiles the extender binds for: my-scheduler, and "nobody", the schedulerName of pods that
# only tests bind, by calling /bind directly (no kube-scheduler serves it).
SCHEDULER_NAMES = ("my-scheduler", "nobody")
RULES = REPO / "charts" / "neuron-scheduler" / "files" / "extender-rules.yaml"
CLAIM_CRD = REPO / "charts" / "neuron-scheduler" / "files" / "ultraserverclaims-crd.yaml"
CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
# With consolidation on, the chart adds these (the tests run it on); likewise capacity requests
# and, with the DRA driver on, the DRA scoring rules.
CONSOLIDATION_RULES = RULES.with_name("consolidation-rules.yaml")
CAPACITY_RULES = RULES.with_name("capacity-rules.yaml")
DRA_SCORING_RULES = RULES.with_name("dra-scoring-rules.yaml")
# With the placement admission check on (docs/kueue.md): Kueue's Workloads and their status.
KUEUE_RULES = RULES.with_name("kueue-rules.yaml")
# The chart's PriorityClass of capacity requests' placeholders.
PLACEHOLDER_PRIORITY_CLASS = "neuron-scheduler-capacity-request"
# With preemption on (the chart's default), these: the extender evicts training jobs whole.
PREEMPTION_RULES = RULES.with_name("preemption-rules.yaml")
# What the extender may change in a pod update, who else may write a consolidation plan, and who
# may write the hand-off annotations: the chart's admission policies, with the testbed's
# ServiceAccount names (the device plugin's is the chart's, tests/e2e/chart.py).
POD_WRITES = RULES.with_name("extender-pod-writes.yaml")
PLAN_WRITES = RULES.with_name("extender-plans.yaml")
HAND_OFF_WRITES = RULES.with_name("hand-off-writes.yaml")
ROLE = "neuron-scheduler-extender"
EXTENDER_USER = "system:serviceaccount:kube-system:neuron-scheduler"
DEVICE_PLUGIN_USER = "system:serviceaccount:kube-system:neuron-device-plugin"
HAND_OFF_POLICY = f"{ROLE}-hand-off"
POLICIES = (f"{ROLE}-pod-writes", f"{ROLE}-plans", HAND_OFF_POLICY)
ADMISSION = "/apis/admissionregistration.k8s.io/v1"
# The Lease of consolidation's eviction budget (the extender's default name, in kube-system: the
# namespace an extender outside a pod uses), and the Role on it, as the chart renders them.
BUDGET_LEASE = "k8s-neuron-scheduler-consolidation"


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
        pki: Pki | None = None,
        scheduler_names: Sequence[str] = SCHEDULER_NAMES,
        check_hostname: bool = True,
    ) -> None:
        """extra_args go to the `extender` command (e.g. --leader-elect); name names the log.
        With `pki` it serves as the chart runs it: HTTPS, and only callers with a client
        certificate of the PKI's CA reach the verbs; without, plain HTTP with --insecure."""
        self.cp = cp
        self.pki = pki
        self.port, self.metrics_port = (port, free_ports(1)[0]) if port else free_ports(2)
        self.url = f"{'https' if pki else 'http'}://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}"
        self._ssl = pki.client_context(check_hostname=check_hostname) if pki else None
        if pki:
            tls = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)]
            extra_args = [*extra_args, *tls, "--client-ca", str(pki.ca)]
        else:
            extra_args = [*extra_args, "--insecure"]
        for scheduler in scheduler_names:
            extra_args = [*extra_args, "--scheduler-name", scheduler]
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
                "--metrics-port",
                str(self.metrics_port),
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
            with urllib.request.urlopen(self.metrics_url + "/readyz", timeout=2) as response:
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
        """One probe as kubelet sends it: the metrics port, no client certificate."""
        start = time.perf_counter()
        with urllib.request.urlopen(self.metrics_url + "/healthz", timeout=30) as answer:
            answer.read()
        return time.perf_counter() - start

    def metrics(self) -> str:
        with urllib.request.urlopen(self.metrics_url + "/metrics", timeout=5) as response:
            return str(response.read().decode())

    def metric(self, name: str) -> float:
        """Sum of every sample whose line starts with `name` (name plus labels, if given)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total


def install_claims_crd(cp: ControlPlane, timeout: float = 60.0) -> None:
    """The chart's UltraServerClaim CRD, once per control plane, established."""
    install_crds(cp, [yaml.safe_load(CLAIM_CRD.read_text())], timeout)


def install_crds(cp: ControlPlane, crds: list[dict[str, Any]], timeout: float = 60.0) -> None:
    """These CRDs, established (one there already, from another Stack on this control plane,
    stays)."""
    for crd in crds:
        try:
            cp.request("POST", CRDS, crd)
        except KubeError as error:
            if error.status != 409:
                raise
    deadline = time.monotonic() + timeout
    for crd in crds:
        while True:
            found = cp.request("GET", f"{CRDS}/{crd['metadata']['name']}")
            conditions = (found.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {crd['metadata']['name']} not established: {conditions}")
            time.sleep(0.1)


def start_profile(stack: Stack, scheduler_name: str, port: int) -> Scheduler:
    """One more kube-scheduler, serving `scheduler_name` with the extender that a test starts on
    `port` (as the chart configures it: HTTPS, the client certificate, nodeCacheCapable)."""
    return stack.cp.start_scheduler(
        config=scheduler_config(
            scheduler_name=scheduler_name,
            extender_url=f"https://127.0.0.1:{port}",
            node_cache_capable=True,
            pki=stack.pki,
        ),
        extra_args=("--v=2",),
    )


class Stack:
    """A control plane, the extender with least privilege, and a `my-scheduler` using it."""

    def __init__(
        self,
        cp: ControlPlane,
        extender_port: int | None = None,
        extender_args: Sequence[str] = (),
    ) -> None:
        """`extender_args`: more options for the `extender` command (e.g. --wake-rate)."""
        self.cp = cp
        if not RULES.exists():
            raise FileNotFoundError(
                f"{RULES} not found: the testbed runs from a repository checkout"
            )
        install_claims_crd(cp)
        rules = [
            *yaml.safe_load(RULES.read_text()),
            *yaml.safe_load(PREEMPTION_RULES.read_text()),
            *yaml.safe_load(CONSOLIDATION_RULES.read_text()),
            *yaml.safe_load(CAPACITY_RULES.read_text()),
            *yaml.safe_load(DRA_SCORING_RULES.read_text()),
            *yaml.safe_load(KUEUE_RULES.read_text()),
        ]
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
        self._budget_role(cp)
        self._capacity_role(cp)
        self._policies(cp, EXTENDER_USER)
        self.extender_token = credentials.token
        self.extender_kubeconfig = (
            credentials.kubeconfig_path
        )  # least privilege, for more extenders
        # As the chart installs it: my-scheduler presents a client certificate, nobody else can.
        self.pki = Pki.create(cp.workdir / "extender-pki")
        self.extender = ExtenderProcess(
            cp, credentials.kubeconfig_path, extender_port, pki=self.pki, extra_args=extender_args
        )
        self.extender.start()
        self.scheduler: Scheduler | None = None
        self.extra_logs: dict[str, Path] = {}  # more components' logs, for a failed test
        self.node_cache_capable = True
        self.preemption = True
        self._scheduler_setup: tuple[bool, bool, Profile, bool] | None = None

    @staticmethod
    def _budget_role(cp: ControlPlane) -> None:
        rbac = "/apis/rbac.authorization.k8s.io/v1/namespaces/kube-system"
        leases = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"]}
        cp.request(
            "POST",
            f"{rbac}/roles",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": f"{ROLE}-consolidation"},
                "rules": [
                    {**leases, "verbs": ["create"]},
                    {**leases, "resourceNames": [BUDGET_LEASE], "verbs": ["get", "update"]},
                ],
            },
        )
        cp.request(
            "POST",
            f"{rbac}/rolebindings",
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": f"{ROLE}-consolidation"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": f"{ROLE}-consolidation",
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

    @staticmethod
    def _conditions(username: str) -> dict[str, str]:
        """Each policy's match condition, for the extender's ServiceAccount `username`, as the
        chart renders them (templates/extender-rbac.yaml)."""
        user = f"request.userInfo.username == {json.dumps(username)}"
        writers = json.dumps([username, DEVICE_PLUGIN_USER])
        pod_writes, plans, hand_off = POLICIES
        return {
            pod_writes: user,
            plans: f"!({user})",
            hand_off: (
                f"!(request.userInfo.username in {writers}) && "
                "!request.userInfo.?groups.orValue([]).exists(g, g in ['system:masters'])"
            ),
        }

    @staticmethod
    def _policies(cp: ControlPlane, username: str, only: Sequence[str] = POLICIES) -> None:
        """The chart's admission policies on pod writes (`only` these), for this
        ServiceAccount: every test that runs the extender runs it, and every pod write, under
        them."""
        conditions = Stack._conditions(username)
        files = dict(zip(POLICIES, (POD_WRITES, PLAN_WRITES, HAND_OFF_WRITES), strict=True))
        for name in only:
            spec = {
                "failurePolicy": "Fail",
                "matchConditions": [{"name": "who", "expression": conditions[name]}],
                **yaml.safe_load(files[name].read_text()),
            }
            cp.request(
                "POST",
                f"{ADMISSION}/validatingadmissionpolicies",
                {
                    "apiVersion": "admissionregistration.k8s.io/v1",
                    "kind": "ValidatingAdmissionPolicy",
                    "metadata": {"name": name},
                    "spec": spec,
                },
            )
            cp.request(
                "POST",
                f"{ADMISSION}/validatingadmissionpolicybindings",
                {
                    "apiVersion": "admissionregistration.k8s.io/v1",
                    "kind": "ValidatingAdmissionPolicyBinding",
                    "metadata": {"name": name},
                    "spec": {"policyName": name, "validationActions": ["Deny"]},
                },
            )

    @staticmethod
    def _lift(cp: ControlPlane, name: str) -> None:
        cp.request("DELETE", f"{ADMISSION}/validatingadmissionpolicybindings/{name}")
        cp.request("DELETE", f"{ADMISSION}/validatingadmissionpolicies/{name}")

    @contextlib.contextmanager
    def hand_off_policy_lifted(
        self, tenant: KubeClient, namespace: str, timeout: float = 60.0
    ) -> Iterator[None]:
        """Without the chart's policy on who writes the hand-off annotations, as on a cluster
        where it is absent or failed open (it fails open): what the extender's own checks of the
        ids pods carry must withstand. Put back afterwards. Each way waits until the API server
        acts so: `tenant` (a user who may create pods in `namespace`) is refused, or not, a
        dry-run pod carrying ids."""
        self._lift(self.cp, HAND_OFF_POLICY)
        try:
            self._wait_hand_off_policy(tenant, namespace, False, timeout)
            yield
        finally:
            self._policies(self.cp, EXTENDER_USER, only=(HAND_OFF_POLICY,))
            self._wait_hand_off_policy(tenant, namespace, True, timeout)

    @staticmethod
    def _wait_hand_off_policy(tenant: KubeClient, namespace: str, on: bool, timeout: float) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "hand-off-probe", "annotations": {"AWS_NEURON_IDS": "0"}},
            "spec": {
                "schedulerName": "nobody",
                "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}],
            },
        }
        path = f"/api/v1/namespaces/{namespace}/pods?dryRun=All"
        Stack._until_admission(lambda: tenant.create(path, body), on, timeout, "hand-off policy")

    @staticmethod
    def _until_admission(write: Callable[[], object], on: bool, timeout: float, what: str) -> None:
        """Until the dry-run `write` is refused (`on`: the policies it meets are in force) or
        admitted (lifted): the API server acts on a policy's change a moment after it is made."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                write()
                refused = False
            except KubeError as error:
                if error.status != 403:
                    raise
                refused = True
            if refused == on:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not {'in force' if on else 'lifted'}")
            time.sleep(0.2)

    def enforce_policies(self, on: bool, timeout: float = 60.0) -> None:
        """Puts the chart's admission policies on pod writes in force, or lifts them
        (bench/throughput.py prices them), and returns once the API server acts so: a dry-run
        patch of a foreign annotation by the extender's ServiceAccount is refused, or admitted."""
        if on:
            self._policies(self.cp, EXTENDER_USER)
        else:
            for name in POLICIES:
                self._lift(self.cp, name)
        probe = "policy-probe"
        path = f"/api/v1/namespaces/kube-system/pods/{probe}"
        with contextlib.suppress(KubeError):  # (there already)
            self.cp.request(
                "POST",
                "/api/v1/namespaces/kube-system/pods",
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": probe},
                    "spec": {
                        "schedulerName": "nobody",
                        "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10"}],
                    },
                },
            )
        as_extender = KubeClient(self.cp.server_url, self.extender_token, cafile=self.cp.ca_path)
        foreign = {"metadata": {"annotations": {"policy-probe": str(time.time_ns())}}}
        self._until_admission(
            lambda: as_extender.request(
                "PATCH", path + "?dryRun=All", foreign, "application/merge-patch+json"
            ),
            on,
            timeout,
            "admission policies",
        )

    @staticmethod
    def _capacity_role(cp: ControlPlane) -> None:
        """What the chart renders with capacity requests on: a Role in the extender's namespace
        for the placeholders, and their PriorityClass."""
        rules: list[dict[str, Any]] = [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "delete"]},
            {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
        ]
        cp.grant("kube-system", f"{ROLE}-capacity-requests", rules, "neuron-scheduler")
        with contextlib.suppress(KubeError):  # (there already: another Stack's)
            cp.request(
                "POST",
                "/apis/scheduling.k8s.io/v1/priorityclasses",
                {
                    "apiVersion": "scheduling.k8s.io/v1",
                    "kind": "PriorityClass",
                    "metadata": {"name": PLACEHOLDER_PRIORITY_CLASS},
                    "value": -10,
                    "preemptionPolicy": "Never",
                },
            )

    def use_scheduler(
        self,
        node_cache_capable: bool,
        preemption: bool = True,
        profile: Profile = CHART,
        dra_prioritize: bool = False,
    ) -> Scheduler:
        """(Re)start `my-scheduler` with the extender in the given node mode, with or without
        the preempt verb, scoring as `profile` says (the chart's by default), with or without
        the DRA scoring entry."""
        wanted = (node_cache_capable, preemption, profile, dra_prioritize)
        if self.scheduler is not None and self._scheduler_setup == wanted:
            return self.scheduler
        if self.scheduler is not None:
            self.scheduler.stop()
        self._scheduler_setup = wanted
        self.node_cache_capable, self.preemption = node_cache_capable, preemption
        config = scheduler_config(
            extender_url=self.extender.url,
            node_cache_capable=node_cache_capable,
            preemption=preemption,
            pki=self.pki,
            profile=profile,
            dra_prioritize=dra_prioritize,
        )
        self.scheduler = self.cp.start_scheduler(config=config)
        return self.scheduler

    def logs(self) -> dict[str, Path]:
        return {
            **self.cp.log_paths,
            "extender": self.extender.process.log_path,
            **self.extra_logs,
        }

    def stop(self) -> None:
        self.extender.process.stop()
