"""The points where the extender is extended, shaped like kube-scheduler's informer handlers and
framework plugins. The ledger is one of each; the training-job unit rule is another
(`neuron_scheduler.jobs.placement`). `serve` wires them; nothing here imports a plugin.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from neuron_scheduler.core.allocation import Placement
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.kube.objects import Node, Pod


class ClusterView(Protocol):
    """Fed by the node and pod watches (a full list replaces, then changes one by one)."""

    def replace_nodes(self, nodes: Iterable[Node]) -> None: ...

    def apply_node(self, node: Node) -> None: ...

    def remove_node(self, name: str) -> None: ...

    def replace_pods(self, pods: Iterable[Pod], listed_since: float) -> None:
        """`listed_since`: when the list was asked for (time.monotonic())."""
        ...

    def apply_pod(self, pod: Pod) -> None: ...

    def remove_pod(self, uid: str) -> None: ...


class PodsOnly:
    """A ClusterView's node half, for views that keep only pods."""

    def replace_nodes(self, nodes: Iterable[Node]) -> None:
        pass

    def apply_node(self, node: Node) -> None:
        pass

    def remove_node(self, name: str) -> None:
        pass


class NodeFilter(Protocol):
    """Narrows the nodes that passed the device check (filter runs it after the allocator)."""

    # The label of the filter-outcome metric for the nodes it fails.
    @property
    def outcome(self) -> str: ...

    def filter(self, pod: Pod, passed: list[str], now: float) -> tuple[list[str], dict[str, str]]:
        """(nodes still passing, newly failed node -> reason)."""
        ...

    def admits(self, pod: Pod, node: str, now: float) -> bool:
        """Whether `filter` would pass the pod on this node now; no side effects (the waker
        asks it before waking a pod that fits on the node's devices)."""
        ...


class HoldKeeper(Protocol):
    """Holds devices or nodes for pods that are not bound yet, each until a deadline. Nobody
    reads a hold when it ends, so the waker asks when the next one does and ends it then; the
    keeper tells its listener which nodes got their room back."""

    def seconds_to_next_expiry(self) -> float | None:
        """None: nothing held until a deadline."""
        ...

    def expire(self) -> None: ...


class Reserver(Protocol):
    """Told when bind holds a placement for a pod (before the API calls that make it real) and
    when that hold is given up, so concurrent filters and binds see it taken. As in
    kube-scheduler's Reserve/Unreserve, `unreserve` names the node: it gives up the hold on that
    node only, never one another attempt made elsewhere."""

    def reserve(self, pod: Pod, node: str, placement: Placement) -> None: ...

    def unreserve(self, pod: Pod, node: str) -> None: ...


class RefusalListener(Protocol):
    """Told what filter answered a pod: no node (`refused`, with room it may get later), or
    some (`placed`). The waker keeps the refused pods to wake when room frees."""

    def refused(self, pod: Pod, request: NeuronRequest) -> None: ...

    def placed(self, uid: str) -> None: ...
