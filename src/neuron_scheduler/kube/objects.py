"""Kubernetes objects as we read them: only the fields this project uses, decoded with msgspec.

Wire structs only; what they mean for Neuron placement is in `kube.reading`.

The structs are `gc=False` and their lists tuples: the extender keeps every pod and node it
watches, and the cyclic garbage collector walked each pod's 15 objects on every full collection
(issue 50). They are trees of strings and numbers, so they hold no cycle to collect; nothing that
refers back to one of them may be put in one (the collector could never free that cycle).
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from neuron_scheduler.core.catalog import INSTANCE_TYPE_LABEL


class OwnerReference(msgspec.Struct, omit_defaults=True, gc=False):
    apiVersion: str = ""
    kind: str = ""
    name: str = ""
    uid: str = ""
    controller: bool | None = None  # the owner that manages (and recreates) the object


class ObjectMeta(msgspec.Struct, omit_defaults=True, gc=False):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    creationTimestamp: str | None = None
    deletionTimestamp: str | None = None
    ownerReferences: tuple[OwnerReference, ...] = ()

    @property
    def controller(self) -> OwnerReference | None:
        """The owner that manages the object (a ReplicaSet for a Deployment's pod), if any."""
        for owner in self.ownerReferences:
            if owner.controller:
                return owner
        return None


class ResourceRequirements(msgspec.Struct, gc=False):
    limits: dict[str, str | int] = {}
    requests: dict[str, str | int] = {}


class EnvVar(msgspec.Struct, gc=False):
    name: str = ""
    value: str = ""  # (valueFrom is not read)


class Container(msgspec.Struct, gc=False):
    name: str = ""
    resources: ResourceRequirements = msgspec.field(default_factory=ResourceRequirements)
    # "Always" on an init container: a sidecar, running beside the app containers.
    restartPolicy: str = ""
    # Read for the size of a training job whose framework says it only there (PET_NNODES).
    env: tuple[EnvVar, ...] = ()


class Toleration(msgspec.Struct, gc=False):
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""


class NodeSelectorRequirement(msgspec.Struct, gc=False):
    key: str = ""
    operator: str = ""
    values: tuple[str, ...] = ()


class NodeSelectorTerm(msgspec.Struct, gc=False):
    matchExpressions: tuple[NodeSelectorRequirement, ...] = ()
    matchFields: tuple[NodeSelectorRequirement, ...] = ()


class NodeSelector(msgspec.Struct, gc=False):
    nodeSelectorTerms: tuple[NodeSelectorTerm, ...] = ()


class NodeAffinity(msgspec.Struct, gc=False):
    requiredDuringSchedulingIgnoredDuringExecution: NodeSelector | None = None


class Affinity(msgspec.Struct, gc=False):
    nodeAffinity: NodeAffinity | None = None


class PodSchedulingGroup(msgspec.Struct, gc=False):
    """The Workload API (Kubernetes 1.36 and later): the PodGroup (scheduling.k8s.io, in the
    pod's namespace) the pod belongs to."""

    podGroupName: str | None = None


class PodResourceClaim(msgspec.Struct, gc=False):
    """One of a pod's DRA claims: a claim by name, or one made for it from a template."""

    name: str = ""
    resourceClaimName: str | None = None
    resourceClaimTemplateName: str | None = None


class PodResourceClaimStatus(msgspec.Struct, gc=False):
    name: str = ""
    resourceClaimName: str | None = None  # the claim made from the template


class PodSchedulingGate(msgspec.Struct, gc=False):
    name: str = ""


class PodSpec(msgspec.Struct, gc=False):
    nodeName: str = ""
    schedulerName: str = ""
    containers: tuple[Container, ...] = ()
    initContainers: tuple[Container, ...] = ()
    # What bind re-checks of kube-scheduler's in-tree filters (kube.nodefit).
    nodeSelector: dict[str, str] = {}
    tolerations: tuple[Toleration, ...] = ()
    affinity: Affinity | None = None
    priority: int | None = None
    # "Never": the pod never preempts (kube-scheduler's rule; the extender's preemption for
    # training jobs honours it too).
    preemptionPolicy: str | None = None
    schedulingGroup: PodSchedulingGroup | None = None
    resourceClaims: tuple[PodResourceClaim, ...] = ()
    # While any is there, kube-scheduler does not try the pod and the extender's loops leave it
    # alone (kube.reading.gated): Kueue holds its pods so until it admits their workload.
    schedulingGates: tuple[PodSchedulingGate, ...] = ()


class PodCondition(msgspec.Struct, gc=False):
    type: str = ""
    status: str = ""
    reason: str = ""


class PodStatus(msgspec.Struct, gc=False):
    phase: str = ""
    # kube-scheduler's PodScheduled=False/Unschedulable tells a pod it could not place.
    conditions: tuple[PodCondition, ...] = ()
    startTime: str | None = None
    # Set by kube-scheduler on a pod it preempted others for: the node it waits to get.
    nominatedNodeName: str = ""
    resourceClaimStatuses: tuple[PodResourceClaimStatus, ...] = ()


class Pod(msgspec.Struct, gc=False):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodSpec = msgspec.field(default_factory=PodSpec)
    status: PodStatus = msgspec.field(default_factory=PodStatus)

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"

    @property
    def finished(self) -> bool:
        # Succeeded and Failed pods have released their devices; kubelet will not restart them.
        return self.status.phase in ("Succeeded", "Failed")

    @property
    def container_names(self) -> list[str]:
        return [c.name for c in self.spec.containers]


class NodeStatus(msgspec.Struct, gc=False):
    capacity: dict[str, str | int] = {}
    allocatable: dict[str, str | int] = {}


class Taint(msgspec.Struct, gc=False):
    key: str = ""
    value: str = ""
    effect: str = ""


class NodeSpec(msgspec.Struct, gc=False):
    taints: tuple[Taint, ...] = ()
    unschedulable: bool = False


class Node(msgspec.Struct, gc=False):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: NodeSpec = msgspec.field(default_factory=NodeSpec)
    status: NodeStatus = msgspec.field(default_factory=NodeStatus)

    @property
    def instance_type(self) -> str:
        return self.metadata.labels.get(INSTANCE_TYPE_LABEL, "")


class NodeList(msgspec.Struct, gc=False):
    items: list[Node] = []


class PodList(msgspec.Struct, gc=False):
    items: list[Pod] = []


class LeaseSpec(msgspec.Struct, omit_defaults=True, gc=False):
    holderIdentity: str | None = None
    leaseDurationSeconds: int | None = None
    acquireTime: str | None = None
    renewTime: str | None = None
    leaseTransitions: int | None = None


class LeaseMeta(msgspec.Struct, omit_defaults=True, gc=False):
    name: str = ""
    namespace: str = ""
    resourceVersion: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}


