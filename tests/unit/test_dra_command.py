"""The dra-driver command's input checks, and the host reading it starts from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.dra.command import register
from neuron_scheduler.dra.driver import efa_pairing
from neuron_scheduler.dra.hardware import read_host, read_logical_nc
from neuron_scheduler.dra.pools import node_topology
from tests.unit.commands import app_with


def app() -> typer.Typer:
    return app_with(register)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--node-name (or NODE_NAME) is required"),
        (["--node-name", "n", "--driver-name", "neuron.aws.com"], "under aws.com"),
        (["--node-name", "n", "--driver-name", "Neuron_Driver"], "not a domain-qualified"),
        (["--node-name", "n", "--driver-name", "neuron"], "not a domain-qualified"),
        (["--node-name", "n", "--log-level", "loud"], "--log-level 'loud'"),
        (["--node-name", "n", "--cores-per-device", "0"], "--cores-per-device 0"),
        (["--node-name", "n", "--health-interval", "0"], "--health-interval 0.0"),
        (
            ["--node-name", "n", "--core-windows", "1,33"],
            "must list core counts of 1 .. 32, got '1,33'",
        ),
        (
            ["--node-name", "n", "--core-windows", "1,x"],
            "must list core counts of 1 .. 32, got '1,x'",
        ),
        (["--node-name", "n", "--kubeconfig", "/nonexistent"], "/nonexistent: no such file"),
    ],
)
def test_bad_input_is_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app(), ["dra-driver", *args], env={"NODE_NAME": ""})
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output


def test_no_way_to_reach_the_api_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    result = CliRunner().invoke(app(), ["dra-driver", "--node-name", "n"])
    assert result.exit_code == 2, result.output
    assert "not running in a pod" in result.output


def fake_host(
    root: Path, devices: int, cores: int = 2, efa: tuple[str, ...] = ()
) -> tuple[Path, Path]:
    dev, sys = root / "dev", root / "sys"
    (dev).mkdir()
    for d in range(devices):
        (dev / f"neuron{d}").touch()
        folder = sys / "class" / "neuron_device" / f"neuron{d}"
        folder.mkdir(parents=True)
        (folder / "core_count").write_text(f"{cores}\n")
    for bdf in efa:
        (sys / "bus" / "pci" / "drivers" / "efa" / bdf).mkdir(parents=True)
    return dev, sys


def test_reading_the_host(tmp_path: Path) -> None:
    dev, sys = fake_host(tmp_path, 12)
    host = read_host(dev, sys)
    assert host.count == 12 and host.physical_cores == 2 and host.problems == {}
    (sys / "class" / "neuron_device" / "neuron4" / "core_count").write_text("garbage")
    os.unlink(dev / "neuron7")
    (sys / "class" / "neuron_device" / "neuron9" / "core_count").write_text("4")
    host = read_host(dev, sys)
    assert sorted(host.problems) == [4, 7, 9]
    assert "neuron9 reports 4 cores, the others 2" in host.problems[9]
    assert "neuron7 is missing" in host.problems[7]


def test_topology_from_label_and_devices(tmp_path: Path) -> None:
    dev, sys = fake_host(tmp_path, 16, efa=("0000:c9:00.0", "0000:10:1a.0", "not-a-bdf"))
    host = read_host(dev, sys)
    assert host.efa_bdfs == {"0000:c9:00.0", "0000:10:1a.0"}
    catalog = Catalog.builtin()
    topology, warning = node_topology(catalog, "trn2.48xlarge", host.count, 4)
    assert (topology.kind.value, topology.devices, topology.cores_per_device) == ("torus", 16, 4)
    assert warning is None
    assert efa_pairing("trn2.48xlarge", host, 16) is not None
    assert efa_pairing("inf2.48xlarge", host, 16) is None
    # The devices win over a label that disagrees with them.
    topology, warning = node_topology(catalog, "inf2.48xlarge", host.count, 2)
    assert topology.kind.value == "chain" and topology.devices == 16
    assert warning is not None and "inf2.48xlarge" in warning


def test_logical_nc_file(tmp_path: Path) -> None:
    assert read_logical_nc(tmp_path / "absent") == (1, None)
    (tmp_path / "lnc").write_text("LNC=2\n")
    assert read_logical_nc(tmp_path / "lnc") == (2, None)
    (tmp_path / "bad").write_text("none")
    assert read_logical_nc(tmp_path / "bad")[0] == 1
