"""Which training job a pod belongs to, whatever made it, and how many pods the job has (its
gang). Pure: read from the pod's labels, annotations and env; a PodGroup's minCount is passed in.

The frameworks' CRDs are not needed: their controllers label the pods they create, and that is
what is read here (keys from each project's source, docs/training-jobs.md lists them).

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

JobKey = tuple[str, str]  # (namespace, job name)

JOB_NAME_LABEL = "training.kubeflow.org/job-name"
JOB_ROLE_LABEL = "training.kubeflow.org/job-role"
WORKER_ROLE = "worker"

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
    """A pod that is one of a job's members (each takes a node, or part of one)."""

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


# The API group of each framework whose controller labels its pods with the job's name (read by
# `framework_labels`).
JOBSET_GROUP = "jobset.x-k8s.io"
KUBEFLOW_GROUP = "kubeflow.org"


def framework_labels(api_version: str, kind: str, name: str, pod_set: str) -> dict[str, str]:
    """The labels a framework's controller gives every pod of its job `name`, which its pod
    templates do not carry yet (what `member_of` reads): a JobSet's name; a PyTorchJob's name and
    replica type, an MPIJob's name and role, which Kueue names their pod sets by (`master`,
    `worker`, `launcher`). Empty for anything else (a batch/v1 Job, plain pods: their templates
    say all there is)."""
    group = api_version.partition("/")[0]
    if not name or len(name) > MAX_NAME:
        return {}
    if group == JOBSET_GROUP and kind == "JobSet":
        return {JOBSET_LABEL: name}
    if group == KUBEFLOW_GROUP and kind == "PyTorchJob":
        return {JOB_NAME_LABEL: name, REPLICA_TYPE_LABEL: pod_set}
    if group == KUBEFLOW_GROUP and kind == "MPIJob":
        return {JOB_NAME_LABEL: name, JOB_ROLE_LABEL: pod_set}
    return {}


def _number(text: str, digits: int) -> int | None:
    """A whole number of at most `digits` ASCII digits, or None. (str.isdigit() says yes to '²',
    which int() refuses, to '٣', which it reads, and to 5000 nines, past int()'s limit.)"""
    value = text.strip()
    if not (value.isascii() and value.isdigit()) or len(value) > digits:
        return None
    return int(value)


def _size(text: str | None, source: str) -> int | None:
    if text is None:
        return None
    value = _number(text, 9)
    if value is None or not 1 <= value <= MAX_GANG:
        raise MembershipError(
            f"{source}={text[:40]!r} is not a job size; give a whole number of pods, 1 to "
            f"{MAX_GANG}"
        )
    return value


def _nodes_env(pod: Pod) -> int | None:
    """torchrun's node count, when fixed (an elastic range such as "1:4" says no size)."""
    for container in pod.spec.containers:
        for variable in container.env:
            count = _number(variable.value, 9) if variable.name == NODES_ENV else None
            if count is not None:
                return count if 1 <= count <= MAX_GANG else None
    return None


# Where each framework writes a member's index (its rank, or what orders its ranks).
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"  # MPIJob, PyTorchJob
JOBSET_GLOBAL_INDEX_LABEL = "jobset.sigs.k8s.io/job-global-index"
JOBSET_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # an Indexed Job's pod
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
MAX_INDEX_DIGITS = 6

Rank = tuple[int, int]  # (group, index within it): a PyTorchJob's master 0, its workers 1


def rank_of(pod: Pod, member: Member) -> Rank | None:
    """Where the member stands among its job's ranks, from the index its framework gives it
    (None: it gives none, or none that reads as a number): a group and the index within it. A
    PyTorchJob's master (group 0) before its workers (group 1) by replica index, a JobSet's pods
    by job index (global across replicated jobs where JobSet writes it) then completion index, an
    MPIJob's workers by replica index, a LeaderWorkerSet group's pods by worker index (the
    leader is 0), any other job's pods by their Indexed Job completion index (group 0). A rank's
    place is its index plus the members of the groups before it (jobs/placement.py)."""
    labels = pod.metadata.labels
    if member.framework == "pytorchjob":
        index = _index(labels.get(REPLICA_INDEX_LABEL))
        master = labels.get(REPLICA_TYPE_LABEL) == "master"
        return None if index is None else (0 if master else 1, index)
    if member.framework == "jobset":
        job = _index(labels.get(JOBSET_GLOBAL_INDEX_LABEL, labels.get(JOBSET_INDEX_LABEL)))
        completion = _index(labels.get(COMPLETION_INDEX_LABEL)) or 0
        return None if job is None else (job, completion)
    key = {"mpijob": REPLICA_INDEX_LABEL, "leaderworkerset": LWS_WORKER_INDEX_LABEL}.get(
        member.framework, COMPLETION_INDEX_LABEL
    )
    index = _index(labels.get(key))
    return None if index is None else (0, index)


def _index(text: str | None) -> int | None:
    return None if text is None else _number(text, MAX_INDEX_DIGITS)
