"""The committed gRPC stubs are exactly what proto/generate.py makes from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path("neuron_scheduler/deviceplugin/v1beta1")


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "proto/generate.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    fresh = sorted(p.name for p in (tmp_path / PACKAGE).iterdir())
    committed = sorted(p.name for p in (REPO / "src" / PACKAGE).glob("*_pb2*"))
    assert fresh == committed
    for name in fresh:
        assert (tmp_path / PACKAGE / name).read_bytes() == (
            REPO / "src" / PACKAGE / name
        ).read_bytes(), f"{name} is stale: run `uv run python proto/generate.py`"


def test_wire_names_match_kubelet() -> None:
    from neuron_scheduler.deviceplugin.v1beta1 import api_pb2

    assert api_pb2.DESCRIPTOR.package == "v1beta1"
    services = api_pb2.DESCRIPTOR.services_by_name
    assert set(services["DevicePlugin"].methods_by_name) == {
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    }
    assert set(services["Registration"].methods_by_name) == {"Register"}
    fields = api_pb2.ContainerAllocateResponse.DESCRIPTOR.fields_by_name
    assert {name: f.number for name, f in fields.items()} == {
        "envs": 1,
        "mounts": 2,
        "devices": 3,
        "annotations": 4,
        "cdi_devices": 5,
    }
    request = api_pb2.ContainerPreferredAllocationRequest.DESCRIPTOR.fields_by_name
    assert request["allocation_size"].number == 3
    assert api_pb2.RegisterRequest.DESCRIPTOR.fields_by_name["options"].number == 4
