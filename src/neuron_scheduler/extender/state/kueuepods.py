"""The pods Kueue's pod integration manages (plain pods and pod groups that name a LocalQueue),
by uid: their labels and annotations. Kueue's Workload for them carries only their spec (its pod
sets' templates have no metadata), while what makes them a training job (our gang annotations, a
framework's labels) is on the pods themselves. No I/O: the pod watch feeds it; the placement
check reads it (extender/state/admission).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from neuron_scheduler.extender.state.plugins import PodsOnly
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import KUEUE_QUEUE_LABEL
from neuron_scheduler.kube.views import pod_uid, replace_all


@dataclass(frozen=True, slots=True)
class PodMeta:
    labels: dict[str, str]
    annotations: dict[str, str]


class KueuePods(PodsOnly):
    def __init__(self) -> None:
        self.pods: dict[str, PodMeta] = {}

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        replace_all(pods, pod_uid, self.apply_pod, list(self.pods), self.remove_pod)

    def apply_pod(self, pod: Pod) -> None:
        meta = pod.metadata
        if meta.labels.get(KUEUE_QUEUE_LABEL) and not pod.finished and not meta.deletionTimestamp:
            self.pods[meta.uid] = PodMeta(meta.labels, meta.annotations)
        else:
            self.pods.pop(meta.uid, None)

    def remove_pod(self, uid: str) -> None:
        self.pods.pop(uid, None)

    def get(self, uid: str) -> PodMeta | None:
        return self.pods.get(uid)
