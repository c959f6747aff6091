"""The blocks held for the Kueue workloads the placement check admitted, until their pods bind,
and the pods of each that have bound. No I/O: extender/loops/admitting makes and ends the holds;
the pod watch feeds this view.

Each block is a ledger hold (`Ledger.hold`, as consolidation's), owned by the workload
(kube.kueue.workload_owner): every other pod sees it taken, and a pod of the workload, one that
carries the workload's uid in the annotation the check's podSetUpdates gave its pod set
(kube.kueue.WORKLOAD_UID_ANNOTATION) in the workload's namespace, with the block's request, may
take it. When such a pod binds, one block of its request is let go: the one on its node that
overlaps its devices most, else the first (it bound elsewhere: the room it leaves behind is not
needed any more). Training jobs hold their units by claims instead (jobs/claims.py), which
their members pass by their job.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from neuron_scheduler.core.handoff import AnnotationError
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.extender.state.ledger import HOLD_RELEASED, Ledger, Nomination
from neuron_scheduler.extender.state.plugins import PodsOnly
from neuron_scheduler.jobs.members import JobKey
from neuron_scheduler.kube.kueue import hold_owner, workload_owner
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import assignment, servable_request

# Nobody passes these by priority (Ledger._passes): room held for an admitted workload is its
# own until its pods come or the hold ends, whatever the priority of the pod asking.
HOLD_PRIORITY = 2**31 - 1
MAX_BOUND = 100_000  # bound pods remembered across every workload


@dataclass(frozen=True, slots=True)
class HeldBlock:
    node: str
    request: NeuronRequest
    cores: int


@dataclass
class Admitted:
    """A workload the check made Ready, while its pods come."""

    uid: str
    key: str  # namespace/name
    owner: str  # whose blocks (kube.kueue.workload_owner)
    pods: int  # every pod its admission makes
    until: float  # wall clock: its holds end then if its pods have not all bound
    blocks: dict[str, HeldBlock] = field(default_factory=dict)  # ledger hold key -> block
    jobs: tuple[JobKey, ...] = ()  # training jobs whose units its claims hold


class AdmittedHolds(PodsOnly):
    """A ClusterView (pods only): the admitted workloads' holds, and their pods bound."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.admitted: dict[str, Admitted] = {}  # workload uid -> what is held for it
        self._by_owner: dict[str, str] = {}  # owner -> workload uid
        # Pods carrying a workload's uid seen bound, by owner (they came, whatever became of them
        # since), until the workload is forgotten.
        self.bound: dict[str, set[str]] = {}
        self._bound_count = 0

    # --- holds -----------------------------------------------------------------------------

    def hold(
        self,
        uid: str,
        key: str,
        namespace: str,
        blocks: list[HeldBlock],
        pods: int,
        until: float,
        jobs: tuple[JobKey, ...] = (),
    ) -> Admitted:
        self.release(uid)
        owner = workload_owner(namespace, uid)
        admitted = Admitted(uid, key, owner, pods, until, jobs=jobs)
        reason = (
            f"held for Kueue workload {key} (admitted by the placement check) until its pods bind"
        )
        for index, block in enumerate(blocks):
            hold_key = f"kueue/{uid}/{index}"
            admitted.blocks[hold_key] = block
            held = Nomination(
                block.node,
                block.request,
                HOLD_PRIORITY,
                block=block.cores,
                owner=owner,
                reason=reason,
            )
            self.ledger.hold(hold_key, held, pod=key)
        self.admitted[uid] = admitted
        self._by_owner[owner] = uid
        return admitted

    def release(self, uid: str, cause: str = HOLD_RELEASED) -> Admitted | None:
        """Lets go of every block still held for the workload (and forgets it)."""
        admitted = self.admitted.pop(uid, None)
        if admitted is None:
            return None
        self._by_owner.pop(admitted.owner, None)
        for hold_key in admitted.blocks:
            self.ledger.hold(hold_key, None, cause)
        admitted.blocks.clear()
        return admitted

    def forget(self, owner: str) -> None:
        """The workload is gone: its bound pods are no longer counted."""
        self._bound_count -= len(self.bound.pop(owner, ()))

    def came(self, owner: str) -> int:
        """Its pods seen bound so far."""
        return len(self.bound.get(owner, ()))

    # --- pods ------------------------------------------------------------------------------

    def replace_pods(self, pods: Iterable[Pod], listed_since: float = 0.0) -> None:
        for pod in pods:  # (a pod that bound came: nothing is forgotten on a list)
            self.apply_pod(pod)

    def apply_pod(self, pod: Pod) -> None:
        node = pod.spec.nodeName
        if not node or pod.finished or pod.metadata.deletionTimestamp:
            return
        owner = hold_owner(pod)
        if not owner:
            return
        seen = self.bound.setdefault(owner, set())
        if pod.metadata.uid in seen or self._bound_count >= MAX_BOUND:
            return
        seen.add(pod.metadata.uid)
        self._bound_count += 1
        uid = self._by_owner.get(owner)
        admitted = self.admitted.get(uid) if uid is not None else None
        if admitted is not None:
            self._take(admitted, pod, node)

    def remove_pod(self, uid: str) -> None:
        pass  # a pod that bound came, whatever became of it since

    def _take(self, admitted: Admitted, pod: Pod, node: str) -> None:
        request = servable_request(pod)
        mine = [k for k, b in admitted.blocks.items() if b.request == request]
        if not mine:
            return
        cores = self._cores(pod, node)
        here = [k for k in mine if admitted.blocks[k].node == node]
        if here:
            chosen = max(here, key=lambda k: ((admitted.blocks[k].cores & cores).bit_count(), k))
        else:
            chosen = mine[0]
        del admitted.blocks[chosen]
        self.ledger.hold(chosen, None, HOLD_RELEASED)

    def _cores(self, pod: Pod, node: str) -> int:
        entry = self.ledger.nodes.get(node)
        try:
            found = assignment(pod, entry.topology.cores_per_device if entry else None)
        except AnnotationError:
            return 0
        return found.core_mask if found is not None else 0
