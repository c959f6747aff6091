"""`why` tells a pod stranded by fragmentation apart and says what consolidation does for it;
`status` shows the plans in flight and the eviction budget left."""

from __future__ import annotations

from typing import Any

import msgspec
from rich.console import Console

from neuron_scheduler.core import planrecord
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NeuronRequest
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.state.movability import Movability
from neuron_scheduler.extender.state.plans import Plans
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.live.consolidation import consolidation_json, consolidation_view
from neuron_scheduler.live.diagnosis import diagnose, diagnosis_json
from neuron_scheduler.live.snapshot import Budget
from neuron_scheduler.live.terminal import consolidation_block, why_view
from tests.builders import node, pod_json

NOW = 1_800_000_000.0


def web(device: int) -> Pod:
    body = pod_json(f"web-{device}", {NEURON: 1}, uid=f"web-{device}", node="ring")
    body["metadata"]["ownerReferences"] = [
        {"kind": "ReplicaSet", "name": "web", "uid": "rs", "controller": True}
    ]
    body["metadata"]["annotations"] = {
        "AWS_NEURON_IDS": str(device),
        "NEURON_RESOURCE_TYPE": NEURON,
        "NEURON_CORES": f"{2 * device},{2 * device + 1}",
        "NEURON_DEVS": str(device),
        "NEURON_NODE": "ring",
    }
    body["status"] = {"phase": "Running"}
    return msgspec.convert(body, Pod)


def world(annotations: dict[str, str] | None = None) -> tuple[Ledger, Movability, Plans, Pod]:
    ledger = Ledger(Catalog.builtin(), wall_clock=lambda: NOW)
    movability = Movability()
    plans = Plans(ledger, movability, lambda: NOW)
    big = msgspec.convert(pod_json("big", {NEURON: 4}, uid="big", annotations=annotations), Pod)
    pods = [web(d) for d in range(12) if d not in (2, 5, 8, 11)] + [big]
    for view in (ledger, movability, plans):
        view.replace_nodes([node("ring", "inf2.48xlarge")])
        view.replace_pods(pods)
    return ledger, movability, plans, big


def text(parts: Any) -> str:
    console = Console(width=300, record=True)
    for part in parts:
        console.print(part)
    return console.export_text()


def test_why_tells_fragmentation_apart_and_previews_the_plan() -> None:
    ledger, movability, plans, big = world()
    diagnosis = diagnose(ledger, big, plans=plans, movability=movability)
    assert diagnosis.stranded == ("ring",)
    assert diagnosis.consolidation.startswith("a plan would evict default/web-")
    assert "from node ring to free devices " in diagnosis.consolidation
    assert "Stranded by fragmentation: 1 node" in text(why_view(diagnosis))
    found = diagnosis_json(diagnosis)
    assert found["stranded_by_fragmentation"] == ["ring"]
    assert found["nodes"][0]["free_by_count"] is True


def test_a_pod_short_by_count_is_not_stranded() -> None:
    ledger, movability, plans, _ = world()
    huge = msgspec.convert(pod_json("huge", {NEURON: 6}, uid="huge"), Pod)
    diagnosis = diagnose(ledger, huge, plans=plans, movability=movability)
    assert diagnosis.stranded == () and diagnosis.consolidation == ""


def test_a_plan_in_flight_shows_in_why_and_status() -> None:
    record = planrecord.PlanRecord(
        "ring",
        (2, 3, 4, 5),
        (4, 5, 6, 7, 8, 9, 10, 11),
        NOW - 10,
        NOW + 290,
        (
            planrecord.Replacement(
                "web-3", "default/web-3", "rs", NeuronRequest(NEURON, 1), "ring", (16, 17)
            ),
            planrecord.Replacement(
                "web-4", "default/web-4", "rs", NeuronRequest(NEURON, 1), "ring", (22, 23)
            ),
        ),
    )
    ledger, movability, plans, big = world({planrecord.PLAN_ANNOTATION: planrecord.encode(record)})
    assert "big" in ledger.plan_holds and len(ledger.plan_holds) == 3
    diagnosis = diagnose(ledger, big, plans=plans, movability=movability)
    assert diagnosis.consolidation.startswith("a plan is in flight: evicting default/web-3")
    budget = Budget(planrecord.BudgetRecord((NOW - 10, NOW - 10), (), 30, 2), "ns/lease", "")
    view = consolidation_view(plans, budget, NOW)
    shown = text([consolidation_block(view)])
    assert "1 plans in flight; 28 of 30 evictions left this hour (Lease ns/lease)" in shown
    assert "default/big: ring devices 2-5 freed by moving default/web-3, default/web-4" in shown
    assert consolidation_json(view)["plans"][0]["places_held"] == 2
    unknown = consolidation_view(plans, Budget(None, "", "cannot list Leases: forbidden"), NOW)
    assert "eviction budget unknown: cannot list Leases: forbidden" in text(
        [consolidation_block(unknown)]
    )
