"""Kueue's objects as the placement admission check reads them (kueue.x-k8s.io/v1beta2, the
version Kueue v0.17.0 stores and serves besides v1beta1), and what they mean. Pure.

Only the fields the check uses are decoded (Kueue's types: sigs.k8s.io/kueue@v0.17.0
apis/kueue/v1beta2). Everything here is read from the API and untrusted: the API server's own
validation (at most 8 pod sets, 8 check states, 16 conditions) is checked again, and what no
validation bounds (a pod set's count, a topology assignment's domains) is bounded here, with an
error that says which bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from neuron_scheduler.kube.objects import ObjectMeta, Pod, PodSpec, PodStatus, Toleration
from neuron_scheduler.kube.reading import (
    KUEUE_POD_GROUP_LABEL,
    KUEUE_QUEUE_LABEL,
    KUEUE_WORKLOAD_ANNOTATION,
)

GROUP_VERSION = "kueue.x-k8s.io/v1beta2"
# The controller name the extender's leader answers for (an AdmissionCheck's spec.controllerName).
CONTROLLER_NAME = "neuron-scheduler.io/placement"
# Kueue's labels on the pods of an admitted workload (v0.17: AssignQueueLabelsForPods, on by
# default; pkg/constants): its pod set, and its ClusterQueue.
KUEUE_PODSET_LABEL = "kueue.x-k8s.io/podset"
KUEUE_CLUSTER_QUEUE_LABEL = "kueue.x-k8s.io/cluster-queue"

# What the check's podSetUpdates put on an admitted workload's pods: its Workload's uid. A pod
# carrying it may take the blocks held for that workload in its own namespace (`hold_owner`).
WORKLOAD_UID_ANNOTATION = "neuron-scheduler.io/kueue-workload-uid"
MAX_UID = 128

READY = "Ready"
RETRY = "Retry"
PENDING = "Pending"
REJECTED = "Rejected"

MAX_POD_SETS = 8  # Kueue's validation: spec.podSets, status.admission.podSetAssignments
MAX_CHECKS = 8  # status.admissionChecks
MAX_PODS = 10_000  # pods of one workload the check places (a pod set's count has no bound)
MAX_DOMAINS = 10_000  # topology domains of one pod set's assignment
MAX_NAME = 253
MAX_LEVELS = 16


class KueueError(ValueError):
    """A Workload the check cannot read as Kueue writes one; the message says what."""


class Condition(msgspec.Struct):
    type: str = ""
    status: str = ""
    reason: str = ""
    message: str = ""
    lastTransitionTime: str = ""


class PodTemplate(msgspec.Struct):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: PodSpec = msgspec.field(default_factory=PodSpec)


class PodSet(msgspec.Struct):
    name: str = "main"
    count: int = 1
    template: PodTemplate = msgspec.field(default_factory=PodTemplate)


class WorkloadSpec(msgspec.Struct):
    podSets: list[PodSet] = []
    queueName: str = ""
    priority: int | None = None
    active: bool | None = None


class IndividualValues(msgspec.Struct):
    prefix: str | None = None
    suffix: str | None = None
    roots: list[str] = []


class LevelValues(msgspec.Struct):
    universal: str | None = None
    individual: IndividualValues | None = None


class PodCounts(msgspec.Struct):
    universal: int | None = None
    individual: list[int] = []


class AssignmentSlice(msgspec.Struct):
    domainCount: int = 0
    valuesPerLevel: list[LevelValues] = []
    podCounts: PodCounts = msgspec.field(default_factory=PodCounts)


class TopologyAssignment(msgspec.Struct):
    levels: list[str] = []
    slices: list[AssignmentSlice] = []


class PodSetAssignment(msgspec.Struct):
    name: str = "main"
    flavors: dict[str, str] = {}
    count: int | None = None
    topologyAssignment: TopologyAssignment | None = None


class Admission(msgspec.Struct):
    clusterQueue: str = ""
    podSetAssignments: list[PodSetAssignment] = []


class PodSetUpdate(msgspec.Struct, omit_defaults=True):
    name: str = ""
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    nodeSelector: dict[str, str] = {}
    tolerations: list[Toleration] = []


class CheckState(msgspec.Struct):
    name: str = ""
    state: str = ""
    message: str = ""
    lastTransitionTime: str = ""
    requeueAfterSeconds: int | None = None
    retryCount: int | None = None
    podSetUpdates: list[PodSetUpdate] = []


class WorkloadStatus(msgspec.Struct):
    conditions: list[Condition] = []
    admission: Admission | None = None
    admissionChecks: list[CheckState] = []


class Workload(msgspec.Struct):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: WorkloadSpec = msgspec.field(default_factory=WorkloadSpec)
    status: WorkloadStatus = msgspec.field(default_factory=WorkloadStatus)

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"


class WorkloadState(msgspec.Struct):
    """A Workload read without its pod sets: what `why` shows of it (a pod template our PodSpec
    cannot read does not keep its status from being shown)."""

    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    status: WorkloadStatus = msgspec.field(default_factory=WorkloadStatus)

    @property
    def key(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"


class CheckSpec(msgspec.Struct):
    controllerName: str = ""


class CheckStatus(msgspec.Struct):
    conditions: list[Condition] = []


class AdmissionCheck(msgspec.Struct):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: CheckSpec = msgspec.field(default_factory=CheckSpec)
    status: CheckStatus = msgspec.field(default_factory=CheckStatus)


class FlavorSpec(msgspec.Struct):
    nodeLabels: dict[str, str] = {}
    tolerations: list[Toleration] = []
    topologyName: str | None = None


class ResourceFlavor(msgspec.Struct):
    metadata: ObjectMeta = msgspec.field(default_factory=ObjectMeta)
    spec: FlavorSpec = msgspec.field(default_factory=FlavorSpec)


# --- what a Workload says ------------------------------------------------------------------------


def condition(conditions: list[Condition], kind: str) -> Condition | None:
    for found in conditions:
        if found.type == kind:
            return found
    return None


def is_true(conditions: list[Condition], kind: str) -> bool:
    found = condition(conditions, kind)
    return found is not None and found.status == "True"


def quota_reserved(workload: Workload | WorkloadState) -> bool:
    """Kueue reserved quota for it in a ClusterQueue (and says which flavors)."""
    status = workload.status
    return status.admission is not None and is_true(status.conditions, "QuotaReserved")


def admitted(workload: Workload | WorkloadState) -> bool:
    return is_true(workload.status.conditions, "Admitted")


def over(workload: Workload) -> str | None:
    """Why nothing is held for the workload any more, whatever its checks say: evicted (and why),
    finished, deactivated, deleted; None while it stands."""
    meta, status = workload.metadata, workload.status
    if meta.deletionTimestamp:
        return "deleted"
    if is_true(status.conditions, "Finished"):
        return "finished"
    evicted = condition(status.conditions, "Evicted")
    if evicted is not None and evicted.status == "True":
        return f"evicted ({evicted.reason or 'no reason given'})"
    if workload.spec.active is False:
        return "deactivated"
    return None


def check_state(workload: Workload, name: str) -> CheckState | None:
    for state in workload.status.admissionChecks:
        if state.name == name:
            return state
    return None


def readable(workload: Workload) -> None:
    """KueueError when the workload's shape is not one Kueue's validation lets through."""
    spec, status = workload.spec, workload.status
    if not 1 <= len(spec.podSets) <= MAX_POD_SETS:
        raise KueueError(f"{len(spec.podSets)} pod sets (Kueue allows 1 to {MAX_POD_SETS})")
    if len(status.admissionChecks) > MAX_CHECKS:
        raise KueueError(f"{len(status.admissionChecks)} admission check states")
    total = 0
    for pod_set in spec.podSets:
        if not 0 < len(pod_set.name) <= 63 or pod_set.count < 0:
            raise KueueError(f"pod set {pod_set.name[:63]!r} of count {pod_set.count}")
        total += pod_set.count
    if total > MAX_PODS:
        raise KueueError(f"{total} pods (the check places {MAX_PODS} at most)")
    admission = status.admission
    if admission is not None and len(admission.podSetAssignments) > MAX_POD_SETS:
        raise KueueError(f"{len(admission.podSetAssignments)} pod set assignments")


# --- topology assignments --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Domain:
    """Where Kueue's topology assignment puts `count` pods: nodes with these labels."""

    selector: tuple[tuple[str, str], ...]  # (level, value), broadest first
    count: int

    @property
    def text(self) -> str:
        return ", ".join(f"{key}={value}" for key, value in self.selector)


