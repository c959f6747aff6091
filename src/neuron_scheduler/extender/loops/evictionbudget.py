"""Consolidation's eviction budget, kept on a Lease so that a restart or a new leader keeps to it:
the evictions of the last hour and the nodes cooling down (core/planrecord's BudgetRecord).

Spent before a plan evicts anything, with optimistic concurrency (the Lease's resourceVersion): a
crash after the write leaves the budget spent and nothing evicted, never the other way round.
When the Lease cannot be read or written the budget counts as spent (no plan starts): the
extender's Role names the Lease (charts/neuron-scheduler/templates/extender-rbac.yaml).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.core.planrecord import (
    BUDGET_ANNOTATION,
    BUDGET_LABEL,
    BUDGET_LABEL_VALUE,
    BudgetRecord,
    PlanError,
    decode_budget,
    encode_budget,
)
from neuron_scheduler.kube.errors import API_ERRORS, Conflict, NotFound, error_text
from neuron_scheduler.kube.objects import Lease, LeaseMeta

log = logging.getLogger("neuron_scheduler.extender.consolidating")

WRITE_ATTEMPTS = 3


class LeaseStore(Protocol):
    async def get_lease(self, namespace: str, name: str) -> Lease: ...

    async def create_lease(self, lease: Lease) -> Lease: ...

    async def replace_lease(self, lease: Lease) -> Lease: ...


class BudgetUnavailable(Exception):
    """The Lease could not be read or written: nothing is spent, and no plan may start."""


class EvictionBudget:
    def __init__(
        self,
        store: LeaseStore,
        namespace: str,
        name: str,
        per_hour: int,
        cooldown: float,
        max_plans: int,
        wall_clock: Callable[[], float],
    ) -> None:
        self.store = store
        self.namespace = namespace
        self.name = name
        self.per_hour = per_hour
        self.cooldown = cooldown
        self.max_plans = max_plans
        self.wall_clock = wall_clock
        self.record = BudgetRecord(per_hour=per_hour, max_plans=max_plans)
        self.loaded = False
        self._failure = ""  # the last failure logged, so a lasting one is logged once

    def left(self) -> int:
        return min(self.record.left(self.wall_clock()), self.per_hour)

    def cooling(self, node: str) -> float:
        return self.record.cooling(node, self.wall_clock())

    async def load(self) -> None:
        """Reads the Lease (the leader does before it plans): what earlier leaders spent."""
        try:
            self.record = self._read(await self.store.get_lease(self.namespace, self.name))
        except NotFound:
            self.record = BudgetRecord(per_hour=self.per_hour, max_plans=self.max_plans)
        except API_ERRORS as error:
            self._failed("read", error)
            raise BudgetUnavailable(error_text(error)) from error
        self.loaded = True
        self._failure = ""

    async def spend(self, node: str, count: int) -> None:
        """Records `count` evictions now and starts `node`'s cooldown, on the Lease."""
        for _ in range(WRITE_ATTEMPTS):
            try:
                lease = await self._current()
                now = self.wall_clock()
                record = self._read(lease)
                if count > record.left(now) or record.cooling(node, now) > 0:
                    self.record = record
                    raise BudgetUnavailable("spent meanwhile (another leader?)")
                spent = record.spend(node, count, now, self.cooldown, self.per_hour, self.max_plans)
                lease.metadata.annotations = {
                    **lease.metadata.annotations,
                    BUDGET_ANNOTATION: encode_budget(spent),
                }
                lease.metadata.labels = {**lease.metadata.labels, BUDGET_LABEL: BUDGET_LABEL_VALUE}
                if lease.metadata.resourceVersion:
                    await self.store.replace_lease(lease)
                else:
                    await self.store.create_lease(lease)
                self.record = spent
                self._failure = ""
                return
            except Conflict:
                continue  # changed since we read it (or created meanwhile): read again
            except API_ERRORS as error:
                self._failed("write", error)
                raise BudgetUnavailable(error_text(error)) from error
        raise BudgetUnavailable("the Lease kept changing while it was written")

    async def _current(self) -> Lease:
        try:
            return await self.store.get_lease(self.namespace, self.name)
        except NotFound:
            return Lease(metadata=LeaseMeta(name=self.name, namespace=self.namespace))

    def _read(self, lease: Lease) -> BudgetRecord:
        text = lease.metadata.annotations.get(BUDGET_ANNOTATION, "")
        if not text:
            return BudgetRecord(per_hour=self.per_hour, max_plans=self.max_plans)
        try:
            return decode_budget(text)
        except PlanError as error:
            log.warning(
                "Lease %s/%s: %s; the eviction budget starts afresh",
                self.namespace,
                self.name,
                loggable(error),
            )
            return BudgetRecord(per_hour=self.per_hour, max_plans=self.max_plans)

    def _failed(self, what: str, error: BaseException) -> None:
        text = f"cannot {what} Lease {self.namespace}/{self.name}: {error_text(error)}"
        if text != self._failure:
            self._failure = text
            log.warning(
                "%s; consolidation starts no plan until it can (the extender's Role needs get, "
                "create and update on that Lease)",
                loggable(text),
            )
