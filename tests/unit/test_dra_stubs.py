"""The committed DRA gRPC stubs are exactly what proto/generate.py makes today, and speak
kubelet's wire names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = [
    Path("neuron_scheduler/dra/v1"),
    Path("neuron_scheduler/dra/v1beta1"),
    Path("neuron_scheduler/dra/pluginregistration"),
]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stubs")
    result = subprocess.run(
        [sys.executable, str(REPO / "proto/generate.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.parametrize("package", PACKAGES, ids=str)
def test_committed_stubs_match_a_fresh_generation(fresh: Path, package: Path) -> None:
    names = sorted(p.name for p in (fresh / package).iterdir())
    committed = sorted(p.name for p in (REPO / "src" / package).glob("*_pb2*"))
    assert names == committed
    for name in names:
        assert (fresh / package / name).read_bytes() == (
            REPO / "src" / package / name
        ).read_bytes(), f"{package / name} is stale: run `uv run python proto/generate.py`"


def test_wire_names_match_kubelet() -> None:
    from neuron_scheduler.dra.pluginregistration import api_pb2 as registration
    from neuron_scheduler.dra.v1 import api_pb2 as v1
    from neuron_scheduler.dra.v1beta1 import api_pb2 as v1beta1

    assert v1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert v1beta1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1beta1"
    assert registration.DESCRIPTOR.package == "pluginregistration"
    for module in (v1, v1beta1):
        service = module.DESCRIPTOR.services_by_name["DRAPlugin"]
        assert set(service.methods_by_name) == {"NodePrepareResources", "NodeUnprepareResources"}
        claim = module.Claim.DESCRIPTOR.fields_by_name
        assert {n: f.number for n, f in claim.items()} == {"namespace": 1, "uid": 2, "name": 3}
        device = module.Device.DESCRIPTOR.fields_by_name
        numbers = {n: f.number for n, f in device.items()}
        assert {k: numbers[k] for k in ("request_names", "pool_name", "device_name")} == {
            "request_names": 1,
            "pool_name": 2,
            "device_name": 3,
        }
        assert numbers["cdi_device_ids"] == 4
        assert module.NodePrepareResourceResponse.DESCRIPTOR.fields_by_name["error"].number == 2
    assert v1.Device.DESCRIPTOR.fields_by_name["share_id"].number == 5
    assert "share_id" not in v1beta1.Device.DESCRIPTOR.fields_by_name
    service = registration.DESCRIPTOR.services_by_name["Registration"]
    assert set(service.methods_by_name) == {"GetInfo", "NotifyRegistrationStatus"}
    info = registration.PluginInfo.DESCRIPTOR.fields_by_name
    assert {n: f.number for n, f in info.items()} == {
        "type": 1,
        "name": 2,
        "endpoint": 3,
        "supported_versions": 4,
    }
