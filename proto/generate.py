"""Generate the Python gRPC stubs for kubelet's device plugin, pod resources and DRA plugin APIs
from proto/.

    uv run python proto/generate.py            # rewrite the committed stubs under src/
    uv run python proto/generate.py --out DIR  # write them under DIR instead

The stubs are committed so the package installs without a code generator;
tests/unit/test_deviceplugin_stubs.py, test_podresources_stubs.py and test_dra_stubs.py regenerate
them into a temporary directory and fail when they differ, so edit the .proto and rerun this,
never the generated files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO = PROTO_ROOT.parent
PROTOS = (
    "neuron_scheduler/deviceplugin/v1beta1/api.proto",
    "neuron_scheduler/deviceplugin/podresources/v1/api.proto",
    "neuron_scheduler/dra/v1/api.proto",
    "neuron_scheduler/dra/v1beta1/api.proto",
    "neuron_scheduler/dra/pluginregistration/api.proto",
)


def generate(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    # The plugins ship as console scripts next to the interpreter; naming them keeps generation
    # independent of PATH.
    bindir = Path(sys.executable).parent
    args = [
        "protoc",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed for {', '.join(PROTOS)}")
    return sorted(p for p in out.rglob("*_pb2*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "src")
    for path in generate(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
