"""Pending pods of the schedulers the extender binds for, as the pod watch last showed them. No I/O.

kube-scheduler's bind names a pod (namespace, name, uid); bind needs its spec (what it asks for,
where it may go, its containers) and the resourceVersion its writes are conditioned on. Reading
them here rather than from the API saves each bind a round trip, which at 5,000 nodes was a sixth
of the extender's CPU per pod and a third of the API calls bind makes (issue 36,
BENCHMARKS.md). A copy the watch has not caught up with is harmless: bind's first write is
conditioned on the copy's resourceVersion, fails as a Conflict when the pod changed since, and
bind then starts over from the API's copy.

A pod with a scheduling gate is not pending here (kube.reading.gated): kube-scheduler does not
try it, so nothing binds it, and consolidation and capacity requests, which read their candidates
from this view, leave it to whoever gated it (Kueue, until it admits the pod's workload).

A `ClusterView`: the watches feed it like the ledger.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from neuron_scheduler.kube.objects import Node, Pod
from neuron_scheduler.kube.reading import gated

# Beyond this many pending pods, new ones are not kept (their binds read them from the API).
MAX_PENDING = 100_000


class PendingPods:
    def __init__(self, scheduler_names: Collection[str], limit: int = MAX_PENDING) -> None:
        self.scheduler_names = frozenset(scheduler_names)
        self.limit = limit
        self._pods: dict[str, Pod] = {}  # uid -> the pod as last seen, unbound

    def get(self, uid: str) -> Pod | None:
        return self._pods.get(uid)

    def items(self) -> Iterable[tuple[str, Pod]]:
        return self._pods.items()

    def __len__(self) -> int:
        return len(self._pods)

    def _kept(self, pod: Pod) -> bool:
        return (
            not pod.spec.nodeName
            and not pod.finished
            and pod.metadata.deletionTimestamp is None
            and pod.spec.schedulerName in self.scheduler_names
            # Not pending for consolidation or capacity requests until its gates are gone.
            and not gated(pod)
        )

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        self._pods = {}
        for pod in pods:
            self.apply_pod(pod)

    def apply_pod(self, pod: Pod) -> None:
        uid = pod.metadata.uid
        if self._kept(pod) and (uid in self._pods or len(self._pods) < self.limit):
            self._pods[uid] = pod
        else:
            self._pods.pop(uid, None)

    def remove_pod(self, uid: str) -> None:
        self._pods.pop(uid, None)

    # Nodes do not matter here.
    def replace_nodes(self, nodes: Iterable[Node]) -> None:
        pass

    def apply_node(self, node: Node) -> None:
        pass

    def remove_node(self, name: str) -> None:
        pass
