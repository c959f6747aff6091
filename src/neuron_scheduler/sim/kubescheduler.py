"""What kube-scheduler adds to the extender's answers when it picks a node. Pure.

Per pod, kube-scheduler v1.36 (pkg/scheduler/schedule_one.go): its own filters first
(NodeResourcesFit counts each requested resource, by name, against the node's allocatable, and at
most `pods` pods), stopping once `numFeasibleNodesToFind` nodes pass; then the extender's filter;
then, when more than one node is left, each score plugin's 0-100 score times its weight, plus the
extender's 0-10 times its weight times 10; the highest total wins and ties are broken uniformly at
random.

Modelled plugins: NodeResourcesFit's score (LeastAllocated, MostAllocated or
RequestedToCapacityRatio over the configured resources) and NodeResourcesBalancedAllocation (cpu
and memory). Pods without cpu or memory requests count as 100m and 200Mi, as kube-scheduler's
scoring does. The other default plugins (TaintToleration, NodeAffinity, PodTopologySpread,
InterPodAffinity, ImageLocality) score every node of a uniform Neuron fleet alike and change no
choice, so they are left out.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from neuron_scheduler.core.resources import NEURON, NEURONCORE

CPU = "cpu"
MEMORY = "memory"
# kube-scheduler's scoring defaults for pods that request no cpu or memory (util.DefaultMilliCPU...)
NON_ZERO_MILLI_CPU = 100
NON_ZERO_MEMORY = 200 * 1024 * 1024
MAX_NODE_SCORE = 100
MAX_EXTENDER_PRIORITY = 10


class FitStrategy(StrEnum):
    LEAST_ALLOCATED = "LeastAllocated"  # kube-scheduler's default: spread
    MOST_ALLOCATED = "MostAllocated"  # pack
    REQUESTED_TO_CAPACITY_RATIO = "RequestedToCapacityRatio"


@dataclass(frozen=True, slots=True)
class Profile:
    """The parts of a KubeSchedulerConfiguration profile that move pods between nodes."""

    name: str
    fit_strategy: FitStrategy = FitStrategy.LEAST_ALLOCATED
    fit_resources: tuple[tuple[str, int], ...] = ((CPU, 1), (MEMORY, 1))
    fit_weight: int = 1
    # RequestedToCapacityRatio's shape: (utilization %, score 0-10) points, linear between.
    shape: tuple[tuple[int, int], ...] = ((0, 0), (100, 10))
    balanced_weight: int = 1  # NodeResourcesBalancedAllocation over cpu and memory; 0: disabled
    extender_prioritizes: bool = True  # prioritizeVerb set
    extender_weight: int = 1
    # A second prioritize entry (our prioritize-claims-packing, for pods with DRA claims) at this
    # weight: how full each node is once the pod is placed (core.allocation.fullness_score),
    # kube-scheduler's packing tie-break for what NodeResourcesFit cannot count. 0: none.
    packing_weight: int = 0
    percentage_of_nodes_to_score: int = 0  # 0: kube-scheduler's adaptive default


# What kube-scheduler does out of the box, with an extender that filters and binds only (AWS's
# extension has no prioritize verb).
DEFAULT_FILTER_ONLY = Profile(
    "kube-scheduler defaults, extender filter+bind", extender_prioritizes=False
)
# Out of the box, with our prioritize verb at weight 1 (default-scheduler mode without our snippet).
DEFAULT_WITH_PRIORITIZE = Profile("kube-scheduler defaults, extender weight 1")
# The chart's my-scheduler profile (charts/neuron-scheduler/templates/_helpers.tpl, chosen in
# BENCHMARKS.md "Placement quality"): pack Neuron resources node by node, and let the extender's
# topology score decide before any in-tree score can.
CHART = Profile(
    "neuron-scheduler chart",
    fit_strategy=FitStrategy.MOST_ALLOCATED,
    fit_resources=((NEURON, 1), (NEURONCORE, 1)),
    fit_weight=1,
    balanced_weight=0,
    extender_weight=20,
)
PROFILES = {"chart": CHART, "default": DEFAULT_WITH_PRIORITIZE, "filter-only": DEFAULT_FILTER_ONLY}


def scheduler_profile(profile: Profile, scheduler_name: str) -> dict[str, Any]:
    """The KubeSchedulerConfiguration v1 `profiles` entry that makes kube-scheduler score as
    `profile` says (the extender's weight goes in its `extenders` entry). The chart renders the
    same for CHART; tests/e2e/test_chart.py checks the two agree."""
    entry: dict[str, Any] = {"schedulerName": scheduler_name}
    if profile.balanced_weight == 0:
        entry["plugins"] = {"score": {"disabled": [{"name": "NodeResourcesBalancedAllocation"}]}}
    if profile.percentage_of_nodes_to_score:
        entry["percentageOfNodesToScore"] = profile.percentage_of_nodes_to_score
    if profile == replace(profile, **_FIT_DEFAULTS):
        return entry  # NodeResourcesFit as kube-scheduler configures it out of the box
    strategy: dict[str, Any] = {
        "type": str(profile.fit_strategy),
        "resources": [{"name": name, "weight": weight} for name, weight in profile.fit_resources],
    }
    if profile.fit_strategy is FitStrategy.REQUESTED_TO_CAPACITY_RATIO:
        strategy["requestedToCapacityRatio"] = {
            "shape": [{"utilization": u, "score": s} for u, s in profile.shape]
        }
    entry["pluginConfig"] = [{"name": "NodeResourcesFit", "args": {"scoringStrategy": strategy}}]
    if profile.fit_weight != 1:
        entry.setdefault("plugins", {}).setdefault("score", {})["enabled"] = [
            {"name": "NodeResourcesFit", "weight": profile.fit_weight}
        ]
    return entry


_FIT_DEFAULTS: dict[str, Any] = {
    "fit_strategy": FitStrategy.LEAST_ALLOCATED,
    "fit_resources": ((CPU, 1), (MEMORY, 1)),
    "fit_weight": 1,
}


@dataclass(frozen=True, slots=True)
class NodeResources:
    """A node's allocatable as kube-scheduler counts it (milli-CPU, bytes, counts); hashable, so
    nodes alike share their decisions."""

    allocatable: tuple[tuple[str, int], ...]
    pods: int = 110

    def get(self, resource: str) -> int:
        for name, value in self.allocatable:
            if name == resource:
                return value
        return 0


def feasible_nodes_to_find(nodes: int, percentage: int = 0) -> int:
    """numFeasibleNodesToFind: how many nodes pass the in-tree filters before it stops looking."""
    if nodes < 100 or percentage >= 100:
        return nodes
    if percentage <= 0:
        percentage = max(5, 50 - nodes // 125)
    return max(100, nodes * percentage // 100)


def in_tree_score(
    profile: Profile,
    node: NodeResources,
    requested: Mapping[str, int],
    pods: int,
    request: Mapping[str, int],
) -> int:
    """The weighted sum of the modelled score plugins for a pod with `request` on a node whose
    pods (`pods` of them) request `requested` in total (extended resources as counted, cpu and
    memory already with the non-zero defaults)."""
    after = dict(requested)
    for resource, value in request.items():
        after[resource] = after.get(resource, 0) + value
    for resource, default in ((CPU, NON_ZERO_MILLI_CPU), (MEMORY, NON_ZERO_MEMORY)):
        if resource not in request:
            after[resource] = after.get(resource, 0) + default
    total = profile.fit_weight * _fit(profile, node, after, request) if profile.fit_weight else 0
    if profile.balanced_weight:
        total += profile.balanced_weight * _balanced(node, after)
    return total


# kube-scheduler scales an extender's 0-10 to its plugins' 0-100.
EXTENDER_SCALE = MAX_NODE_SCORE // MAX_EXTENDER_PRIORITY


def extender_score(profile: Profile, score: int) -> int:
    if not profile.extender_prioritizes:
        return 0
    return score * profile.extender_weight * EXTENDER_SCALE


def _fit(
    profile: Profile, node: NodeResources, after: Mapping[str, int], request: Mapping[str, int]
) -> int:
    scored = weights = 0
    for resource, weight in profile.fit_resources:
        if resource not in (CPU, MEMORY) and not request.get(resource):
            continue  # extended resources count only for pods that request them
        allocatable = node.get(resource)
        if allocatable <= 0:
            continue  # nor resources the node does not have
        used = min(after.get(resource, 0), allocatable)
        if profile.fit_strategy is FitStrategy.LEAST_ALLOCATED:
            value = (allocatable - used) * MAX_NODE_SCORE // allocatable
        elif profile.fit_strategy is FitStrategy.MOST_ALLOCATED:
            value = used * MAX_NODE_SCORE // allocatable
        else:
            value = _shape(profile.shape, used * MAX_NODE_SCORE // allocatable)
        scored += value * weight
        weights += weight
    return scored // weights if weights else 0


def _shape(points: tuple[tuple[int, int], ...], utilization: int) -> int:
    """RequestedToCapacityRatio's broken-line function, scores scaled 0-10 -> 0-100."""
    if utilization <= points[0][0]:
        return points[0][1] * 10
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if utilization <= x1:
            return (y0 * 10) + (y1 - y0) * 10 * (utilization - x0) // max(x1 - x0, 1)
    return points[-1][1] * 10


def _balanced(node: NodeResources, after: Mapping[str, int]) -> int:
    fractions = []
    for resource in (CPU, MEMORY):
        allocatable = node.get(resource)
        if allocatable > 0:
            fractions.append(min(after.get(resource, 0) / allocatable, 1.0))
    if len(fractions) < 2:
        return MAX_NODE_SCORE
    deviation = abs(fractions[0] - fractions[1]) / 2  # the std dev of two values
    return int((1 - deviation) * MAX_NODE_SCORE)