def domains(assignment: TopologyAssignment) -> list[Domain]:
    """The domains of a topology assignment, with their pod counts (Kueue's compact form
    unfolded: prefix and suffix around each root, universal values and counts). KueueError for a
    shape Kueue would not write, or more than MAX_DOMAINS domains."""
    levels = assignment.levels
    if not 1 <= len(levels) <= MAX_LEVELS or any(not 0 < len(k) <= 317 for k in levels):
        raise KueueError(f"a topology assignment of {len(levels)} levels")
    found: list[Domain] = []
    for part in assignment.slices:
        count = part.domainCount
        if count < 1 or len(found) + count > MAX_DOMAINS:
            raise KueueError(f"a topology assignment of more than {MAX_DOMAINS} domains")
        if len(part.valuesPerLevel) != len(levels):
            raise KueueError("a topology assignment slice without a value for each level")
        columns = [_values(values, count) for values in part.valuesPerLevel]
        counts = part.podCounts
        if counts.universal is not None:
            pods = [counts.universal] * count
        elif len(counts.individual) == count:
            pods = list(counts.individual)
        else:
            raise KueueError("a topology assignment slice without a pod count for each domain")
        if any(not 0 < n <= MAX_PODS for n in pods):
            raise KueueError("a topology assignment with a pod count out of range")
        for index in range(count):
            selector = tuple(
                (level, column[index]) for level, column in zip(levels, columns, strict=True)
            )
            found.append(Domain(selector, pods[index]))
    return found


