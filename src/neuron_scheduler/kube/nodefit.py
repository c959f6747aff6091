"""What kube-scheduler's in-tree filters check of a pod against a node's labels and taints
(NodeName, NodeSelector and required NodeAffinity, TaintToleration, NodeUnschedulable), so bind
can check them again before it writes anything. Pure.

kube-scheduler has already checked all of this for any bind it sends; re-checking costs
microseconds and means a caller who is not kube-scheduler (or a leaked client certificate) still
cannot place a pod where its own spec forbids it.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from neuron_scheduler.kube.objects import (
    Node,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    Pod,
    Taint,
    Toleration,
)

# Taints that keep pods off a node (PreferNoSchedule only steers scoring).
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
UNSCHEDULABLE_TAINT = Taint("node.kubernetes.io/unschedulable", "", "NoSchedule")


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """A node's name, labels and taints: what the rules below read."""

    name: str
    labels: dict[str, str]
    taints: tuple[Taint, ...]

    @classmethod
    def of(cls, node: Node) -> NodeFacts:
        taints = tuple(t for t in node.spec.taints if t.effect in BLOCKING_EFFECTS)
        if node.spec.unschedulable:
            taints += (UNSCHEDULABLE_TAINT,)
        return cls(node.metadata.name, dict(node.metadata.labels), taints)


def why_not(pod: Pod, node: NodeFacts) -> str | None:
    """Why the pod's own spec keeps it off this node, or None when it may go there."""
    for key, value in pod.spec.nodeSelector.items():
        if node.labels.get(key) != value:
            return f"the pod's nodeSelector {key}={value} does not match node {node.name}"
    affinity = pod.spec.affinity.nodeAffinity if pod.spec.affinity else None
    required = affinity.requiredDuringSchedulingIgnoredDuringExecution if affinity else None
    if required is not None and not any(_term(t, node) for t in required.nodeSelectorTerms):
        return f"the pod's required node affinity does not match node {node.name}"
    for taint in node.taints:
        if not any(_tolerates(t, taint) for t in pod.spec.tolerations):
            shown = f"{taint.key}={taint.value}" if taint.value else taint.key
            return f"the pod does not tolerate node {node.name}'s taint {shown}:{taint.effect}"
    return None


def admits_label(pod: Pod, key: str, value: str) -> bool:
    """Whether the pod's nodeSelector and required node affinity let it onto a node whose label
    `key` is `value`, whatever its other labels (a node that does not exist yet: an autoscaler
    gives it the labels its node pool says). Its name is unknown: a term that names nodes
    (`matchFields` on metadata.name) admits it only when it names nodes the pod may not go to."""
    wanted = pod.spec.nodeSelector.get(key)
    if wanted is not None and wanted != value:
        return False
    affinity = pod.spec.affinity.nodeAffinity if pod.spec.affinity else None
    required = affinity.requiredDuringSchedulingIgnoredDuringExecution if affinity else None
    if required is None:
        return True
    return any(
        (t.matchExpressions or t.matchFields)
        and all(_requirement(r, {key: value}) for r in t.matchExpressions if r.key == key)
        and all(r.operator == "NotIn" for r in t.matchFields)
        for t in required.nodeSelectorTerms
    )


def _tolerates(toleration: Toleration, taint: Taint) -> bool:
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if toleration.operator == "Exists":
        return not toleration.key or toleration.key == taint.key
    return toleration.key == taint.key and toleration.value == taint.value


def _term(term: NodeSelectorTerm, node: NodeFacts) -> bool:
    """A term matches when all its requirements do; an empty term matches no node."""
    if not term.matchExpressions and not term.matchFields:
        return False
    fields = {"metadata.name": node.name}
    return all(_requirement(r, node.labels) for r in term.matchExpressions) and all(
        _requirement(r, fields) for r in term.matchFields
    )


def _requirement(requirement: NodeSelectorRequirement, values: dict[str, str]) -> bool:
    present = requirement.key in values
    value = values.get(requirement.key, "")
    operator = requirement.operator
    if operator == "In":
        return present and value in requirement.values
    if operator == "NotIn":
        return not present or value not in requirement.values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and len(requirement.values) == 1:
        try:
            have, bound = int(value), int(requirement.values[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False  # an operator the API server would not have admitted


def placement_kind(pod: Pod) -> bytes:
    """What decides where a pod may run besides the node itself: its requests, what its spec
    says of nodes (the rules above) and its priority (which held devices it sees). Pods of one
    kind are judged alike on a node: callers group them to judge a node once per kind."""
    spec = pod.spec
    return msgspec.json.encode(
        [
            [c.resources for c in spec.containers],
            [c.resources for c in spec.initContainers],
            spec.nodeSelector,
            spec.affinity,
            spec.tolerations,
            spec.priority,
        ]
    )
