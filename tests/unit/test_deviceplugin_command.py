"""The device-plugin command's input checks: one line on stderr and exit code 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from neuron_scheduler.deviceplugin.command import register
from tests.unit.commands import app_with


def app() -> typer.Typer:
    return app_with(register)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "--node-name (or NODE_NAME) is required"),
        (["--node-name", "n", "--log-level", "loud"], "--log-level 'loud'"),
        (["--node-name", "n", "--cores-per-device", "0"], "--cores-per-device 0"),
        (["--node-name", "n", "--kubeconfig", "/nonexistent"], "/nonexistent: no such file"),
    ],
)
def test_bad_input_is_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app(), ["device-plugin", *args], env={"NODE_NAME": ""})
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_no_way_to_reach_the_api_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    result = CliRunner().invoke(
        app(), ["device-plugin", "--node-name", "n", "--plugin-dir", str(tmp_path)]
    )
    assert result.exit_code == 2, result.output
    assert "not running in a pod" in result.output


def test_node_name_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    result = CliRunner().invoke(
        app(), ["device-plugin", "--log-level", "loud"], env={"NODE_NAME": "from-env"}
    )
    assert "--node-name" not in result.output and "--log-level" in result.output
