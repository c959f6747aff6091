"""Which bound pods an autoscaler's own consolidation must not move, and which it may. No I/O.

Karpenter's consolidation (and cluster-autoscaler's scale-down) simulates by count: a pod whose
only legal block is on its node fits, by count, on a node where it has none. It evicts the pod and
removes the node, the pod is stranded, a capacity request brings a node back: a loop
(docs/autoscaling.md measures it). The pod is marked (`MARKED`: Karpenter's
`karpenter.sh/do-not-disrupt: "true"`, cluster-autoscaler's `safe-to-evict: "false"`) while no
other node it may go to has a legal block for it (`at_risk`), and the mark is lifted when one has
(`MARK` says the mark is ours, and which of the two keys we set: a user's own key is never
touched, and the other key is still ours to set: Karpenter reads only its own, so a user's
`safe-to-evict` must not keep Karpenter's mark off).

`Bound` is a view of the bound pods of the schedulers the extender serves that ask for Neuron
resources, fed by the pod watch; the leader's loop (extender/loops/protecting) writes the marks.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.extender.state.plugins import PodsOnly
from neuron_scheduler.kube.nodefit import why_not
from neuron_scheduler.kube.objects import Pod, PodSpec
from neuron_scheduler.kube.reading import servable_request
from neuron_scheduler.kube.views import pod_uid, replace_all

KARPENTER_DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"
# cluster-autoscaler's: its scale-down simulation counts too (it runs its scheduler without
# extenders), and it leaves a node alone whose pods may not be evicted.
SAFE_TO_EVICT = "cluster-autoscaler.kubernetes.io/safe-to-evict"
# The annotations of a mark, and their values.
MARKED = {KARPENTER_DO_NOT_DISRUPT: "true", SAFE_TO_EVICT: "false"}
# Set with them, by us only: the mark is ours to lift, and its value names the keys we set.
MARK = "neuron-scheduler.io/do-not-disrupt-reason"
MARK_TEXT = "no other node it may go to has a legal block for it"
_SET = " (set: "


def mark_text(keys: Iterable[str]) -> str:
    """MARK's value: why, and which of MARKED's keys are ours."""
    return f"{MARK_TEXT}{_SET}{', '.join(keys)})"


def marked_keys(text: str) -> tuple[str, ...]:
    """The keys MARK's value says we set (only MARKED's: the value is a pod's annotation,
    untrusted); a value naming none, as marks were written at first, means both."""
    _, found, tail = text[:1024].partition(_SET)
    named = {k.strip() for k in tail.rstrip(")").split(",")} if found else set()
    return tuple(k for k in MARKED if k in named) or tuple(MARKED)


MAX_BOUND = 200_000


@dataclass(frozen=True, slots=True)
class BoundPod:
    namespace: str
    name: str
    uid: str
    node: str
    request: NeuronRequest
    priority: int
    rules: Pod  # only what kube.nodefit reads: where it may go
    marked: bool  # our mark is on it
    keys: tuple[str, ...]  # MARKED's keys ours to set and lift: none someone else set

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class Bound(PodsOnly):
    """Bound, unfinished Neuron pods of the served schedulers, by uid. `on_new(uid)` hears of a
    pod first seen bound (the loop judges it at once)."""

    def __init__(
        self, scheduler_names: Collection[str], on_new: Callable[[str], None] | None = None
    ) -> None:
        self.scheduler_names = frozenset(scheduler_names)
        self.on_new = on_new
        self.pods: dict[str, BoundPod] = {}

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        replace_all(pods, pod_uid, self.apply_pod, self.pods, self.remove_pod)

    def apply_pod(self, pod: Pod) -> None:
        meta, spec = pod.metadata, pod.spec
        request = servable_request(pod) if spec.nodeName else None
        if (
            request is None
            or pod.finished
            or meta.deletionTimestamp is not None
            or spec.schedulerName not in self.scheduler_names
        ):
            self.pods.pop(meta.uid, None)
            return
        new = meta.uid not in self.pods
        if new and len(self.pods) >= MAX_BOUND:
            return
        marked = MARK in meta.annotations
        ours = marked_keys(meta.annotations[MARK]) if marked else ()
        keys = tuple(k for k in MARKED if k in ours or k not in meta.annotations)
        self.pods[meta.uid] = BoundPod(
            meta.namespace,
            meta.name,
            meta.uid,
            spec.nodeName,
            request,
            spec.priority or 0,
            Pod(
                spec=PodSpec(
                    nodeSelector=spec.nodeSelector,
                    affinity=spec.affinity,
                    tolerations=spec.tolerations,
                )
            ),
            marked,
            keys,
        )
        if new and self.on_new is not None:
            self.on_new(meta.uid)

    def remove_pod(self, uid: str) -> None:
        self.pods.pop(uid, None)


def at_risk(
    ledger: Ledger,
    pod: BoundPod,
    policy: Policy,
    admits: Callable[[Pod, str], bool] = lambda pod, node: True,
) -> bool:
    """No node but its own that the pod may go to has a legal block for it now (as a pod of its
    priority sees the nodes: blocks held for others of higher priority count)."""
    claimant = Claimant(priority=pod.priority)
    verdicts = ledger.fill_verdicts(ledger.nodes, pod.request, policy, claimant)
    for name in verdicts.fitting():
        if name == pod.node:
            continue
        facts = ledger.facts.get(name)
        if facts is not None and why_not(pod.rules, facts) is not None:
            continue
        if admits(pod.rules, name):
            return False
    return True
