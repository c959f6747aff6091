"""The Worker template's nodeSelector and affinity for an UltraServer MPIJob, as in the Neuron
docs, and a whole MPIJob with the launcher's two init containers. Pure."""

from __future__ import annotations

import re
from typing import Any

from neuron_scheduler.jobs.members import (
    GANG_SIZE_ANNOTATION,
    JOB_NAME_LABEL,
    JOB_ROLE_LABEL,
    WORKER_ROLE,
)
from neuron_scheduler.jobs.units import ENV_NODE_CONFIG, NODE_CONFIG_KEY, NodeConfigError
from neuron_scheduler.ultraserver.labels import INSTANCE_TYPE, topology_key
from neuron_scheduler.ultraserver.launcher.hostfile import DEFAULT_OUT_DIR

DEFAULT_IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/ultraserver:mpijob"
DEFAULT_INIT_IMAGE = "ghcr.io/neuron-scheduler/neuron-scheduler:0.1.0"
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check(job_name: str, workers: int, node_config: int) -> None:
    if len(job_name) > 63 or not _LABEL_VALUE.match(job_name) or not _DNS_NAME.match(job_name):
        raise NodeConfigError(
            f"--job-name {job_name!r}: an MPIJob name must be a DNS label (lower case letters, "
            "digits and '-', at most 63 characters)"
        )
    if workers < 1:
        raise NodeConfigError(f"--workers {workers}: at least 1")
    if workers % node_config:
        raise NodeConfigError(
            f"--workers {workers} does not split into UltraServer units of {node_config} "
            f"(--node-config {node_config} needs a multiple of {node_config} workers)"
        )


def worker_placement(job_name: str, workers: int, node_config: int) -> dict[str, Any]:
    """nodeSelector and affinity for the Worker pod template's spec."""
    check(job_name, workers, node_config)
    key = topology_key(node_config)
    affinity: dict[str, Any] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {
                        "matchExpressions": [
                            {"key": JOB_NAME_LABEL, "operator": "NotIn", "values": [job_name]}
                        ],
                        "matchLabels": {JOB_ROLE_LABEL: WORKER_ROLE},
                    },
                    "topologyKey": key,
                }
            ]
        }
    }
    if node_config > 1:
        term = {
            "labelSelector": {
                "matchLabels": {JOB_ROLE_LABEL: WORKER_ROLE, JOB_NAME_LABEL: job_name}
            },
            "topologyKey": key,
        }
        if workers <= node_config:
            affinity["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
        else:  # several UltraServers: keep together where possible, never block
            affinity["podAffinity"] = {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 100, "podAffinityTerm": term}
                ]
            }
    return {
        "nodeSelector": {"node.kubernetes.io/instance-type": INSTANCE_TYPE},
        "affinity": affinity,
    }


_WAIT_SCRIPT = """\
if [[ $(cat /etc/mpi/discover_hosts.sh | wc -l) != 1 ]]; then
  date
  echo "Ready"
  cat /etc/mpi/discover_hosts.sh
else
  date
  echo "not ready ..."
  sleep 10
  exit 1
fi
while read host; do
  while ! ssh $host echo $host; do
    date
    echo "Pod $host is not up ..."
    sleep 10
  done
  date
  echo "Pod $host is ready"
done <<< "$(/etc/mpi/discover_hosts.sh)"
"""


def worker_annotations(workers: int, node_config: int) -> dict[str, str]:
    """The Worker template's annotations the extender reads: the node config, and the job's
    size (MPIJob says it nowhere on its pods), so the extender reserves units for all workers
    at once."""
    return {NODE_CONFIG_KEY: str(node_config), GANG_SIZE_ANNOTATION: str(workers)}


def mpijob(
    job_name: str,
    workers: int,
    node_config: int,
    *,
    namespace: str = "default",
    image: str = DEFAULT_IMAGE,
    init_image: str = DEFAULT_INIT_IMAGE,
) -> dict[str, Any]:
    """A whole MPIJob: the launcher waits for every worker, then runs `neuron-scheduler
    ultraserver-init`; workers carry the placement above and the annotations the extender
    reads (`worker_annotations`)."""
    placement = worker_placement(job_name, workers, node_config)
    mounts = [
        {"mountPath": "/etc/mpi", "name": "mpi-job-config"},
        {"mountPath": "/root/.ssh", "name": "ssh-auth"},
    ]
    launcher = {
        "replicas": 1,
        "template": {
            "spec": {
                "containers": [{"name": "mpitest", "image": image}],
                "initContainers": [
                    {
                        "name": "wait-hostfilename",
                        "image": image,
                        "command": ["bash", "-cx", _WAIT_SCRIPT],
                        "resources": {},
                        "volumeMounts": mounts,
                    },
                    {
                        "name": "ultraserver-init-container",
                        "image": init_image,
                        "command": ["neuron-scheduler", "ultraserver-init"],
                        "env": [{"name": ENV_NODE_CONFIG, "value": str(node_config)}],
                        # root, like the MPI launcher itself: ssh finds the job's key in
                        # /root/.ssh, and the image's default user has no home.
                        "securityContext": {"runAsUser": 0, "runAsGroup": 0},
                        "volumeMounts": [
                            *mounts,
                            {"mountPath": DEFAULT_OUT_DIR, "name": "ultraserver-init"},
                        ],
                    },
                ],
                "volumes": [{"name": "ultraserver-init", "emptyDir": {}}],
            }
        },
    }
    worker = {
        "replicas": workers,
        "template": {
            "metadata": {"annotations": worker_annotations(workers, node_config)},
            "spec": {
                **placement,
                "containers": [
                    {
                        "name": "mpitest",
                        "image": image,
                        "resources": {"limits": {"aws.amazon.com/neuron": 16}},
                    }
                ],
            },
        },
    }
    return {
        "apiVersion": "kubeflow.org/v2beta1",
        "kind": "MPIJob",
        "metadata": {"name": job_name, "namespace": namespace},
        "spec": {"mpiReplicaSpecs": {"Launcher": launcher, "Worker": worker}},
    }
