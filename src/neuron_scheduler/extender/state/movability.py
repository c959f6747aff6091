"""What consolidation knows of each Neuron pod beyond the ledger: whether it may move, and what
its replacement's node must admit. A view fed by the pod watch; no I/O.

`Movability` keeps, for each unfinished Neuron pod, its controller (a bare pod is never moved:
nothing recreates it), its opt-out (`neuron-scheduler.io/do-not-disrupt: "true"`), whether it is a
training job's pod (every framework the training-job rule knows: never moved for now, as a job
moves only whole), and what its replacement's node must admit (nodeSelector, required node
affinity, tolerations). The planning that reads it is the leader's (extender/loops/movers);
`Plans` and `kubectl neuron status` read it too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.extender.state.plugins import PodsOnly
from neuron_scheduler.jobs.members import MembershipError, member_of
from neuron_scheduler.kube.objects import Affinity, Pod, PodSpec, Toleration
from neuron_scheduler.kube.reading import servable_request
from neuron_scheduler.kube.views import pod_uid, replace_all

DO_NOT_DISRUPT = "neuron-scheduler.io/do-not-disrupt"
# Pods of jobs that run (and so would have to move) as a whole beyond the members `member_of`
# names (jobs/members.py): a launcher, and any pod of a JobSet or a LeaderWorkerSet.
GANG_LABELS = {
    "training.kubeflow.org/job-name": "a Kubeflow training job's pod",
    "jobset.sigs.k8s.io/jobset-name": "a JobSet's pod",
    "leaderworkerset.sigs.k8s.io/name": "a LeaderWorkerSet's pod",
}
GANG_TEXT = "(a gang job moves only whole, which consolidation does not do yet)"


def gang_of(pod: Pod) -> str:
    """What makes the pod part of a job that runs (and so moves) only whole, or "": a training
    job's member as the training-job rule knows them (every framework, jobs/members.py), or a
    pod of such a job that is no member (an MPI launcher, a JobSet's or LeaderWorkerSet's
    other pods)."""
    try:
        member = member_of(pod)
    except MembershipError:
        return "a training job's member (its job's size is unreadable)"
    if member is not None:
        return f"a member of {member.framework} job {member.text}"
    for label, what in GANG_LABELS.items():
        if label in pod.metadata.labels:
            return what
    return ""


@dataclass(frozen=True, slots=True)
class Facts:
    """What consolidation knows of one Neuron pod beyond the ledger."""

    key: str  # namespace/name
    namespace: str
    labels: Mapping[str, str]
    request: NeuronRequest
    priority: int
    owner: str  # its controller's uid; "" for a bare pod
    never: str  # why it is never moved; "" when it may be
    created: str  # RFC 3339
    bound: str  # its node; "" while pending
    placement: Pod = field(compare=False)  # its spec's node rules, for its replacement
    opted_out: bool = False  # neuron-scheduler.io/do-not-disrupt: never evicted by us

    @classmethod
    def of(cls, pod: Pod, request: NeuronRequest) -> Facts:
        meta, spec = pod.metadata, pod.spec
        controller = meta.controller
        return cls(
            pod.key,
            meta.namespace,
            meta.labels,
            request,
            spec.priority or 0,
            controller.uid if controller is not None else "",
            never_moved(pod),
            meta.creationTimestamp or "",
            spec.nodeName,
            # Only what kube.nodefit reads: the rest of the pod is not kept.
            Pod(spec=_node_rules(spec.nodeSelector, spec.affinity, spec.tolerations)),
            opted_out(pod),
        )


def _node_rules(
    selector: dict[str, str], affinity: Affinity | None, tolerations: tuple[Toleration, ...]
) -> PodSpec:
    return PodSpec(nodeSelector=selector, affinity=affinity, tolerations=tolerations)


def opted_out(pod: Pod) -> bool:
    return pod.metadata.annotations.get(DO_NOT_DISRUPT, "").lower() == "true"


def never_moved(pod: Pod) -> str:
    """Why consolidation never moves this pod, or "" when it may."""
    meta = pod.metadata
    if opted_out(pod):
        return f"opted out ({DO_NOT_DISRUPT})"
    gang = gang_of(pod)
    if gang:
        return f"{gang} {GANG_TEXT}"
    controller = meta.controller
    if controller is None:
        return "a bare pod (no controller recreates it)"
    if controller.kind == "DaemonSet":
        return "a DaemonSet's pod (recreated on the same node)"
    if controller.kind == "Node":
        return "a static pod"
    return ""


class Movability(PodsOnly):
    """A view of every unfinished Neuron pod's `Facts`, fed by the pod watch."""

    def __init__(self) -> None:
        self.pods: dict[str, Facts] = {}

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        replace_all(pods, pod_uid, self.apply_pod, self.pods, self.remove_pod)

    def apply_pod(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        if pod.finished:
            self.pods.pop(uid, None)
            return
        request = servable_request(pod)
        if request is None:
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = Facts.of(pod, request)

    def remove_pod(self, uid: str) -> None:
        self.pods.pop(uid, None)
