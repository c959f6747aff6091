"""`neuron-scheduler ultraserver-init` on the real path: a real sshd as the workers (sysfs files
and /etc/environment in each worker's login directory), and the real kube-apiserver for the
node-labels source."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from neuron_scheduler.ultraserver.launcher import environment
from tests import ultraserver_seed as seed
from tests.builders import node_json
from tests.e2e.harness import remove_pods_and_nodes
from tests.e2e.ultraserver_sshd import ENVIRONMENT, SYSFS, FakeWorker, FakeWorkers
from tests.testbed import ControlPlane, KubeError

pytestmark = pytest.mark.e2e
KEPT = 'PATH="/usr/local/bin:/usr/bin:/bin"\nNEURON_GLOBAL_TOPOID=99\nLANG=C.UTF-8\n'


@contextlib.contextmanager
def workers(specs: list[FakeWorker], unreachable: Sequence[str] = ()) -> Iterator[FakeWorkers]:
    fake = FakeWorkers(specs, unreachable)
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


def seed_workers(mode: str = "1,2,4", sysfs: bool = True) -> list[FakeWorker]:
    return [
        FakeWorker(
            seed.host(pod),
            f"{pod}.demo.default.svc.cluster.local",
            seed.sysfs(pod, mode) if sysfs else None,
            environment=KEPT,
        )
        for pod in seed.PODS
    ]


def init(
    fake: FakeWorkers,
    tmp: Path,
    hosts: list[str],
    config: str | None,
    *extra: str,
) -> subprocess.CompletedProcess[str]:
    hostfile = tmp / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in hosts))
    env = dict(os.environ)
    env.pop("NEURON_ULTRASERVER_NODE_CONFIG", None)
    if config is not None:
        env["NEURON_ULTRASERVER_NODE_CONFIG"] = config
    return subprocess.run(
        [
            *(sys.executable, "-m", "neuron_scheduler", "ultraserver-init"),
            *("--hostfile", str(hostfile), "--out-dir", str(tmp / "out")),
            *("--ssh", fake.ssh_command, "--sysfs-dir", SYSFS, "--environment-file", ENVIRONMENT),
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


def written(fake: FakeWorkers, pod: str) -> dict[str, str]:
    return environment.parse(fake.workers[seed.host(pod)].env_file().read_text())


def check_success(
    fake: FakeWorkers, tmp: Path, result: subprocess.CompletedProcess[str], config: int
) -> None:
    assert result.returncode == 0, f"{result.stderr}\n{fake.log()}"
    order = {4: seed.ORDER_4, 2: seed.ORDER_2, 1: seed.ORDER_1}[config]
    lines = result.stdout.splitlines()
    assert lines[0] == f"Using {config}-node config"
    table = [line.split() for line in lines if line.split()[:1] and line.split()[0].isdigit()]
    assert [row[0] for row in table] == ["0", "1", "2", "3"]
    assert [row[1] for row in table] == [seed.host(p) for p in order]
    leader = f"{order[0]}.demo.default.svc.cluster.local"  # what `hostname --fqdn` said
    mode = {4: "1", 2: "2", 1: "4"}[config]
    for topo_id, pod in enumerate(order):
        values = written(fake, pod)
        s2, n2, s4, n4 = seed.NODES[seed.PODS[pod]]
        server, node = {4: (s4, n4), 2: (s2, n2), 1: ("0" * 16, -1)}[config]
        assert values == {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "NEURON_GLOBAL_TOPOID": str(topo_id),
            "NEURON_GLOBAL_TOPOID0_HOST": leader,
            "NEURON_RT_ULTRASERVER_MODE": mode,
            "NEURON_RT_ULTRASERVER_SERVER_ID": server,
            "NEURON_RT_ULTRASERVER_NODE_ID": str(node),
        }
        text = fake.workers[seed.host(pod)].env_file().read_text()
        assert text.count("NEURON_GLOBAL_TOPOID=") == 1
    assert (tmp / "out" / "new_hostfile").read_text() == "".join(
        f"{seed.host(p)} slots=1\n" for p in order
    )


@pytest.mark.parametrize("config", [4, 2, 1])
def test_seed_example_over_ssh(tmp_path: Path, config: int) -> None:
    with workers(seed_workers()) as fake:
        hosts = [seed.host(p) for p in seed.PODS]
        check_success(fake, tmp_path, init(fake, tmp_path, hosts, str(config)), config)
        # Again: entries are replaced, not added.
        check_success(fake, tmp_path, init(fake, tmp_path, hosts, str(config)), config)


def test_default_config_is_4(tmp_path: Path) -> None:
    with workers(seed_workers()) as fake:
        hosts = [seed.host(p) for p in seed.PODS]
        check_success(fake, tmp_path, init(fake, tmp_path, hosts, None), 4)


def assert_failed(
    fake: FakeWorkers, result: subprocess.CompletedProcess[str], expected: list[str], code: int = 1
) -> None:
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [f"error: {line}" for line in expected]
    for worker in fake.workers.values():  # nothing was written anywhere
        assert worker.env_file().read_text() == KEPT


def test_worker_not_up(tmp_path: Path) -> None:
    specs = seed_workers()
    missing = specs.pop()  # demo-worker-3: no sshd answers for it
    with workers(specs, unreachable=[missing.host]) as fake:
        result = init(fake, tmp_path, [seed.host(p) for p in seed.PODS], "4")
        assert result.returncode == 1
        (line,) = result.stderr.splitlines()
        assert line.startswith(
            f"error: worker {missing.host} (node unknown): cannot reach it over ssh: "
        ), line
        assert "Connection refused" in line
        assert_failed(fake, result, [line.removeprefix("error: ")])
        assert not (tmp_path / "out" / "new_hostfile").exists()


def test_mixed_server_ids(tmp_path: Path) -> None:
    specs = seed_workers()
    assert specs[3].sysfs is not None
    specs[3].sysfs["server_id_4"] = "00000000deadbeef"
    with workers(specs) as fake:
        result = init(fake, tmp_path, [seed.host(p) for p in seed.PODS], "4")
        assert_failed(
            fake,
            result,
            [
                f"worker {specs[3].host} (node unknown): neuron.amazonaws.com/ultraserver-"
                f"server-id-4 00000000deadbeef differs from the other 3 workers ({seed.S4}); "
                "config 4 needs all 4 in one UltraServer"
            ],
        )


def test_six_workers_with_config_4(tmp_path: Path) -> None:
    specs = seed_workers()
    for i in (4, 5):
        sysfs = {**seed.sysfs("demo-worker-0"), "server_id_4": "00000000000000aa"}
        specs.append(
            FakeWorker(f"demo-worker-{i}.demo.default.svc", f"w{i}", sysfs, environment=KEPT)
        )
    with workers(specs) as fake:
        result = init(fake, tmp_path, [s.host for s in specs], "4")
        assert_failed(
            fake,
            result,
            [
                "6 workers do not split into UltraServer units of 4 "
                "(NEURON_ULTRASERVER_NODE_CONFIG=4 needs a multiple of 4 workers)"
            ],
        )


def test_config_3(tmp_path: Path) -> None:
    with workers(seed_workers()) as fake:
        result = init(fake, tmp_path, [seed.host(p) for p in seed.PODS], "3")
        assert_failed(
            fake,
            result,
            [
                "NEURON_ULTRASERVER_NODE_CONFIG='3' is not a valid UltraServer node config; "
                "valid values are 4, 2 and 1"
            ],
            code=2,
        )


def test_busy_ultraserver_over_ssh(tmp_path: Path) -> None:
    with workers(seed_workers(mode="busy")) as fake:
        result = init(fake, tmp_path, [seed.host(p) for p in seed.PODS], "4")
        assert result.returncode == 1
        assert len(result.stderr.splitlines()) == 4
        assert "sys/class/neuron_device/ultraserver_mode says 'busy'" in result.stderr


# --- node labels through the API server --------------------------------------------------------


class LabelledCluster:
    """The seed's four trn2u nodes (labelled) and worker pods bound to them, in a namespace."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.id = uuid.uuid4().hex[:6]
        self.namespace = f"us-{self.id}"
        cp.client.ensure_namespace(self.namespace)
        self.nodes: list[str] = []

    def node(self, name: str, labels: dict[str, str]) -> str:
        name = f"{name.split('.')[0]}-{self.id}"
        body = node_json(name, "trn2u.48xlarge", labels=labels)
        self.cp.request("POST", "/api/v1/nodes", body)
        self.nodes.append(name)
        return name

    def pod(self, name: str, node: str | None) -> None:
        spec: dict[str, object] = {"containers": [{"name": "c", "image": "x"}]}
        if node:
            spec["nodeName"] = node
        labels = {"training.kubeflow.org/job-name": "demo", "training.kubeflow.org/job-role": "w"}
        self.cp.request(
            "POST",
            f"/api/v1/namespaces/{self.namespace}/pods",
            {"metadata": {"name": name, "labels": labels}, "spec": spec},
        )

    def seed(self) -> dict[str, str]:
        """The seed's nodes, labelled, with its worker pods bound to them: node name by the
        seed's name for it."""
        nodes = {name: self.node(name, seed.labels(name)) for name in seed.NODES}
        for pod, node in seed.PODS.items():
            self.pod(pod, nodes[node])
        return nodes

    def host(self, pod: str) -> str:
        return seed.host(pod, self.namespace)

    def launcher_kubeconfig(self, nodes: bool = True) -> Path:
        """A launcher's ServiceAccount with what docs/training-jobs.md says it needs and nothing
        more: `get` on pods in its namespace (a Role) and, unless `nodes` is False, on nodes (a
        ClusterRole)."""
        rbac = "/apis/rbac.authorization.k8s.io/v1"
        credentials = self.cp.service_account(self.namespace, "launcher")
        subject = [{"kind": "ServiceAccount", "name": "launcher", "namespace": self.namespace}]
        self.cp.request(
            "POST",
            f"{rbac}/namespaces/{self.namespace}/roles",
            {
                "metadata": {"name": "launcher"},
                "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
            },
        )
        self.cp.request(
            "POST",
            f"{rbac}/namespaces/{self.namespace}/rolebindings",
            {
                "metadata": {"name": "launcher"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "Role",
                    "name": "launcher",
                },
                "subjects": subject,
            },
        )
        if not nodes:
            return credentials.kubeconfig_path
        self.cp.request(
            "POST",
            f"{rbac}/clusterroles",
            {
                "metadata": {"name": self.cluster_role},
                "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}],
            },
        )
        self.cp.request(
            "POST",
            f"{rbac}/clusterrolebindings",
            {
                "metadata": {"name": self.cluster_role},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": self.cluster_role,
                },
                "subjects": subject,
            },
        )
        return credentials.kubeconfig_path

    @property
    def cluster_role(self) -> str:
        return f"ultraserver-launcher-{self.id}"

    def cleanup(self) -> None:
        remove_pods_and_nodes(self.cp, self.namespace, self.nodes)
        rbac = "/apis/rbac.authorization.k8s.io/v1"
        for kind in ("clusterrolebindings", "clusterroles"):
            try:
                self.cp.request("DELETE", f"{rbac}/{kind}/{self.cluster_role}")
            except KubeError as error:
                if error.status != 404:  # not made by every test
                    raise


