"""The placeholder pods of capacity requests (core/capacity), as the pod watch shows them. No I/O.

A placeholder asks an autoscaler for a node; it is never bound and holds nothing, so it must never
count as a pod anywhere: the watch gives placeholders to this view only (extender/serve), and
`kubectl neuron status` and `why` read them the same way. A placeholder is a pod with the
placeholder label, the placeholder scheduler name and no node: a bound pod is always counted,
whatever its labels, so no label can hide devices in use from the ledger.

The leader's capacity requests (extender/loops/requesting) act on the placeholders it made (its
namespace, its owner name); `asked` is what each one's record says, or why it cannot be read. The
extender's view keeps its own namespace's only: anyone may create a pod that looks like a
placeholder in a namespace of theirs, and such pods must not fill the view's bound (the leader
would no longer see its own placeholders, bound them or delete them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from neuron_scheduler.core.capacity import (
    PLACEHOLDER_LABEL,
    PLACEHOLDER_SCHEDULER,
    RECORD_ANNOTATION,
    Asked,
    PlaceholderError,
    decode,
)
from neuron_scheduler.extender.state.plugins import ClusterView, PodsOnly
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import unschedulable
from neuron_scheduler.kube.views import pod_uid, replace_all

MAX_PLACEHOLDERS = 10_000  # beyond this many, new ones are not kept (nor acted on)


def is_placeholder(pod: Pod) -> bool:
    return (
        PLACEHOLDER_LABEL in pod.metadata.labels
        and pod.spec.schedulerName == PLACEHOLDER_SCHEDULER
        and not pod.spec.nodeName
    )


@dataclass(frozen=True, slots=True)
class Placeholder:
    namespace: str
    name: str
    uid: str
    owner: str  # the extender that made it (its label's value)
    asked: Asked | None  # None: a record that does not decode
    problem: str = ""  # why it does not
    unschedulable: bool = False  # its PodScheduled=False/Unschedulable condition is written

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class Placeholders(PodsOnly):
    """Every placeholder pod, by uid (fed with placeholder pods only); those of `namespace` only,
    when one is given."""

    def __init__(self, namespace: str | None = None, limit: int = MAX_PLACEHOLDERS) -> None:
        self.namespace = namespace
        self.limit = limit
        self.pods: dict[str, Placeholder] = {}

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        replace_all(pods, pod_uid, self.apply_pod, self.pods, self.remove_pod)

    def apply_pod(self, pod: Pod) -> None:
        meta = pod.metadata
        if (
            not is_placeholder(pod)
            or pod.finished
            or meta.deletionTimestamp is not None
            or (self.namespace is not None and meta.namespace != self.namespace)
        ):
            self.pods.pop(meta.uid, None)
            return
        if meta.uid not in self.pods and len(self.pods) >= self.limit:
            return
        text = meta.annotations.get(RECORD_ANNOTATION, "")
        try:
            asked: Asked | None = decode(text)
            problem = ""
        except PlaceholderError as error:
            asked, problem = None, str(error)
        owner = meta.labels.get(PLACEHOLDER_LABEL, "")
        self.pods[meta.uid] = Placeholder(
            meta.namespace, meta.name, meta.uid, owner, asked, problem, unschedulable(pod)
        )

    def remove_pod(self, uid: str) -> None:
        self.pods.pop(uid, None)

    def for_pod(self, uid: str) -> list[Placeholder]:
        """The placeholders that ask for a node for this pod."""
        return [p for p in self.pods.values() if p.asked is not None and p.asked.uid == uid]


class PodRouter(PodsOnly):
    """What the pod watch feeds: every pod to `views`, but a placeholder to `placeholders` only
    (and out of the views, should a pod become one)."""

    def __init__(self, views: Sequence[ClusterView], placeholders: Placeholders) -> None:
        self.views = tuple(views)
        self.placeholders = placeholders

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        listed = list(pods)
        self.placeholders.replace_pods([p for p in listed if is_placeholder(p)])
        rest = [p for p in listed if not is_placeholder(p)]
        for view in self.views:
            view.replace_pods(rest, listed_since)

    def apply_pod(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        if is_placeholder(pod):
            if uid not in self.placeholders.pods:
                for view in self.views:
                    view.remove_pod(uid)
            self.placeholders.apply_pod(pod)
            return
        self.placeholders.remove_pod(uid)
        for view in self.views:
            view.apply_pod(pod)

    def remove_pod(self, uid: str) -> None:
        self.placeholders.remove_pod(uid)
        for view in self.views:
            view.remove_pod(uid)
