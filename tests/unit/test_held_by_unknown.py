"""Issue 35: what the extender reports about a node (its metrics, `status`) and what filter does
there come from one held set, cores held by pods whose ids are unknown or were refused included.
"""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON as DEV
from neuron_scheduler.core.resources import NEURONCORE as CORE
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.extender.verbs.judging import Judge
from neuron_scheduler.extender.verbs.wire import ExtenderArgs
from neuron_scheduler.kube.objects import Pod
from neuron_scheduler.live.fleet import fleet_view
from tests.builders import node, pod

NODE = "n"
# The pods: each asks for one device and names ids no inf1.6xlarge has.
REFUSED_IDS = ["100000000", "1000000000", ",".join(str(10**7 + i) for i in range(3000))]


def refused_ids_pods() -> list[Pod]:
    return [
        pod(
            f"hostile{i}",
            {DEV: 1},
            node=NODE,
            uid=f"hostile{i}",
            annotations={"AWS_NEURON_IDS": "0", "NEURON_RESOURCE_TYPE": DEV, "NEURON_CORES": ids},
        )
        for i, ids in enumerate(REFUSED_IDS)
    ]


def mixed_pods() -> list[Pod]:
    """Core 0 by our ids (device 0 busy), 6 cores placed without us: 3 of them fit in device 0,
    the other 3 must take a device of their own."""
    ours = {
        "AWS_NEURON_IDS": "0",
        "NEURON_RESOURCE_TYPE": CORE,
        "NEURON_CORES": "0",
        "NEURON_DEVS": "0",
        "NEURON_NODE": NODE,
    }
    return [
        pod("ours", {CORE: 1}, node=NODE, uid="ours", annotations=ours),
        pod("elsewhere", {CORE: 6}, node=NODE, uid="elsewhere", scheduler="default-scheduler"),
    ]


def scraped(metrics: Metrics, name: str) -> float:
    prefix = f'neuron_scheduler_node_{name}{{node="{NODE}"}} '
    text = generate_latest(metrics.registry).decode()
    (line,) = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(line.split()[-1])


def filter_answer(judge: Judge, devices: int) -> tuple[bool, str]:
    """Whether filter passes the node for a pod of this many devices, and its reason if not."""
    args = ExtenderArgs(Pod=pod("asking", {DEV: devices}), NodeNames=[NODE])
    result = judge.filter(args)
    return NODE in result.passed, {**result.failed, **result.unresolvable}.get(NODE, "")


@pytest.mark.parametrize(
    ("pods", "allowed", "refusal"),
    [
        (
            refused_ids_pods(),
            1,
            "needs 2 devices; only 1 device free (12 cores held with ids unknown)",
        ),
        (mixed_pods(), 2, "needs 3 devices; only 2 devices free (6 cores held with ids unknown)"),
    ],
    ids=["refused-ids", "placed-without-us"],
)
def test_metrics_and_status_show_what_filter_allows(
    pods: list[Pod], allowed: int, refusal: str
) -> None:
    ledger = Ledger(Catalog.builtin())
    ledger.replace_nodes([node(NODE, "inf1.6xlarge")])  # a chain of 4 devices x 4 cores
    for each in pods:
        ledger.apply_pod(each)
    metrics = Metrics(ledger)
    judge = Judge(ledger, metrics)
    answers = {n: filter_answer(judge, n) for n in range(1, 5)}
    largest = max((n for n, (passed, _) in answers.items() if passed), default=0)
    assert largest == allowed
    # Every device count up to it passes: free devices and the largest block are the same here.
    assert all(answers[n][0] for n in range(1, allowed + 1))
    assert scraped(metrics, "free_devices") == allowed
    assert scraped(metrics, "largest_free_block") == allowed
    (view,) = fleet_view(ledger).nodes
    assert (view.free_devices, view.largest_free_block) == (allowed, allowed)
    assert answers[allowed + 1][1] == refusal
