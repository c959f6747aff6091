"""UltraServer pure logic: config, topology order and checks, files, affinity, placement rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from neuron_scheduler.cli import app
from neuron_scheduler.jobs.units import NodeConfigError, parse_node_config
from neuron_scheduler.kube.objects import Node, ObjectMeta
from neuron_scheduler.ultraserver import affinity
from neuron_scheduler.ultraserver.labels import parse_modes, runtime_mode
from neuron_scheduler.ultraserver.launcher import environment, hostfile
from neuron_scheduler.ultraserver.launcher.nodes import from_labels, pod_of
from neuron_scheduler.ultraserver.launcher.ranking import UnitError, WorkerInfo, order, summary
from neuron_scheduler.ultraserver.launcher.ssh import gather_script, parse_gathered
from tests import ultraserver_seed as seed


def seed_workers(config: int, modes: str = "1_2_4") -> list[WorkerInfo]:
    workers = []
    for pod, node in seed.PODS.items():
        labels = {**seed.labels(node), "neuron.amazonaws.com/ultraserver-mode": modes}
        workers.append(
            from_labels(seed.host(pod), Node(metadata=ObjectMeta(name=node, labels=labels)), config)
        )
    return workers


def pods_in_order(placed: list) -> list[str]:  # type: ignore[type-arg]
    return [p.info.worker.split(".")[0] for p in placed]


# --- config -------------------------------------------------------------------------------------


def test_node_config_values() -> None:
    assert parse_node_config(None) == 4
    assert parse_node_config("") == 4
    assert [parse_node_config(v) for v in ("4", "2", "1", ' "2" ')] == [4, 2, 1, 2]
    with pytest.raises(NodeConfigError, match="valid values are 4, 2 and 1") as error:
        parse_node_config("3")
    assert "NEURON_ULTRASERVER_NODE_CONFIG='3'" in str(error.value)
    with pytest.raises(NodeConfigError):
        parse_node_config("four")


def test_modes_and_runtime_mode() -> None:
    assert parse_modes("1,2,4") == frozenset({1, 2, 4})
    assert parse_modes("1_2_4") == frozenset({1, 2, 4})
    assert parse_modes("busy") is None
    assert runtime_mode(4, {1, 2, 4}) == 1
    assert runtime_mode(2, {1, 2, 4}) == 2  # X2H: no vertical links
    assert runtime_mode(2, {1, 2, 3, 4}) == 3  # X2V when supported
    assert runtime_mode(1, {1, 2, 4}) == 4


# --- topology order -----------------------------------------------------------------------------


def test_seed_example_config_4() -> None:
    placed = order(seed_workers(4), 4)
    assert pods_in_order(placed) == seed.ORDER_4
    assert [p.topo_id for p in placed] == [0, 1, 2, 3]
    assert [p.info.node_id for p in placed] == [0, 1, 2, 3]
    leader = placed[0].info.fqdn
    assert leader == seed.host("demo-worker-1")
    env = placed[2].environment(leader)
    assert env == {
        "NEURON_GLOBAL_TOPOID": "2",
        "NEURON_GLOBAL_TOPOID0_HOST": seed.host("demo-worker-1"),
        "NEURON_RT_ULTRASERVER_MODE": "1",
        "NEURON_RT_ULTRASERVER_SERVER_ID": seed.S4,
        "NEURON_RT_ULTRASERVER_NODE_ID": "2",
    }
    lines = summary(placed, 4)
    assert lines[0] == "Using 4-node config"
    assert len(lines) == 2 + 4
    assert lines[2].split()[:2] == ["0", seed.host("demo-worker-1")]


def test_seed_example_config_2() -> None:
    placed = order(seed_workers(2), 2)
    assert pods_in_order(placed) == seed.ORDER_2
    assert [(p.info.server_id, p.info.node_id) for p in placed] == [
        (seed.S2_A, 0),
        (seed.S2_A, 1),
        (seed.S2_B, 0),
        (seed.S2_B, 1),
    ]
    assert {p.mode for p in placed} == {2}
    assert {p.mode for p in order(seed_workers(2, "1_2_3_4"), 2)} == {3}


def test_seed_example_config_1() -> None:
    placed = order(seed_workers(1), 1)
    assert pods_in_order(placed) == seed.ORDER_1
    assert {(p.info.server_id, p.info.node_id, p.mode) for p in placed} == {
        ("0000000000000000", -1, 4)
    }


def test_mixed_server_ids_name_the_odd_worker() -> None:
    workers = seed_workers(4)
    odd = workers[3]
    workers[3] = WorkerInfo(odd.worker, odd.fqdn, odd.node, odd.modes, "0123456789abcdef", 3)
    with pytest.raises(UnitError) as error:
        order(workers, 4)
    assert error.value.problems == [
        f"worker {odd.worker} (node {odd.node}): neuron.amazonaws.com/ultraserver-server-id-4 "
        f"0123456789abcdef differs from the other 3 workers ({seed.S4}); config 4 needs all 4 "
        "in one UltraServer"
    ]


def test_six_workers_with_config_4() -> None:
    workers = seed_workers(4)
    extra = [
        WorkerInfo(f"w{i}", f"w{i}", f"n{i}", frozenset({1, 2, 4}), "ab" * 8, i) for i in (4, 5)
    ]
    with pytest.raises(UnitError, match="6 workers do not split into UltraServer units of 4"):
        order(workers + extra, 4)


def test_unset_server_id_duplicate_node_id_and_unscheduled() -> None:
    workers = seed_workers(2)
    w = workers[0]
    workers[0] = WorkerInfo(w.worker, w.fqdn, w.node, w.modes)  # all-zero default id
    with pytest.raises(UnitError) as error:
        order(workers, 2)
    assert any("is unset (0000000000000000)" in p for p in error.value.problems)
    workers = seed_workers(4)
    w = workers[0]
    workers[0] = WorkerInfo(w.worker, w.fqdn, w.node, w.modes, w.server_id, 0)
    with pytest.raises(UnitError, match=r"node-id-4 0 in UltraServer \w+ is reported by 2"):
        order(workers, 4)
    workers = seed_workers(4)
    workers[2] = WorkerInfo("demo-worker-3", "x", None, None, problem="pod d/x is not scheduled")
    with pytest.raises(UnitError) as error:
        order(workers, 4)
    assert error.value.problems == ["worker demo-worker-3 (node unknown): pod d/x is not scheduled"]


def test_not_an_ultraserver_node() -> None:
    node = Node(metadata=ObjectMeta(name="trn2-plain", labels={}))
    info = from_labels("w0", node, 4)
    assert info.problem == (
        "not an UltraServer node (no neuron.amazonaws.com/ultraserver-mode label)"
    )


# --- sources' parsing ---------------------------------------------------------------------------


def test_ssh_gather_parsing() -> None:
    script = gather_script("/sys/class/neuron_device", 4)
    assert "server_id_4" in script and "node_id_4" in script and "hostname --fqdn" in script
    info = parse_gathered(
        "h0",
        "fqdn=h0.example\nultraserver_mode=1,2,4\nserver_id_4=00000000deadbeef\nnode_id_4=2\n",
        "/sys/class/neuron_device",
        4,
    )
    assert (info.fqdn, info.modes, info.server_id, info.node_id, info.problem) == (
        "h0.example",
        frozenset({1, 2, 4}),
        "00000000deadbeef",
        2,
        None,
    )
    busy = parse_gathered("h1", "fqdn=h1\nultraserver_mode=busy\n", "/s", 4)
    assert busy.problem == "/s/ultraserver_mode says 'busy': the UltraServer is not available"
    missing = parse_gathered("h2", "fqdn=h2\n", "/s", 2)
    assert missing.problem is not None and "no /s/ultraserver_mode" in missing.problem
    assert missing.server_id == "0000000000000000" and missing.node_id == -1


def test_pod_of_hostfile_names() -> None:
    assert pod_of("demo-worker-0.demo.team-a.svc", "default") == ("team-a", "demo-worker-0")
    assert pod_of("demo-worker-0", "ns") == ("ns", "demo-worker-0")


# --- files --------------------------------------------------------------------------------------


def test_environment_update_replaces_ours_and_keeps_the_rest() -> None:
    before = 'PATH="/usr/bin"\nNEURON_GLOBAL_TOPOID=7\nexport NEURON_RT_ULTRASERVER_MODE=4\nFOO=1\n'
    values = {"NEURON_GLOBAL_TOPOID": "0", "NEURON_RT_ULTRASERVER_MODE": "1"}
    after = environment.update(before, values)
    assert after == 'PATH="/usr/bin"\nFOO=1\nNEURON_GLOBAL_TOPOID=0\nNEURON_RT_ULTRASERVER_MODE=1\n'
    assert environment.update(after, values) == after  # idempotent
    assert environment.parse(after)["PATH"] == "/usr/bin"


def test_hostfile_parse_and_reorder() -> None:
    lines = hostfile.parse("# workers\na.svc slots=1\n\nb.svc slots=1\nc.svc\n")
    assert [h.host for h in lines] == ["a.svc", "b.svc", "c.svc"]
    assert hostfile.reorder(lines, ["c.svc", "a.svc", "b.svc"]) == (
        "c.svc\na.svc slots=1\nb.svc slots=1\n"
    )
    with pytest.raises(hostfile.HostfileError, match="listed again"):
        hostfile.parse("a\nb\na\n", "h")


# --- affinity -----------------------------------------------------------------------------------


def test_affinity_single_unit_is_required() -> None:
    out = affinity.worker_placement("demo", 4, 4)
    assert out["nodeSelector"] == {"node.kubernetes.io/instance-type": "trn2u.48xlarge"}
    anti = out["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "neuron.amazonaws.com/ultraserver-server-id-4"
    assert anti["labelSelector"]["matchExpressions"] == [
        {"key": "training.kubeflow.org/job-name", "operator": "NotIn", "values": ["demo"]}
    ]
    required = out["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required[0]["labelSelector"]["matchLabels"] == {
        "training.kubeflow.org/job-role": "worker",
        "training.kubeflow.org/job-name": "demo",
    }
    two = affinity.worker_placement("demo", 2, 2)
    assert two["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
        "topologyKey"
    ] == ("neuron.amazonaws.com/ultraserver-server-id-2")


def test_affinity_multi_unit_is_preferred_and_config_1_has_no_pod_affinity() -> None:
    out = affinity.worker_placement("big", 16, 4)
    preferred = out["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred[0]["weight"] == 100
    single = affinity.worker_placement("one", 3, 1)
    assert "podAffinity" not in single["affinity"]
    anti = single["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    with pytest.raises(NodeConfigError, match="6 does not split"):
        affinity.worker_placement("demo", 6, 4)
    with pytest.raises(NodeConfigError, match="DNS label"):
        affinity.worker_placement("Demo_Job", 4, 4)


def test_affinity_cli_prints_yaml_and_full_example() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["ultraserver-affinity", "--job-name", "demo", "--workers", "4"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout) == affinity.worker_placement("demo", 4, 4)
    # The template metadata's annotations, as a comment above the spec (they go elsewhere).
    shown = "\n".join(
        line.removeprefix("#   ") for line in result.stdout.splitlines() if line.startswith("#   ")
    )
    assert yaml.safe_load(shown) == {
        "metadata": {
            "annotations": {
                "neuron.amazonaws.com/ultraserver-node-config": "4",
                "neuron-scheduler.io/gang-size": "4",
            }
        }
    }
    full = runner.invoke(
        app,
        [
            *("ultraserver-affinity", "--job-name", "demo", "--workers", "8"),
            *("--node-config", "2", "--full-example"),
        ],
    )
    assert full.exit_code == 0, full.output
    assert "&id" not in full.stdout and "*id" not in full.stdout  # no anchors: plain to edit
    assert "- |" in full.stdout and "\\n" not in full.stdout  # the launcher's script as lines
    job = yaml.safe_load(full.stdout)
    assert job == affinity.mpijob("demo", 8, 2)  # the plain forms load back to the same document
    assert job["kind"] == "MPIJob"
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    init = launcher["initContainers"][1]
    assert init["command"] == ["neuron-scheduler", "ultraserver-init"]
    assert init["env"] == [{"name": "NEURON_ULTRASERVER_NODE_CONFIG", "value": "2"}]
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 8
    assert worker["template"]["metadata"]["annotations"] == {
        "neuron.amazonaws.com/ultraserver-node-config": "2",
        "neuron-scheduler.io/gang-size": "8",  # the extender reserves for all 8 at once
    }
    bad = runner.invoke(
        app, ["ultraserver-affinity", "--job-name", "demo", "--workers", "4", "--node-config", "3"]
    )
    assert bad.exit_code == 2
    assert "valid values are 4, 2 and 1" in bad.stderr
    assert "Traceback" not in bad.output


def test_init_cli_rejects_config_3_in_one_line() -> None:
    result = CliRunner().invoke(
        app, ["ultraserver-init"], env={"NEURON_ULTRASERVER_NODE_CONFIG": "3"}
    )
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: NEURON_ULTRASERVER_NODE_CONFIG='3' is not a valid UltraServer node config; "
        "valid values are 4, 2 and 1"
    ]


def test_init_cli_kubeconfig_that_does_not_exist(tmp_path: Path) -> None:
    # With --source ssh a kubeconfig that cannot be read was passed over in silence.
    result = CliRunner().invoke(
        app,
        ["ultraserver-init", "--kubeconfig", str(tmp_path / "nowhere"), "--out-dir", str(tmp_path)],
        env={"NEURON_ULTRASERVER_NODE_CONFIG": "4"},
    )
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --kubeconfig {tmp_path / 'nowhere'}: no such file"
    ]


def test_init_cli_hostfile_that_is_not_text(tmp_path: Path) -> None:
    hostfile_path = tmp_path / "hostfile"
    hostfile_path.write_bytes(b"\xff\xfe demo-worker-0 slots=1\n")
    result = CliRunner().invoke(
        app,
        ["ultraserver-init", "--hostfile", str(hostfile_path), "--out-dir", str(tmp_path)],
        env={"NEURON_ULTRASERVER_NODE_CONFIG": "4"},
    )
    assert result.exit_code != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: the hostfile {hostfile_path} is not UTF-8 text")
    assert "Traceback" not in result.output


def test_full_example_init_container_runs_as_root_for_ssh() -> None:
    job = affinity.mpijob("demo", 4, 4)
    launcher = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]
    assert launcher["initContainers"][1]["securityContext"]["runAsUser"] == 0
