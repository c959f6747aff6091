"""The consolidation plan as it is persisted: one annotation on the pending pod it is for
(`PLAN_ANNOTATION`), JSON. Pure.

A plan of kind `capacity` moves nothing: it holds a block on a node the autoscaler added for the
pod at a capacity request (extender/loops/requesting), with the same lifetime and the same holds
as a consolidation plan's block.

Written before anything is evicted, so a restarted extender (or the next leader) rebuilds every
hold of a plan from the pod watch alone: the block held for the pod, and the place held for each
moved pod's replacement (matched by its controller's uid and its request). `kubectl neuron status`
reads the same annotation. Read from the API, so untrusted: sizes, ids and names are bounded, and
anything malformed decodes to PlanError (the plan is then ignored, and removed by the leader).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

import msgspec

from neuron_scheduler.core.ids import format_ids, parse_id_ranges
from neuron_scheduler.core.resources import RESOURCE_UNITS, NeuronRequest
from neuron_scheduler.core.topology import MAX_CORES

PLAN_ANNOTATION = "neuron-scheduler.io/consolidation"
VERSION = 1
MAX_VICTIMS = 64
# No plan the extender writes lasts longer (--consolidation-plan-seconds is at most 3600, a
# capacity hold 300 s): a longer one was not written by it, and would hold a block for as long.
MAX_LIFETIME = 3600.0
MAX_TEXT = 320  # a namespace/name or a node name, with room
IDS = re.compile(r"[0-9]{1,5}(-[0-9]{1,5})?(,[0-9]{1,5}(-[0-9]{1,5})?){0,255}")


class PlanError(ValueError):
    """The annotation is not a plan this version can read."""


class PlanKind(StrEnum):
    CONSOLIDATION = "consolidation"  # pods are moved to free the block
    CAPACITY = "capacity"  # the block is on a node added for the pod: nothing moves


@dataclass(frozen=True, slots=True)
class Replacement:
    """One moved pod: who it was, and where its replacement's place is held."""

    uid: str  # the evicted pod's
    pod: str  # its namespace/name
    owner: str  # its controller's uid: its replacement has the same
    request: NeuronRequest
    node: str = ""  # "" when no place is held (a lower-priority pod that may go without)
    cores: tuple[int, ...] = ()
    priority: int = 0  # its (and its replacement's) priority: a higher one may take the place


@dataclass(frozen=True, slots=True)
class PlanRecord:
    node: str
    devices: tuple[int, ...]  # the block freed for the pod
    cores: tuple[int, ...]
    started: float  # wall clock (epoch seconds)
    until: float  # every hold of the plan ends then at the latest
    victims: tuple[Replacement, ...]
    kind: PlanKind = PlanKind.CONSOLIDATION

    @property
    def summary(self) -> str:
        """`would evict a/b, c/d from node X to free devices 4-7`'s tail: the victims and
        the block (for a capacity hold: the block on the node added)."""
        devices = format_ids(list(self.devices))
        if self.kind is PlanKind.CAPACITY:
            return f"devices {devices} of node {self.node}, added at a capacity request"
        names = ", ".join(v.pod for v in self.victims)
        return f"{names} from node {self.node} to free devices {devices}"


class _Victim(msgspec.Struct, forbid_unknown_fields=False):
    uid: str
    pod: str
    owner: str
    resource: str
    count: int
    node: str = ""
    cores: str = ""
    priority: int = 0


class _Plan(msgspec.Struct, forbid_unknown_fields=False):
    v: int
    node: str
    devices: str
    cores: str
    started: float
    until: float
    victims: list[_Victim]
    kind: str = PlanKind.CONSOLIDATION.value  # (absent: a plan of version 1 before capacity)


def encode(plan: PlanRecord) -> str:
    return msgspec.json.encode(
        _Plan(
            VERSION,
            plan.node,
            format_ids(list(plan.devices)),
            format_ids(list(plan.cores)),
            round(plan.started, 3),
            round(plan.until, 3),
            [
                _Victim(
                    v.uid,
                    v.pod,
                    v.owner,
                    v.request.resource,
                    v.request.count,
                    v.node,
                    format_ids(list(v.cores)) if v.node else "",
                    v.priority,
                )
                for v in plan.victims
            ],
            plan.kind.value,
        )
    ).decode()


