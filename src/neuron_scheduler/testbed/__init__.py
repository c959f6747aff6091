"""Real Kubernetes control plane on 127.0.0.1 for integration tests and the demo cluster.

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
from .manifests import (
    NEURON,
    NEURON_RESOURCES,
    NEURONCORE,
    NEURONDEVICE,
    fake_neuron_node,
    scheduler_config,
)
from .process import ManagedProcess, free_ports
from .stack import ExtenderProcess, Stack

__all__ = [
    "NEURON",
    "NEURONCORE",
    "NEURONDEVICE",
    "NEURON_RESOURCES",
    "ControlPlane",
    "ExtenderProcess",
    "KubeClient",
    "KubeError",
    "ManagedProcess",
    "Scheduler",
    "ServiceAccountCredentials",
    "Stack",
    "StartupError",
    "fake_neuron_node",
    "find_kubebin",
    "free_ports",
    "scheduler_config",
    "write_kubeconfig",
]