@pytest.fixture
def labelled(control_plane: ControlPlane) -> Iterator[LabelledCluster]:
    cluster = LabelledCluster(control_plane)
    yield cluster
    cluster.cleanup()


def kube_workers(cluster: LabelledCluster) -> list[FakeWorker]:
    # No sysfs files: only the labels can tell the init step anything.
    return [
        FakeWorker(cluster.host(pod), f"{pod}.fqdn", None, environment=KEPT) for pod in seed.PODS
    ]


def test_seed_example_from_node_labels(tmp_path: Path, labelled: LabelledCluster) -> None:
    nodes = labelled.seed()
    with workers(kube_workers(labelled)) as fake:
        hosts = [labelled.host(p) for p in seed.PODS]
        args = ("--source", "kube", "--kubeconfig", str(labelled.launcher_kubeconfig()))
        result = init(fake, tmp_path, hosts, "4", *args)
        assert result.returncode == 0, result.stderr
        table = [line.split() for line in result.stdout.splitlines() if line[:1].isdigit()]
        assert [row[1] for row in table] == [labelled.host(p) for p in seed.ORDER_4]
        assert [row[3] for row in table] == [nodes[seed.PODS[p]] for p in seed.ORDER_4]
        for topo_id, pod in enumerate(seed.ORDER_4):
            values = environment.parse(fake.workers[labelled.host(pod)].env_file().read_text())
            assert values["NEURON_GLOBAL_TOPOID"] == str(topo_id)
            assert values["NEURON_GLOBAL_TOPOID0_HOST"] == labelled.host(seed.ORDER_4[0])
            assert values["NEURON_RT_ULTRASERVER_SERVER_ID"] == seed.S4
            assert values["NEURON_RT_ULTRASERVER_NODE_ID"] == str(topo_id)
            assert values["LANG"] == "C.UTF-8"
        result = init(fake, tmp_path, hosts, "2", *args)
        assert result.returncode == 0, result.stderr
        values = environment.parse(
            fake.workers[labelled.host("demo-worker-0")].env_file().read_text()
        )
        assert values["NEURON_GLOBAL_TOPOID"] == "2"
        assert values["NEURON_RT_ULTRASERVER_SERVER_ID"] == seed.S2_B
        assert values["NEURON_RT_ULTRASERVER_MODE"] == "2"


