"""PodDisruptionBudgets, to count how many of a preemption's victims would break one. No I/O.

Counted as kube-scheduler counts them when it picks victims: each victim a budget selects uses one
of the disruptions it allows; a victim that finds a budget with none left is a violation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from neuron_scheduler.kube.labels import selects
from neuron_scheduler.kube.objects import PodDisruptionBudget
from neuron_scheduler.kube.views import replace_all


def _key(budget: PodDisruptionBudget) -> str:
    return f"{budget.metadata.namespace}/{budget.metadata.name}"


class DisruptionBudgets:
    """Fed by a watch of policy/v1 PodDisruptionBudgets."""

    def __init__(self) -> None:
        self._budgets: dict[str, PodDisruptionBudget] = {}

    def apply(self, budget: PodDisruptionBudget) -> None:
        self._budgets[_key(budget)] = budget

    def remove(self, key: str) -> None:
        self._budgets.pop(key, None)

    def replace(self, budgets: Iterable[PodDisruptionBudget]) -> None:
        replace_all(budgets, _key, self.apply, self._budgets, self.remove)

    def violations(self, victims: Sequence[tuple[str, Mapping[str, str]]]) -> int:
        """How many of these pods ((namespace, labels), in the order they would go) find a
        budget that selects them with no disruption left."""
        allowed: dict[str, int] = {}
        count = 0
        for namespace, labels in victims:
            violates = False
            for key, budget in self._budgets.items():
                if budget.metadata.namespace != namespace or not selects(
                    budget.spec.selector, labels
                ):
                    continue
                left = allowed.setdefault(key, budget.status.disruptionsAllowed) - 1
                allowed[key] = left
                violates = violates or left < 0
            count += violates
        return count