def decode(text: str) -> PlanRecord:
    if len(text) > 64 * 1024:
        raise PlanError("the plan is over 64 KiB")
    try:
        raw = msgspec.json.decode(text, type=_Plan)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as error:
        raise PlanError(f"not a plan: {error}") from error
    if raw.v != VERSION:
        raise PlanError(f"plan version {raw.v}, not {VERSION}")
    try:
        kind = PlanKind(raw.kind)
    except ValueError:
        raise PlanError(f"a plan of kind {raw.kind[:40]!r}") from None
    if kind is PlanKind.CAPACITY and raw.victims:
        raise PlanError("a capacity request's hold moves no pods")
    if kind is PlanKind.CONSOLIDATION and not 0 < len(raw.victims) <= MAX_VICTIMS:
        raise PlanError(f"a plan moves 1 to {MAX_VICTIMS} pods, not {len(raw.victims)}")
    if not raw.until > raw.started > 0:
        raise PlanError("the plan's times are not in order")
    if raw.until - raw.started > MAX_LIFETIME:
        raise PlanError(f"a plan lasts {MAX_LIFETIME:.0f} s at most")
    victims = []
    for victim in raw.victims:
        if victim.resource not in RESOURCE_UNITS or not 0 < victim.count <= MAX_CORES:
            raise PlanError(f"bad request {victim.resource}: {victim.count}")
        cores = _ids(victim.cores) if victim.node else ()
        if victim.node and not cores:
            raise PlanError(f"a place for {victim.pod} without cores")
        victims.append(
            Replacement(
                _text(victim.uid),
                _text(victim.pod),
                _text(victim.owner),
                NeuronRequest(victim.resource, victim.count),
                _text(victim.node) if victim.node else "",
                cores,
                victim.priority,
            )
        )
    devices, cores = _ids(raw.devices), _ids(raw.cores)
    if not devices or not cores:
        raise PlanError("the plan frees no block")
    return PlanRecord(_text(raw.node), devices, cores, raw.started, raw.until, tuple(victims), kind)


def _text(value: str) -> str:
    if not value or len(value) > MAX_TEXT or not value.isprintable():
        raise PlanError(f"bad name {value[:40]!r}")
    return value


def _ids(text: str) -> tuple[int, ...]:
    if not IDS.fullmatch(text):
        raise PlanError(f"bad ids {text[:40]!r}")
    try:
        ids = parse_id_ranges(text) if _bounded(text) else None
    except ValueError as error:
        raise PlanError(str(error)) from error
    if ids is None or len(ids) > MAX_CORES or len(set(ids)) != len(ids):
        raise PlanError(f"bad ids {text[:40]!r}")
    return tuple(ids)


def _bounded(text: str) -> bool:
    """Every id below MAX_CORES: a range is expanded only then."""
    return all(int(n) < MAX_CORES for n in re.findall(r"[0-9]+", text))


# --- the eviction budget ----------------------------------------------------------------------

# On a Lease of its own (the extender's namespace): evictions of the last hour and the nodes
# cooling down, so a restart (or the next leader) keeps to the same budget. `kubectl neuron
# status` finds it by its label.
BUDGET_ANNOTATION = "neuron-scheduler.io/eviction-budget"
BUDGET_LABEL = "app.kubernetes.io/component"
BUDGET_LABEL_VALUE = "consolidation-budget"
HOUR = 3600.0
MAX_RECORDED = 10_000  # evictions remembered (an hour's cap is far below)


@dataclass(frozen=True, slots=True)
class BudgetRecord:
    """Evictions consolidation made in the last hour (wall-clock times) and the nodes it may not
    plan on again before a time, with the limits in force when it was written."""

    evictions: tuple[float, ...] = ()
    cooldown: tuple[tuple[str, float], ...] = ()  # (node, until)
    per_hour: int = 0
    max_plans: int = 0

    def spent(self, now: float) -> int:
        return sum(1 for t in self.evictions if now - HOUR < t <= now + 60)

    def left(self, now: float) -> int:
        return max(self.per_hour - self.spent(now), 0)

    def cooling(self, node: str, now: float) -> float:
        """Seconds until a plan may target the node again (0: it may)."""
        return max([0.0, *(until - now for n, until in self.cooldown if n == node)])

    def spend(
        self, node: str, count: int, now: float, cooldown: float, per_hour: int, max_plans: int
    ) -> BudgetRecord:
        """The record after a plan on `node` that evicts `count` pods, old entries dropped."""
        kept = tuple(t for t in self.evictions if now - HOUR < t <= now + 60)
        cooling = tuple((n, u) for n, u in self.cooldown if u > now and n != node)
        return BudgetRecord(
            (kept + (now,) * count)[-MAX_RECORDED:],
            (*cooling, (node, now + cooldown))[-MAX_RECORDED:],
            per_hour,
            max_plans,
        )


class _Budget(msgspec.Struct, forbid_unknown_fields=False):
    evictions: list[float] = []
    cooldown: dict[str, float] = {}
    per_hour: int = 0
    max_plans: int = 0


def encode_budget(record: BudgetRecord) -> str:
    return msgspec.json.encode(
        _Budget(
            [round(t, 3) for t in record.evictions],
            dict(record.cooldown),
            record.per_hour,
            record.max_plans,
        )
    ).decode()


def decode_budget(text: str) -> BudgetRecord:
    """An unreadable record counts as empty: the caller logs it and the next write replaces it."""
    if len(text) > 1024 * 1024:
        raise PlanError("the eviction budget is over 1 MiB")
    try:
        raw = msgspec.json.decode(text, type=_Budget)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as error:
        raise PlanError(f"not an eviction budget: {error}") from error
    if len(raw.evictions) > MAX_RECORDED or len(raw.cooldown) > MAX_RECORDED:
        raise PlanError("the eviction budget records too much")
    cooldown = tuple((_text(node), float(until)) for node, until in raw.cooldown.items())
    return BudgetRecord(
        tuple(float(t) for t in raw.evictions), cooldown, max(raw.per_hour, 0), raw.max_plans
    )
