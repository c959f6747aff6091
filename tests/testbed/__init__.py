"""A real Kubernetes control plane on 127.0.0.1 for the end-to-end tests and `make cluster`.

Test infrastructure, not shipped in the wheel.

Needs the multi-call binary built by `make kube-bin` (tools/kube) and the openssl CLI.
"""

from .client import KubeClient, KubeError, write_kubeconfig
from .controlplane import (
    ControlPlane,
    Scheduler,
    ServiceAccountCredentials,
    StartupError,
    find_kubebin,
)
from .manifests import scheduler_config
from .process import ManagedProcess, free_port, free_ports
from .stack import ExtenderProcess, Stack

__all__ = [
    "ControlPlane",
    "ExtenderProcess",
    "KubeClient",
    "KubeError",
    "ManagedProcess",
    "Scheduler",
    "ServiceAccountCredentials",
    "Stack",
    "StartupError",
    "find_kubebin",
    "free_port",
    "free_ports",
    "scheduler_config",
    "write_kubeconfig",
]