def test_kube_source_without_get_on_nodes_says_so_per_worker(
    tmp_path: Path, labelled: LabelledCluster
) -> None:
    # docs/training-jobs.md: the launcher needs get on nodes; without it, each worker's line says
    # which permission is missing, and nothing is written.
    nodes = labelled.seed()
    with workers(kube_workers(labelled)) as fake:
        hosts = [labelled.host(p) for p in seed.PODS]
        kubeconfig = labelled.launcher_kubeconfig(nodes=False)
        result = init(
            fake, tmp_path, hosts, "4", "--source", "kube", "--kubeconfig", str(kubeconfig)
        )
        ns = labelled.namespace
        account = f'User "system:serviceaccount:{ns}:launcher" cannot get resource "nodes"'
        assert_failed(
            fake,
            result,
            [
                f"worker {labelled.host(pod)} (node {nodes[node]}): cannot read the node: "
                f'nodes "{nodes[node]}" is forbidden: {account} in API group "" at the cluster '
                "scope"
                for pod, node in seed.PODS.items()
            ],
        )


def test_unscheduled_worker_and_plain_node_from_labels(
    tmp_path: Path, labelled: LabelledCluster
) -> None:
    nodes = {name: labelled.node(name, seed.labels(name)) for name in list(seed.NODES)[:2]}
    plain = labelled.node("plain-trn2u", {})
    labelled.pod("demo-worker-0", nodes[seed.PODS["demo-worker-1"]])
    labelled.pod("demo-worker-1", nodes[seed.PODS["demo-worker-2"]])
    labelled.pod("demo-worker-2", plain)
    labelled.pod("demo-worker-3", None)  # not scheduled
    with workers(kube_workers(labelled)) as fake:
        hosts = [labelled.host(p) for p in seed.PODS]
        args = ("--source", "kube", "--kubeconfig", str(labelled.launcher_kubeconfig()))
        result = init(fake, tmp_path, hosts, "4", *args)
        ns = labelled.namespace
        assert_failed(
            fake,
            result,
            [
                f"worker {labelled.host('demo-worker-2')} (node {plain}): not an UltraServer node "
                "(no neuron.amazonaws.com/ultraserver-mode label)",
                f"worker {labelled.host('demo-worker-3')} (node unknown): pod "
                f"{ns}/demo-worker-3 is not scheduled to a node",
            ],
        )


def test_ssh_source_names_the_nodes_when_the_api_is_there(
    tmp_path: Path, labelled: LabelledCluster
) -> None:
    nodes = labelled.seed()
    specs = [
        FakeWorker(labelled.host(pod), f"{pod}.fqdn", seed.sysfs(pod, "1,2,4"), environment=KEPT)
        for pod in seed.PODS
    ]
    odd = list(seed.PODS)[3]
    assert specs[3].sysfs is not None
    specs[3].sysfs["server_id_4"] = "00000000deadbeef"
    with workers(specs) as fake:
        hosts = [labelled.host(p) for p in seed.PODS]
        args = ("--kubeconfig", str(labelled.launcher_kubeconfig()))  # --source ssh, the default
        result = init(fake, tmp_path, hosts, "4", *args)
        assert_failed(
            fake,
            result,
            [
                f"worker {labelled.host(odd)} (node {nodes[seed.PODS[odd]]}): "
                "neuron.amazonaws.com/ultraserver-server-id-4 00000000deadbeef differs from the "
                f"other 3 workers ({seed.S4}); config 4 needs all 4 in one UltraServer"
            ],
        )
