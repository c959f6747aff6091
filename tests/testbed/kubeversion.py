"""The Kubernetes version of the testbed's binary, and what each minor version must have turned on
for what the tests use of it.

`make test` runs on tools/kube/go.mod's version; `make test-kube KUBE_MINOR=1.X` runs the tests
marked `compat` on another (tools/kube/compat/1.X.mod). The control plane, the kubelet and the
tests read the version from the binary itself (`kube-apiserver --version`), so nothing else has to
be told which one it is.

The gates and API versions here are the ones docs/dra.md and docs/training-jobs.md tell a user to
turn on for the same features on the same version: the testbed runs what a user would.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path


@dataclass(frozen=True, order=True)
class KubeVersion:
    major: int
    minor: int
    patch: int

    @classmethod
    def parse(cls, text: str) -> KubeVersion:
        """`v1.37.2`, `1.37.2` or `Kubernetes v1.37.2`; `1.35` is `1.35.0`."""
        found = re.search(r"v?(\d+)\.(\d+)(?:\.(\d+))?", text)
        if found is None:
            raise ValueError(f"no Kubernetes version in {text!r}")
        major, minor, patch = found.groups()
        return cls(int(major), int(minor), int(patch or 0))

    def __str__(self) -> str:
        return f"v{self.major}.{self.minor}.{self.patch}"

    @property
    def minor_version(self) -> str:
        """`1.37`: how KUBE_MINOR and the docs name it."""
        return f"{self.major}.{self.minor}"


@cache
def binary_version(kubebin: Path) -> KubeVersion:
    """What the multi-call binary says it is (tools/kube.mk stamps it from the module file)."""
    result = subprocess.run(
        [str(kubebin), "kube-apiserver", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    return KubeVersion.parse(result.stdout)


def needed_gates(version: KubeVersion) -> dict[str, bool]:
    """The gates every component of the testbed gets on this version (kube-apiserver,
    kube-scheduler, kube-controller-manager, kubelet): what the product's features need there
    and the version has off by default."""
    if version.minor == 35:
        # The DRA driver's shared counters (partitionable devices) and the taints of a failed
        # device are alpha in 1.35, beta and on from 1.36 (docs/dra.md).
        return {"DRAPartitionableDevices": True, "DRADeviceTaints": True}
    return {}


def gates_flag(gates: Mapping[str, bool]) -> list[str]:
    """`--feature-gates=A=true,B=false`, or nothing for no gates."""
    if not gates:
        return []
    return [
        "--feature-gates=" + ",".join(f"{k}={str(v).lower()}" for k, v in sorted(gates.items()))
    ]


@dataclass(frozen=True)
class WorkloadApi:
    """The Workload API's PodGroups on one version: the API version they are served in, and what
    turns them on (none of it is on by default on any version)."""

    group_version: str
    apiserver_gates: Mapping[str, bool]
    scheduler_gates: Mapping[str, bool]

    @property
    def runtime_config(self) -> str:
        """kube-apiserver's flag that serves the group version."""
        return f"--runtime-config={self.group_version}=true"


def workload_api(version: KubeVersion) -> WorkloadApi | None:
    """None below 1.36: 1.35's alpha Workload API has no PodGroup objects (its pods name a
    Workload), and the extender does not read it."""
    if version.minor >= 37:
        # Beta, still off by default; 1.37 removed v1alpha2 and the GangScheduling gate
        # (GenericWorkload turns kube-scheduler's PodGroup cycle on).
        on = {"GenericWorkload": True}
        return WorkloadApi("scheduling.k8s.io/v1beta1", on, on)
    if version.minor == 36:
        return WorkloadApi(
            "scheduling.k8s.io/v1alpha2",
            {"GenericWorkload": True},
            {"GenericWorkload": True, "GangScheduling": True},
        )
    return None


@dataclass(frozen=True)
class Need:
    """Something a test uses that not every version serves: the first minor version that does,
    and why the ones before cannot."""

    since: int
    why: str


# The `needs` marker's names. docs/install.md's "Tested on" table says the same.
NEEDS: dict[str, Need] = {
    "dra": Need(
        35,
        "the DRA driver publishes resource.k8s.io/v1 slices with shared counters in the layout "
        "partitionable devices have from 1.35 (1.34's alpha kept counters in the devices' own "
        "slice; 1.32 and 1.33 serve no resource.k8s.io/v1); the chart refuses dra.enabled there",
    ),
    "workload-api": Need(
        36,
        "PodGroup objects: the Workload API's scheduling.k8s.io/v1alpha2 (1.36) or v1beta1 "
        "(1.37); 1.35's alpha Workload API has none, and earlier versions no Workload API",
    ),
}


def unmet(version: KubeVersion, needs: list[str]) -> str | None:
    """Why a test that needs these cannot run on this version; None when it can."""
    for name in needs:
        need = NEEDS[name]  # a KeyError here is a misspelt marker: fail loudly
        if version.minor < need.since:
            return f"not on {version}: needs 1.{need.since}+ ({name}: {need.why})"
    return None
