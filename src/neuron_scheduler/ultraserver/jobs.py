"""Which training job a pod belongs to, whatever made it, and how many pods the job has (its
gang). Pure: read from the pod's labels, annotations and env; a PodGroup's minCount is passed in.

The frameworks' CRDs are not needed: their controllers label the pods they create, and that is
what is read here (keys from each project's source, docs/ultraserver.md lists them).

- Kubernetes 1.36's Workload API: `spec.schedulingGroup.podGroupName` names the job (a PodGroup
  in the pod's namespace); the size is the PodGroup's `gang.minCount`.
- Ours, for anything else: annotation `neuron-scheduler.io/gang` names the job.
- MPIJob v2beta1: label `training.kubeflow.org/job-role: worker`; the job is
  `training.kubeflow.org/job-name` (the launcher is no member).
- training-operator v1 (PyTorchJob): `training.kubeflow.org/replica-type` `master` or `worker`;
  the job is `job-name`; the size is env `PET_NNODES` when it is one number.
- JobSet, and Kubeflow Trainer v2 (a TrainJob runs as a JobSet of its name): label
  `jobset.sigs.k8s.io/jobset-name` is the job; the size is env `PET_NNODES` (Trainer's torch).
- LeaderWorkerSet: one group is a job, `leaderworkerset.sigs.k8s.io/name` and `group-index`;
  the size is the annotation `leaderworkerset.sigs.k8s.io/size` (leader included).

Where a framework gives no size, `neuron-scheduler.io/gang-size` does (`ultraserver-affinity`
writes it); without either, the job is as large as the members seen so far.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.ultraserver.labels import JOB_NAME_LABEL, JOB_ROLE_LABEL, WORKER_ROLE

JobKey = tuple[str, str]  # (namespace, job name)

GANG_ANNOTATION = "neuron-scheduler.io/gang"
GANG_SIZE_ANNOTATION = "neuron-scheduler.io/gang-size"
MAX_GANG = 1024  # members one job may declare; more is an error on its pods
MAX_NAME = 253
SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")

REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
LWS_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
NODES_ENV = "PET_NNODES"  # torchrun's node count, set by PyTorchJob and Trainer's torch runtime


class MembershipError(ValueError):
    """A job name or size the pod gives that cannot be one: the message names where it was
    read."""


@dataclass(frozen=True, slots=True)
class Member:
    """A pod that is one of a job's members (each takes one UltraServer node)."""

    job: JobKey
    framework: str  # podgroup, gang, mpijob, pytorchjob, jobset, leaderworkerset
    size: int | None  # what the pod says the job has; None: the PodGroup's, or unknown
    pod_group: str | None = None  # the Workload API PodGroup that says it

    @property
    def text(self) -> str:
        return f"{self.job[0]}/{self.job[1]}"


def member_of(pod: Pod) -> Member | None:
    """The job this pod is a member of; None for a pod of no job (or a job's launcher).
    MembershipError when the pod's own size is no size."""
    meta = pod.metadata
    labels, annotations, namespace = meta.labels, meta.annotations, meta.namespace
    ours = _size(annotations.get(GANG_SIZE_ANNOTATION), f"annotation {GANG_SIZE_ANNOTATION}")
    group = pod.spec.schedulingGroup.podGroupName if pod.spec.schedulingGroup else None
    if group:
        return Member((namespace, group), "podgroup", ours, pod_group=group)
    if annotations.get(GANG_ANNOTATION):
        name = annotations[GANG_ANNOTATION]
        if len(name) > MAX_NAME or not SUBDOMAIN.fullmatch(name):
            raise MembershipError(
                f"annotation {GANG_ANNOTATION}={name[:40]!r} is not a job name (lower-case "
                f"letters, digits, '-' and '.', at most {MAX_NAME} characters)"
            )
        return Member((namespace, name), "gang", ours)
    job = labels.get(JOB_NAME_LABEL)
    if job and labels.get(JOB_ROLE_LABEL) == WORKER_ROLE and REPLICA_TYPE_LABEL not in labels:
        return Member((namespace, job), "mpijob", ours)
    if job and labels.get(REPLICA_TYPE_LABEL) in ("master", "worker"):
        return Member((namespace, job), "pytorchjob", _nodes_env(pod) or ours)
    if labels.get(JOBSET_LABEL):
        return Member((namespace, labels[JOBSET_LABEL]), "jobset", _nodes_env(pod) or ours)
    lws, group_index = labels.get(LWS_LABEL), labels.get(LWS_GROUP_LABEL)
    if lws and group_index is not None:
        size = _size(annotations.get(LWS_SIZE_ANNOTATION), f"annotation {LWS_SIZE_ANNOTATION}")
        return Member((namespace, f"{lws}-{group_index}"), "leaderworkerset", size or ours)
    return None


def _size(text: str | None, source: str) -> int | None:
    if text is None:
        return None
    value = text.strip()
    if not value.isdigit() or not 1 <= int(value) <= MAX_GANG:
        raise MembershipError(
            f"{source}={text[:40]!r} is not a job size; give a whole number of pods, 1 to "
            f"{MAX_GANG}"
        )
    return int(value)


def _nodes_env(pod: Pod) -> int | None:
    """torchrun's node count, when fixed (an elastic range such as "1:4" says no size)."""
    for container in pod.spec.containers:
        for variable in container.env:
            if variable.name == NODES_ENV and variable.value.strip().isdigit():
                count = int(variable.value.strip())
                return count if 1 <= count <= MAX_GANG else None
    return None
