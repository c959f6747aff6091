"""Over random failed devices and random pods (some placed before their device failed), filter,
`status` and the metrics say the same of every node (issue 39): a failed device is neither free
nor any pod's, counted once; filter places exactly the allowed sizes up to the largest free
block that status and the metric report, never on a failed device."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings
from prometheus_client import generate_latest

from neuron_scheduler.core import handoff
from neuron_scheduler.core.allocation import NodeState, Placement, Policy, allocate, check_request
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import core_mask_of_devices
from neuron_scheduler.core.resources import NEURON, NEURONCORE, NeuronRequest
from neuron_scheduler.extender.metrics import Metrics
from neuron_scheduler.extender.state.ledger import Ledger
from neuron_scheduler.live.fleet import fleet_json, fleet_view
from tests.builders import neuron_capacity, node, pod

CATALOG = Catalog.builtin()
TYPES = ["inf1.6xlarge", "inf2.48xlarge", "trn1.32xlarge", "trn2.48xlarge"]
NODE = "n"


def gauge(text: str, name: str) -> float:
    prefix = f'{name}{{node="{NODE}"}} '
    (line,) = [line for line in text.splitlines() if line.startswith(prefix)]
    return float(line.rsplit(" ", 1)[1])


@settings(max_examples=150, deadline=None)
@given(
    instance_type=st.sampled_from(TYPES),
    failed_bits=st.integers(0, (1 << 16) - 1),
    sparse=st.integers(0, 3),
    requests=st.lists(
        st.tuples(st.sampled_from([NEURON, NEURONCORE]), st.sampled_from([1, 2, 3, 4, 8])),
        max_size=10,
    ),
    before=st.integers(0, 10),
)
def test_filter_status_and_metrics_agree(
    instance_type: str,
    failed_bits: int,
    sparse: int,
    requests: list[tuple[str, int]],
    before: int,
) -> None:
    devices, cores = neuron_capacity(instance_type)
    topology = CATALOG.resolve(instance_type, devices, cores).topology
    failed = failed_bits & ((1 << devices) - 1)
    for _ in range(sparse):  # fewer failures too: most nodes have none or one
        failed &= failed >> 1
    failed_ids = [d for d in range(devices) if failed >> d & 1]
    # Pods placed in order; the first `before` of them while every device was healthy (they may
    # run on a device that failed since), the others around the failed devices.
    used = 0
    pods = []
    for i, (resource, count) in enumerate(requests):
        request = NeuronRequest(resource, count)
        blocked = (
            used if i < before else used | core_mask_of_devices(failed, topology.cores_per_device)
        )
        decision = allocate(topology, NodeState(blocked), request, Policy.BEST_FIT)
        if not isinstance(decision, Placement):
            continue
        used |= decision.core_mask
        annotations = handoff.encode(NODE, request, decision, ["c0"], 1)
        annotations[handoff.ALLOCATED] = "true"
        pods.append(
            pod(f"p{i}", {resource: count}, node=NODE, annotations=annotations, phase="Running")
        )
    ledger = Ledger(CATALOG)
    ledger.replace_nodes([node(NODE, instance_type, failed=failed_ids)])
    ledger.replace_pods(pods)

    (view,) = fleet_json(fleet_view(ledger))["nodes"]
    metrics = generate_latest(Metrics(ledger).registry).decode()
    assert view["unhealthy_devices"] == failed_ids
    assert gauge(metrics, "neuron_scheduler_node_unhealthy_devices") == len(failed_ids)
    assert gauge(metrics, "neuron_scheduler_node_free_devices") == view["free_devices"]
    assert gauge(metrics, "neuron_scheduler_node_largest_free_block") == view["largest_free_block"]
    assert view["withheld_cores"] == 0 and view["held"]["devices"] == []

    # Each failed device counted once as failed, and once more in count while a pod still
    # requests it (as kube-scheduler counts allocatable against requests): nothing else.
    failed_cores = core_mask_of_devices(failed, topology.cores_per_device)
    bound = 0
    again = 0
    for p in view["pods"]:
        held = sum(1 << c for c in p["cores"])
        bound |= held
        again += (held & failed_cores).bit_count()
    used_cores = bound | failed_cores
    idle = [
        d
        for d in range(devices)
        if not used_cores >> (d * topology.cores_per_device)
        & ((1 << topology.cores_per_device) - 1)
    ]
    spare = topology.total_cores - used_cores.bit_count() - again
    assert view["unattributed_cores"] == again
    assert view["free_devices"] == max(min(len(idle), spare // topology.cores_per_device), 0)
    on_failed = [p for p in view["pods"] if p["on_unhealthy_devices"]]
    assert all(set(p["on_unhealthy_devices"]) <= set(failed_ids) for p in on_failed)
    assert bool(on_failed) == bool(again)

    # Filter places exactly the allowed sizes up to the largest free block, never on a failed
    # device.
    for size in range(1, devices + 1):
        request = NeuronRequest(NEURON, size)
        if check_request(topology, request) is not None:
            continue
        decision = ledger.fill_verdicts([NODE], request, Policy.BEST_FIT).decisions[NODE]
        placed = isinstance(decision, Placement)
        assert placed == (size <= view["largest_free_block"]), (size, view, decision)
        if isinstance(decision, Placement):
            assert not set(decision.devices) & set(failed_ids)
        elif failed_ids:
            assert "failed)" in decision.reason
