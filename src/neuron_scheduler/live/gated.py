"""Pending Neuron pods held back by scheduling gates, by what holds them: Kueue's Workloads (with
their LocalQueue, and what Kueue says of each: quota, admission, its checks' states), or other
gates. Nothing is reserved, planned or asked for them until the gates are removed
(kube.reading.gated), so `status` lists them apart from the jobs that wait for room.
Pure: the listed pods and Workloads go in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from neuron_scheduler.kube.kueue import WorkloadState
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.kube.reading import Gating, gating, servable_request
from neuron_scheduler.live.workloadstatus import WorkloadReport, report_json, report_of

MAX_GROUPS = 200  # listed; the rest are counted


@dataclass(frozen=True, slots=True)
class GatedGroup:
    gating: Gating  # the gates, and Kueue's Workload and LocalQueue, shared by its pods
    pods: int
    requests: tuple[tuple[str, int], ...]  # (resource, total asked by its pods), by resource
    # What Kueue says of its Workload (with_workloads); None without one, or before it is read.
    workload: WorkloadReport | None = None

    @property
    def text(self) -> str:
        asked = ", ".join(f"{count} {resource}" for resource, count in self.requests)
        where = "" if self.gating.workload else f" (namespace {self.gating.namespace})"
        return f"{self.gating.text}{where}: {self.pods} pod{'s' if self.pods != 1 else ''}, {asked}"


@dataclass(frozen=True, slots=True)
class GatedPods:
    groups: tuple[GatedGroup, ...] = ()  # the first MAX_GROUPS, by namespace and workload
    pods: int = 0  # every gated Neuron pod, listed or not
    more_groups: int = 0


def gated_view(pods: Iterable[Pod], limit: int = MAX_GROUPS) -> GatedPods:
    """The unbound, unfinished pods with a Neuron request and a scheduling gate."""
    found: dict[Gating, dict[str, int]] = {}
    counts: dict[Gating, int] = {}
    total = 0
    for pod in pods:
        held = gating(pod)
        if held is None or pod.spec.nodeName or pod.finished or pod.metadata.deletionTimestamp:
            continue
        request = servable_request(pod)
        if request is None:
            continue
        total += 1
        asked = found.setdefault(held, {})
        asked[request.resource] = asked.get(request.resource, 0) + request.count
        counts[held] = counts.get(held, 0) + 1
    ordered = sorted(found, key=lambda g: (g.namespace, g.workload, g.gates))
    groups = tuple(
        GatedGroup(held, counts[held], tuple(sorted(found[held].items())))
        for held in ordered[:limit]
    )
    return GatedPods(groups, total, max(len(ordered) - limit, 0))


def with_workloads(
    view: GatedPods, workloads: Mapping[tuple[str, str], WorkloadState | str]
) -> GatedPods:
    """Each Kueue group with what Kueue says of its Workload: `workloads` holds each Workload
    read, by namespace and name, or why it could not be read."""
    groups = []
    for group in view.groups:
        held = group.gating
        if held.workload:
            read = workloads[held.namespace, held.workload]
            report = report_of(f"{held.namespace}/{held.workload}", read)
            group = dataclasses.replace(group, workload=report)
        groups.append(group)
    return dataclasses.replace(view, groups=tuple(groups))


def gated_json(view: GatedPods) -> dict[str, Any]:
    return {
        "pods": view.pods,
        "groups": [
            {
                "namespace": g.gating.namespace,
                "gates": list(g.gating.gates),
                "more_gates": g.gating.more,
                "kueue_workload": g.gating.workload or None,
                "kueue_queue": g.gating.queue or None,
                "pods": g.pods,
                "requests": [{"resource": r, "count": c} for r, c in g.requests],
                "kueue_workload_status": report_json(g.workload) if g.workload else None,
            }
            for g in view.groups
        ],
        "more_groups": view.more_groups,
    }
