"""What Kueue says of a gated pod's Workload, for `why`: whether it has quota (and in which
ClusterQueue), whether it is admitted, and each admission check's state and message: a pod gated
by Kueue waits on exactly these, and the placement check's Retry names the block that is missing.
Pure: the Workload goes in. It is read from the API, so what it says is bounded here (how many
checks, how long a message) before it reaches a terminal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neuron_scheduler.core.logtext import loggable
from neuron_scheduler.kube.kueue import (
    MAX_CHECKS,
    MAX_NAME,
    Workload,
    WorkloadState,
    admitted,
    condition,
    quota_reserved,
)

MESSAGE_LIMIT = 600  # characters of a check's or a condition's message shown


@dataclass(frozen=True, slots=True)
class CheckReport:
    name: str
    state: str  # Pending, Ready, Retry, Rejected (Kueue's CheckState)
    message: str


@dataclass(frozen=True, slots=True)
class WorkloadReport:
    workload: str  # namespace/name
    quota_reserved: bool
    cluster_queue: str  # where quota is reserved ("" when it is not)
    quota_message: str  # when it is not: Kueue's QuotaReserved message, if any
    admitted: bool
    checks: tuple[CheckReport, ...] = ()  # the first MAX_CHECKS, in the Workload's order
    more_checks: int = 0
    unread: str = ""  # why the Workload could not be read (then nothing else is known)

    @property
    def lines(self) -> list[str]:
        if self.unread:
            return [f"Kueue's Workload {self.workload}: not read ({self.unread})"]
        state = "admitted" if self.admitted else "not admitted"
        if self.quota_reserved:
            quota = f"quota reserved in ClusterQueue {self.cluster_queue}"
        else:
            quota = "no quota reserved" + (f": {self.quota_message}" if self.quota_message else "")
        lines = [f"Kueue's Workload {self.workload}: {state}; {quota}"]
        lines += [f"admission check {c.name}: {c.state}: {c.message}" for c in self.checks]
        if self.more_checks:
            lines.append(f"... and {self.more_checks} more admission checks")
        return lines


def _text(value: str, limit: int = MESSAGE_LIMIT) -> str:
    return loggable(" ".join(value.split()), limit)


def workload_report(workload: Workload | WorkloadState) -> WorkloadReport:
    status = workload.status
    reserved = quota_reserved(workload)
    queue = status.admission.clusterQueue if status.admission is not None and reserved else ""
    why_not = condition(status.conditions, "QuotaReserved")
    checks = tuple(
        CheckReport(_text(c.name, MAX_NAME), _text(c.state, 32), _text(c.message))
        for c in status.admissionChecks[:MAX_CHECKS]
    )
    return WorkloadReport(
        workload=_text(workload.key, 2 * MAX_NAME + 1),
        quota_reserved=reserved,
        cluster_queue=_text(queue, MAX_NAME),
        quota_message=_text(why_not.message) if why_not is not None and not reserved else "",
        admitted=admitted(workload),
        checks=checks,
        more_checks=max(len(status.admissionChecks) - MAX_CHECKS, 0),
    )


def unread_report(workload: str, reason: str) -> WorkloadReport:
    return WorkloadReport(
        _text(workload, 2 * MAX_NAME + 1),
        quota_reserved=False,
        cluster_queue="",
        quota_message="",
        admitted=False,
        unread=_text(reason),
    )


def report_of(workload: str, read: Workload | WorkloadState | str) -> WorkloadReport:
    """The report on `workload` (namespace/name) from what reading it gave: the Workload, or why
    it could not be read."""
    return unread_report(workload, read) if isinstance(read, str) else workload_report(read)


def report_json(report: WorkloadReport) -> dict[str, Any]:
    return {
        "workload": report.workload,
        "unread": report.unread or None,
        "admitted": report.admitted,
        "quota_reserved": report.quota_reserved,
        "cluster_queue": report.cluster_queue or None,
        "quota_message": report.quota_message or None,
        "admission_checks": [
            {"name": c.name, "state": c.state, "message": c.message} for c in report.checks
        ],
        "more_admission_checks": report.more_checks,
    }
