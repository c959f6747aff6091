"""Kueue's objects the placement admission check reads, as the extender's watches give them: the
Workloads that have admission check states, the AdmissionChecks whose controllerName is the
extender's (kube.kueue.CONTROLLER_NAME), and every ResourceFlavor (their node labels and
tolerations are what an admitted pod set's pods get). No I/O: extender/loops/admitting acts on
it; docs/kueue.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from neuron_scheduler.kube.kueue import (
    CONTROLLER_NAME,
    AdmissionCheck,
    CheckState,
    ResourceFlavor,
    Workload,
)
from neuron_scheduler.kube.views import replace_all

T = TypeVar("T")


def _name(found: AdmissionCheck | ResourceFlavor) -> str:
    return found.metadata.name


def _uid(found: Workload) -> str:
    return found.metadata.uid


class KueueObjects:
    """`on_change()` hears of every change that may change what the check decides."""

    def __init__(self, controller_name: str = CONTROLLER_NAME) -> None:
        self.controller_name = controller_name
        self.workloads: dict[str, Workload] = {}  # uid -> the Workload, if it has check states
        self.checks: dict[str, AdmissionCheck] = {}  # name -> one of ours
        self.flavors: dict[str, ResourceFlavor] = {}  # name -> flavor
        self.on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # --- Workloads -----------------------------------------------------------------------------

    def replace_workloads(self, listed: Iterable[Workload]) -> None:
        replace_all(listed, _uid, self.apply_workload, list(self.workloads), self._forget)
        self._changed()

    def apply_workload(self, workload: Workload) -> None:
        uid = workload.metadata.uid
        if not uid:
            return
        if not workload.status.admissionChecks:
            if self.workloads.pop(uid, None) is not None:
                self._changed()
            return
        self.workloads[uid] = workload
        self._changed()

    def remove_workload(self, workload: Workload) -> None:
        self._forget(workload.metadata.uid)

    def _forget(self, uid: str) -> None:
        if self.workloads.pop(uid, None) is not None:
            self._changed()

    # --- AdmissionChecks and ResourceFlavors ---------------------------------------------------

    def replace_checks(self, listed: Iterable[AdmissionCheck]) -> None:
        mine = [c for c in listed if c.spec.controllerName == self.controller_name]
        self.checks = {c.metadata.name: c for c in mine}
        self._changed()

    def apply_check(self, check: AdmissionCheck) -> None:
        if check.spec.controllerName == self.controller_name:
            self.checks[check.metadata.name] = check
        else:
            self.checks.pop(check.metadata.name, None)
        self._changed()

    def remove_check(self, check: AdmissionCheck) -> None:
        if self.checks.pop(check.metadata.name, None) is not None:
            self._changed()

    def replace_flavors(self, listed: Iterable[ResourceFlavor]) -> None:
        self.flavors = {f.metadata.name: f for f in listed}
        self._changed()

    def apply_flavor(self, flavor: ResourceFlavor) -> None:
        self.flavors[flavor.metadata.name] = flavor
        self._changed()

    def remove_flavor(self, flavor: ResourceFlavor) -> None:
        if self.flavors.pop(flavor.metadata.name, None) is not None:
            self._changed()

    # --- reading -------------------------------------------------------------------------------

    def ours(self, workload: Workload) -> CheckState | None:
        """The workload's state of one of our checks (the first, where its ClusterQueue lists
        more than one of ours), or None."""
        for state in workload.status.admissionChecks:
            if state.name in self.checks:
                return state
        return None
