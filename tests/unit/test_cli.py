"""The command line as a person uses it: real processes, stdout/stderr and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "neuron_scheduler", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def explain(*args: str) -> subprocess.CompletedProcess[str]:
    return run("explain", *args)


def test_explain_seed_example_json() -> None:
    r = explain(
        "--instance-type", "inf1.6xlarge", "--resource", "neuroncore", "--count", "9", "--json"
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"devices": [0, 1, 2], "cores": list(range(9))}


def test_explain_human_output() -> None:
    r = explain(
        "--instance-type",
        "inf2.48xlarge",
        "--resource",
        "neuron",
        "--count",
        "3",
        "--used-devices",
        "0-1",
    )
    assert r.returncode == 0
    assert "AWS_NEURON_IDS=2,3,4" in r.stdout


def test_explain_refusal_exits_1_with_reason() -> None:
    r = explain("--instance-type", "trn1.32xlarge", "--resource", "neuron", "--count", "7")
    assert r.returncode == 1
    assert r.stdout.strip() == (
        "Instance type trn1.32xlarge does not support requests for device: 7. "
        "Please request a different number of devices."
    )
    r = explain(
        "--instance-type",
        "trn1.32xlarge",
        "--resource",
        "neuron",
        "--count",
        "4",
        "--used-cores",
        "0,8,16,24",
        "--json",
    )
    assert r.returncode == 1
    assert "whole row" in json.loads(r.stdout)["error"]


def test_explain_used_cores_and_capacity() -> None:
    r = explain(
        "--instance-type",
        "trn2.48xlarge",
        "--resource",
        "neuroncore",
        "--count",
        "2",
        "--neuroncore-capacity",
        "128",
        "--used-cores",
        "0-5",
        "--json",
    )
    assert json.loads(r.stdout) == {"devices": [0], "cores": [6, 7]}


def test_explain_first_fit_policy() -> None:
    args = [
        "--instance-type",
        "inf2.48xlarge",
        "--resource",
        "neuron",
        "--count",
        "3",
        "--used-devices",
        "5,9,10,11",
        "--json",
    ]
    assert json.loads(explain(*args).stdout)["devices"] == [6, 7, 8]
    assert json.loads(explain(*args, "--policy", "first-fit").stdout)["devices"] == [0, 1, 2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--instance-type", "x9.big", "--resource", "neuron", "--count", "1"],
            "unknown instance type 'x9.big'",
        ),
        (
            ["--instance-type", "inf1.6xlarge", "--resource", "gpu", "--count", "1"],
            "unknown Neuron resource 'gpu'",
        ),
        (
            ["--instance-type", "inf1.6xlarge", "--resource", "neuron", "--count", "0"],
            "count must be at least 1",
        ),
        (
            ["--instance-type", "inf1.6xlarge", "--resource", "neuron", "--count", "-3"],
            "count must be at least 1",
        ),
        (
            ["--instance-type", "inf1.6xlarge", "--resource", "neuron", "--count", "5"],
            "more than inf1.6xlarge has (4 devices)",
        ),
        (
            [
                "--instance-type",
                "inf1.6xlarge",
                "--resource",
                "neuron",
                "--count",
                "1",
                "--used-devices",
                "9",
            ],
            "devices 9 do not exist",
        ),
        (
            [
                "--instance-type",
                "inf1.6xlarge",
                "--resource",
                "neuron",
                "--count",
                "1",
                "--used-cores",
                "x",
            ],
            "expected ids like",
        ),
    ],
)
def test_explain_bad_input_is_one_line_on_stderr(args: list[str], message: str) -> None:
    r = explain(*args)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert len(r.stderr.strip().splitlines()) == 1


def test_explain_with_topology_file(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(
        "instance_types:\n  lab.ring8: {devices: 8, cores_per_device: 2, topology: ring}\n"
    )
    r = explain(
        "--instance-type",
        "lab.ring8",
        "--resource",
        "neuron",
        "--count",
        "3",
        "--used-devices",
        "2-6",
        "--topology-file",
        str(path),
        "--json",
    )
    assert json.loads(r.stdout)["devices"] == [7, 0, 1]


def test_malformed_topology_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("instance_types: {a: [")
    r = explain(
        "--instance-type",
        "inf1.6xlarge",
        "--resource",
        "neuron",
        "--count",
        "1",
        "--topology-file",
        str(path),
    )
    assert r.returncode == 2 and "not valid YAML" in r.stderr and "Traceback" not in r.stderr


def test_simulate_writes_report(tmp_path: Path) -> None:
    r = run("simulate", "--report", str(tmp_path / "report"))
    assert r.returncode == 0, r.stderr
    assert "placed" in r.stdout and "fragmentation" in r.stdout
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["arrivals"] == 600
    assert summary["placed"] > 0
    assert (tmp_path / "report" / "device-maps.png").stat().st_size > 10_000
    assert (tmp_path / "report" / "utilization.png").exists()
    assert len(list((tmp_path / "report" / "nodes").glob("*.png"))) == summary["nodes"]


def test_simulate_compare_and_files(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(
        "nodes:\n  - {instance_type: inf2.48xlarge, count: 2}\n"
        "  - {instance_type: trn2.48xlarge, count: 1, neuroncore_capacity: 128}\n"
    )
    (tmp_path / "load.yaml").write_text(
        "pods:\n"
        "  - {name: a, resource: neuron, count: 3, arrive: 0}\n"
        "  - {name: b, resource: neuron, count: 7, arrive: 1, duration: 5}\n"
        "  - {name: c, resource: neuroncore, count: 8, arrive: 2}\n"
    )
    r = run(
        "simulate",
        "--cluster",
        str(tmp_path / "fleet.yaml"),
        "--workload",
        str(tmp_path / "load.yaml"),
        "--compare",
        "--report",
        str(tmp_path / "out"),
    )
    assert r.returncode == 0, r.stderr
    assert "neuron-scheduler" in r.stdout and "first-fit" in r.stdout
    runs = json.loads((tmp_path / "out" / "compare.json").read_text())
    assert [s["label"] for s in runs] == ["neuron-scheduler", "first-fit", "no-topology bound"]
    assert [s["placed"] for s in runs] == [3, 3, 3]


@pytest.mark.parametrize(
    ("fleet", "workload", "message"),
    [
        ("nodes: [", "pods: []", "not valid YAML"),
        ("nodes:\n  - {instance_type: foo.bar}", "pods: []", "unknown instance type 'foo.bar'"),
        ("nodes:\n  - {instance_type: inf1.6xlarge, count: 0}", "pods: []", "count must be"),
        ("nodes: []", "pods: []", "no nodes"),
        (
            "nodes:\n  - {instance_type: inf1.6xlarge}",
            "pods:\n  - {name: a, resource: neuron, count: -1}",
            "count must be at least 1",
        ),
        (
            "nodes:\n  - {instance_type: inf1.6xlarge}",
            "pods:\n  - {name: a, resource: tpu, count: 1}",
            "unknown Neuron resource",
        ),
        ("nodes:\n  - {instance_type: inf1.6xlarge}", "{}", "exactly one of"),
        (
            "nodes:\n  - {instance_type: inf1.6xlarge}",
            "pods:\n  - {name: a, resource: neuron, count: 1}\n"
            "  - {name: a, resource: neuron, count: 2}",
            "pod names repeat",
        ),
        (
            "nodes:\n  - {instance_type: inf1.6xlarge}",
            "pods:\n  - {name: a, resource: neuron, count: 1, duration: -3}",
            "duration must be >= 0",
        ),
    ],
)
def test_simulate_bad_files(tmp_path: Path, fleet: str, workload: str, message: str) -> None:
    (tmp_path / "f.yaml").write_text(fleet)
    (tmp_path / "w.yaml").write_text(workload)
    r = run(
        "simulate", "--cluster", str(tmp_path / "f.yaml"), "--workload", str(tmp_path / "w.yaml")
    )
    assert r.returncode == 2, r.stdout
    assert message in r.stderr
    assert "Traceback" not in r.stderr
