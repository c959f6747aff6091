"""YAML files read into typed structs, with errors that name the file and the field.

Shared by the instance-type catalog and the simulator's fleet and workload files; each passes the
error type its callers catch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec

T = TypeVar("T")


def decode_yaml(data: bytes, kind: type[T], source: str, error: type[Exception]) -> T:
    try:
        return msgspec.yaml.decode(data, type=kind)
    except msgspec.ValidationError as problem:
        raise error(f"{source}: {problem}") from problem
    except msgspec.DecodeError as problem:
        raise error(f"{source}: not valid YAML: {problem}") from problem


def read_yaml(path: Path, kind: type[T], error: type[Exception], what: str = "") -> T:
    """`what` names the file's role in the "cannot read" message (e.g. "topology file")."""
    try:
        data = path.read_bytes()
    except OSError as problem:
        named = f"{what} {path}" if what else str(path)
        raise error(f"cannot read {named}: {problem.strerror}") from problem
    return decode_yaml(data, kind, str(path), error)
