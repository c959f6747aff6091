"""The committed pod resources stubs are exactly what proto/generate.py makes today, and speak
kubelet's wire names (k8s.io/kubelet/pkg/apis/podresources/v1)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path("neuron_scheduler/deviceplugin/podresources/v1")


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
    from neuron_scheduler.deviceplugin.podresources.v1 import api_pb2

    assert api_pb2.DESCRIPTOR.package == "v1"
    service = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert set(service.methods_by_name) == {"List", "GetAllocatableResources", "Get"}

    def numbers(message: type) -> dict[str, int]:
        fields = message.DESCRIPTOR.fields_by_name  # type: ignore[attr-defined]
        return {name: f.number for name, f in fields.items()}

    assert numbers(api_pb2.ListPodResourcesResponse) == {"pod_resources": 1}
    assert numbers(api_pb2.PodResources) == {"name": 1, "namespace": 2, "containers": 3}
    assert numbers(api_pb2.ContainerResources) == {
        "name": 1,
        "devices": 2,
        "cpu_ids": 3,
        "memory": 4,
        "dynamic_resources": 5,
    }
    assert numbers(api_pb2.ContainerDevices) == {
        "resource_name": 1,
        "device_ids": 2,
        "topology": 3,
    }