class Lease(msgspec.Struct, gc=False):
    """A coordination.k8s.io/v1 Lease, written whole (so its apiVersion and kind too)."""

    apiVersion: str = "coordination.k8s.io/v1"
    kind: str = "Lease"
    metadata: LeaseMeta = msgspec.field(default_factory=LeaseMeta)
    spec: LeaseSpec = msgspec.field(default_factory=LeaseSpec)


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """One object, named for an event about it (its `involvedObject`)."""

    kind: str
    namespace: str
    name: str
    uid: str

    @classmethod
    def of_pod(cls, pod: Pod) -> ObjectRef:
        meta = pod.metadata
        return cls("Pod", meta.namespace, meta.name, meta.uid)

    @classmethod
    def of_node(cls, node: Node) -> ObjectRef:
        return cls("Node", "", node.metadata.name, node.metadata.uid)

    @property
    def text(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


class LabelSelectorRequirement(msgspec.Struct):
    key: str = ""
    operator: str = ""
    values: list[str] = []


class LabelSelector(msgspec.Struct):
    matchLabels: dict[str, str] = {}
    matchExpressions: list[LabelSelectorRequirement] = []


class DisruptionBudgetSpec(msgspec.Struct):
    selector: LabelSelector | None = None


class DisruptionBudgetStatus(msgspec.Struct):
    disruptionsAllowed: int = 0


class PodDisruptionBudget(msgspec.Struct):
    """policy/v1: how many of the pods it selects may be disrupted now."""

    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: DisruptionBudgetSpec = msgspec.field(default_factory=DisruptionBudgetSpec)
    status: DisruptionBudgetStatus = msgspec.field(default_factory=DisruptionBudgetStatus)


class GangPolicy(msgspec.Struct):
    minCount: int = 0


class PodGroupPolicy(msgspec.Struct):
    gang: GangPolicy | None = None  # (basic: no gang)


class PodGroupSpec(msgspec.Struct):
    schedulingPolicy: PodGroupPolicy = msgspec.field(default_factory=PodGroupPolicy)


class PodGroup(msgspec.Struct):
    """scheduling.k8s.io v1alpha2 (Kubernetes 1.36, alpha), v1beta1 and v1alpha3 (1.37): a gang's
    size is its minCount, the same field in each."""

    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodGroupSpec = msgspec.field(default_factory=PodGroupSpec)


class ClaimSpec(msgspec.Struct, omit_defaults=True):
    node: str = ""
    namespace: str = ""  # the job's
    job: str = ""
    config: int = 0
    size: int = 0
    slots: int = 1  # members the node takes (omitted, as written before it existed: 1)
    phase: str = ""
    scheduler: str = ""
    renewTime: str = ""  # RFC 3339
    seconds: int = 0
    # Pods (uids) evicted for this job by preemption (issue 40), until its members are bound.
    victims: list[str] = []
    # The jobs (namespace/name) evicted whole for it, until its members are bound.
    victimJobs: list[str] = []
    # Kueue's Workload (uid) the placement admission check claimed it for, before any member
    # existed (docs/kueue.md).
    workload: str = ""


class ClaimMeta(msgspec.Struct, omit_defaults=True):
    name: str = ""
    uid: str = ""
    resourceVersion: str = ""
    labels: dict[str, str] = {}
    creationTimestamp: str = ""  # the API server's (never written by us)


class JobClaim(msgspec.Struct):
    """A training job's claim on one node: neuron-scheduler.io/v1alpha1, cluster-scoped, one per
    node (the chart installs the CRD), written whole, so its apiVersion and kind too. The kind
    keeps its first name, UltraServerClaim, for existing users: it holds any job's nodes."""

    apiVersion: str = "neuron-scheduler.io/v1alpha1"
    kind: str = "UltraServerClaim"
    metadata: ClaimMeta = msgspec.field(default_factory=ClaimMeta)
    spec: ClaimSpec = msgspec.field(default_factory=ClaimSpec)
