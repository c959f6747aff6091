"""Preemption in the simulator: kube-scheduler's count model and the verb (issue 18)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from neuron_scheduler.cli import app
from neuron_scheduler.core.allocation import Policy
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest
from neuron_scheduler.sim.preemption import Preemption, Resident, count_victims
from neuron_scheduler.sim.simulation import NodeSpec, PodEvent, Simulation


def one_row_per_young(catalog: Catalog, preemption: Preemption) -> Simulation:
    """A trn1.32xlarge of 16 one-device pods whose youngest sit one per row (0, 5, 10, 15)."""
    simulation = Simulation([NodeSpec("n", "trn1.32xlarge")], catalog, Policy.BEST_FIT, preemption)
    return simulation


def events_for_churn() -> list[PodEvent]:
    one = NeuronRequest(NEURON, 1)
    events = [PodEvent(0, f"old-{d}", one) for d in range(16)]
    # The pods on 0, 5, 10, 15 leave and are replaced later: the replacements are the youngest.
    events += [PodEvent(1, f"old-{d}", None) for d in (0, 5, 10, 15)]
    events += [PodEvent(2, f"young-{d}", one) for d in (0, 5, 10, 15)]
    events.append(PodEvent(3, "big", NeuronRequest(NEURON, 4), priority=1000))
    return events


def test_with_the_verb_one_row_goes(catalog: Catalog) -> None:
    result = one_row_per_young(catalog, Preemption.VERB).run(events_for_churn())
    assert result.preempted == 1
    assert result.evictions == 4
    assert result.evictions_for_nothing == 0
    node = result.nodes[0]
    assert sorted(node.pods["big"].devices) in (
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
        [12, 13, 14, 15],
    )


def test_without_the_verb_the_youngest_go_for_nothing(catalog: Catalog) -> None:
    result = one_row_per_young(catalog, Preemption.COUNT).run(events_for_churn())
    assert result.preempted == 0
    assert result.evictions == 4
    assert result.evictions_for_nothing == 4
    assert "big" in result.pending
    assert not {f"young-{d}" for d in (0, 5, 10, 15)} & set(result.nodes[0].pods)


def test_count_victims_is_kube_schedulers_dry_run(catalog: Catalog) -> None:
    topology = catalog.resolve("trn1.32xlarge").topology
    one = NeuronRequest(NEURON, 1)
    residents = {f"p{d}": Resident(one, d % 2, float(d), 1 << (d * 2)) for d in range(16)}
    # Priority 0 pods are the only ones below 1; the youngest of them go first.
    assert count_victims(topology, residents, NeuronRequest(NEURON, 2), 1) == ["p12", "p14"]
    # Nothing below priority 0; and cores are another resource: device pods never count.
    assert count_victims(topology, residents, NeuronRequest(NEURON, 2), 0) == []
    assert count_victims(topology, residents, NeuronRequest(NEURONCORE, 2), 5) == []
    # Removing every lower pod does not make room: no candidate.
    assert count_victims(topology, residents, NeuronRequest(NEURON, 16), 1) == []


def test_simulate_compare_shows_evictions_with_and_without_the_verb(tmp_path: Path) -> None:
    workload = tmp_path / "w.yaml"
    workload.write_text(
        "pods:\n"
        + "".join(
            f"  - {{name: p{i}, resource: neuron, count: 1, arrive: {i}}}\n" for i in range(16)
        )
        + "  - {name: big, resource: neuron, count: 4, arrive: 20, priority: 1000}\n"
    )
    cluster = tmp_path / "c.yaml"
    cluster.write_text("nodes:\n  - {instance_type: trn1.32xlarge}\n")
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--cluster",
            str(cluster),
            "--workload",
            str(workload),
            "--compare",
            "--report",
            str(tmp_path / "r"),
        ],
    )
    assert result.exit_code == 0, result.output
    runs = json.loads((tmp_path / "r" / "compare.json").read_text())
    figures = {r["label"]: (r["evictions"], r["evictions_for_nothing"]) for r in runs}
    # 16 pods of one age: kube-scheduler's four may or may not share a row; the verb's do.
    assert figures["neuron-scheduler"] == (4, 0)
    assert figures["neuron-scheduler, no verb"][0] >= 4
    names = {p.name for p in (tmp_path / "r").iterdir()}
    assert any(n.startswith("neuron-scheduler-no-verb-") for n in names), names
    bad = tmp_path / "bad.yaml"
    bad.write_text("pods:\n  - {name: a, resource: neuron, count: 1, priority: 99999999999}\n")
    result = CliRunner().invoke(app, ["simulate", "--workload", str(bad)])
    assert result.exit_code != 0 and "outside a 32-bit integer" in result.output