def _values(values: LevelValues, count: int) -> list[str]:
    if values.universal is not None:
        if len(values.universal) > 63:
            raise KueueError("a topology value longer than a label value")
        return [values.universal] * count
    individual = values.individual
    if individual is None or len(individual.roots) != count:
        raise KueueError("a topology assignment level without a value for each domain")
    prefix, suffix = individual.prefix or "", individual.suffix or ""
    unfolded = [f"{prefix}{root}{suffix}" for root in individual.roots]
    if any(not 0 < len(v) <= MAX_NAME for v in unfolded):
        raise KueueError("a topology value that is no label value")
    return unfolded


# --- the pods a pod set makes -------------------------------------------------------------------


def pod_of(
    workload: Workload,
    pod_set: PodSet,
    node_labels: dict[str, str],
    tolerations: list[Toleration],
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> Pod:
    """A pod as the pod set's will be once admitted: its template, in the workload's namespace,
    with its flavor's node labels as nodeSelector and its tolerations (as Kueue merges them at
    admission), and `labels` and `annotations` (what the job's controller adds to every pod it
    makes; a plain pod's own)."""
    meta, spec = pod_set.template.metadata, pod_set.template.spec
    selector = {**spec.nodeSelector, **node_labels}
    return Pod(
        metadata=msgspec.structs.replace(
            meta,
            name=f"{workload.metadata.name}-{pod_set.name}"[:MAX_NAME],
            namespace=workload.metadata.namespace,
            uid=f"{workload.metadata.uid}/{pod_set.name}",
            labels={**meta.labels, **(labels or {})},
            annotations={**meta.annotations, **(annotations or {})},
            ownerReferences=(),
        ),
        spec=msgspec.structs.replace(
            spec,
            nodeSelector=selector,
            tolerations=(*spec.tolerations, *tolerations),
            nodeName="",
            schedulingGates=(),
        ),
        status=PodStatus(),
    )


def kueue_managed(pod: Pod) -> bool:
    """The pod is one of a workload Kueue manages: Kueue wrote its workload or pod set on it at
    admission, or it names a LocalQueue (a plain pod or pod group, which Kueue gates until
    admitted). Read from the pod: a pod that says so only gives up the extender's preemption
    for itself (docs/kueue.md)."""
    meta = pod.metadata
    return bool(
        meta.annotations.get(KUEUE_WORKLOAD_ANNOTATION)
        or meta.labels.get(KUEUE_QUEUE_LABEL)
        or meta.labels.get(KUEUE_PODSET_LABEL)
        or meta.labels.get(KUEUE_POD_GROUP_LABEL)
    )


def hold_owner(pod: Pod) -> str:
    """Whose held blocks the pod may take: `kueue:<namespace>/<workload uid>` from the
    annotation the placement check's podSetUpdates give an admitted workload's pods, "" for a
    pod without it (or with a value no uid could be). The pod's own namespace is part of it: a
    pod names only a workload of its namespace."""
    value = pod.metadata.annotations.get(WORKLOAD_UID_ANNOTATION, "")
    if not value or len(value) > MAX_UID or not value.isprintable():
        return ""
    return workload_owner(pod.metadata.namespace, value)


def workload_owner(namespace: str, uid: str) -> str:
    """The owner of the blocks held for a workload (ledger Nomination.owner)."""
    return f"kueue:{namespace}/{uid}"
