"""What `status` says of consolidation: the plans in flight (from their pods' annotations, as the
extender holds them) and the eviction budget left this hour (from its Lease); and of capacity
requests: the placeholders waiting for a node, and the blocks held on nodes that came (plans of
kind capacity). Pure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neuron_scheduler.core.planrecord import PlanKind
from neuron_scheduler.extender.state.placeholders import Placeholders
from neuron_scheduler.extender.state.plans import Plans
from neuron_scheduler.live.snapshot import Budget


@dataclass(frozen=True, slots=True)
class PlanLine:
    pod: str  # namespace/name
    node: str
    devices: tuple[int, ...]
    moved: tuple[str, ...]  # namespace/name of each moved pod
    places_held: int  # moved pods' replacements not bound yet
    seconds_left: float
    kind: PlanKind = PlanKind.CONSOLIDATION


@dataclass(frozen=True, slots=True)
class RequestLine:
    """A placeholder asking the autoscaler for a node."""

    pod: str  # namespace/name of the pod it is for ("" when its record cannot be read)
    placeholder: str  # namespace/name
    instance_type: str
    seconds_asked: float
    seconds_left: float


@dataclass(frozen=True, slots=True)
class ConsolidationView:
    plans: tuple[PlanLine, ...]
    budget: Budget
    left: int | None  # evictions left this hour; None when the budget is not known
    per_hour: int | None
    requests: tuple[RequestLine, ...] = ()


def request_lines(placeholders: Placeholders, now: float) -> tuple[RequestLine, ...]:
    lines = []
    for placeholder in sorted(placeholders.pods.values(), key=lambda p: p.key):
        asked = placeholder.asked
        lines.append(
            RequestLine(
                asked.pod if asked else "",
                placeholder.key,
                asked.instance_type if asked else "",
                max(now - asked.asked, 0.0) if asked else 0.0,
                max(asked.until - now, 0.0) if asked else 0.0,
            )
        )
    return tuple(lines)


def consolidation_view(
    plans: Plans, budget: Budget, now: float, placeholders: Placeholders | None = None
) -> ConsolidationView:
    lines = []
    for active in sorted(plans.in_flight(), key=lambda a: a.record.started):
        record = active.record
        waiting = [v for v in record.victims if v.node and v.uid not in active.satisfied]
        lines.append(
            PlanLine(
                active.key,
                record.node,
                record.devices,
                tuple(v.pod for v in record.victims),
                len(waiting),
                max(record.until - now, 0.0),
                record.kind,
            )
        )
    spent = budget.record
    left = spent.left(now) if spent is not None else None
    return ConsolidationView(
        tuple(lines),
        budget,
        left,
        spent.per_hour if spent is not None else None,
        request_lines(placeholders, now) if placeholders is not None else (),
    )


def consolidation_json(view: ConsolidationView) -> dict[str, Any]:
    """`status --json`'s "consolidation" (docs/operations.md)."""
    return {
        "plans": [
            {
                "pod": p.pod,
                "node": p.node,
                "devices": list(p.devices),
                "moved_pods": list(p.moved),
                "places_held": p.places_held,
                "seconds_left": round(p.seconds_left, 1),
                "kind": p.kind.value,
            }
            for p in view.plans
        ],
        "budget": {
            "lease": view.budget.lease or None,
            "evictions_left_this_hour": view.left,
            "evictions_per_hour": view.per_hour,
            "problem": view.budget.problem or None,
        },
    }


def capacity_json(view: ConsolidationView) -> list[dict[str, Any]]:
    """`status --json`'s "capacity_requests" (docs/operations.md)."""
    return [
        {
            "pod": r.pod or None,
            "placeholder": r.placeholder,
            "instance_type": r.instance_type or None,
            "seconds_asked": round(r.seconds_asked, 1),
            "seconds_left": round(r.seconds_left, 1),
        }
        for r in view.requests
    ]
