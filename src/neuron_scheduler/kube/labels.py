"""Label selectors (metav1.LabelSelector) as the API server matches them. Pure."""

from __future__ import annotations

from collections.abc import Mapping

from neuron_scheduler.kube.objects import LabelSelector, LabelSelectorRequirement


def selects(selector: LabelSelector | None, labels: Mapping[str, str]) -> bool:
    """A nil selector selects nothing; an empty one everything (PodDisruptionBudget rules)."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in selector.matchLabels.items()):
        return False
    return all(_matches(r, labels) for r in selector.matchExpressions)


def _matches(requirement: LabelSelectorRequirement, labels: Mapping[str, str]) -> bool:
    present = requirement.key in labels
    if requirement.operator == "In":
        return present and labels[requirement.key] in requirement.values
    if requirement.operator == "NotIn":
        return not present or labels[requirement.key] not in requirement.values
    if requirement.operator == "Exists":
        return present
    if requirement.operator == "DoesNotExist":
        return not present
    return False  # an operator the API server would not have admitted
