"""Issue 31: room that frees without an event kube-scheduler acts on reaches the pod waiting for
it, on the real kube-scheduler with its default flush of unschedulable pods (5 minutes).

- A hold that ends inside the extender: ids a bind wrote on a pod that is still pending hold its
  devices until `ANNOUNCED_SECONDS` after they were written (its Binding may still land), and no
  cluster event says when that ends.
- A deletion kube-scheduler acted on before our watch showed it: the extender reads the API
  through a proxy that delivers watch data late, so kube-scheduler retries the waiting pod on
  the deletion at once and our filter still sees the block taken.

Each waiting pod must be bound within 10 s of its room freeing; without the waker both wait for
the flush.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from neuron_scheduler.core import handoff
from neuron_scheduler.core.allocation import NodeState, Placement, allocate
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NeuronRequest
from neuron_scheduler.extender.loops.waking import WAKE_ANNOTATION
from neuron_scheduler.extender.state.ledger import ANNOUNCED_SECONDS
from tests.builders import neuron_capacity
from tests.e2e.harness import Scenario
from tests.testbed import ExtenderProcess, Stack, scheduler_config
from tests.testbed.faultproxy import FaultProxy, Faults

pytestmark = pytest.mark.e2e

HOLD_LEFT = 12.0  # seconds the failed bind's hold has left when the test starts
BOUND_WITHIN = 10.0  # the bound on the wait once room frees
LAGGY = "laggy-scheduler"  # served by the lagging extender's own kube-scheduler
WATCH_LAG = 2.0


def failed_bind_annotations(node: str, instance_type: str, written_ns: int) -> dict[str, str]:
    """What our bind writes on a pod before its Binding (which never came): device 0 of node."""
    topology = Catalog.builtin().resolve(instance_type, *neuron_capacity(instance_type)).topology
    request = NeuronRequest(NEURON, 1)
    placement = allocate(topology, NodeState(0), request)
    assert isinstance(placement, Placement)
    return handoff.encode(node, request, placement, ["c0"], written_ns)


def refused(scenario: Scenario, name: str) -> None:
    scenario.wait_event(name, "FailedScheduling", seconds=60)


def wake_of(scenario: Scenario, name: str) -> str:
    return str(scenario.pod(name)["metadata"].get("annotations", {}).get(WAKE_ANNOTATION, ""))


@pytest.mark.compat
def test_a_hold_that_ends_without_any_event_wakes_the_pod_waiting_for_it(
    scenario: Scenario,
) -> None:
    node = scenario.add_node("inf2.xlarge")  # one device
    written = time.time_ns() - int((ANNOUNCED_SECONDS - HOLD_LEFT) * 1e9)
    ends = written / 1e9 + ANNOUNCED_SECONDS
    # No scheduler serves "nobody": the pod stays pending with the ids its failed bind wrote.
    scenario.create_pod(
        "failed-bind",
        {NEURON: 1},
        scheduler="nobody",
        annotations=failed_bind_annotations(node, "inf2.xlarge", written),
    )
    scenario.create_pod("waiter", {NEURON: 1})
    refused(scenario, "waiter")
    assert time.time() < ends - 2, "the hold ended before the test could see the pod refused"
    pod = scenario.wait_bound("waiter", ends - time.time() + BOUND_WITHIN)
    waited = time.time() - ends
    assert pod["spec"]["nodeName"] == node
    assert "hold expired" in wake_of(scenario, "waiter"), pod["metadata"]["annotations"]
    print(f"\nbound {waited:.1f}s after the hold ended")


@pytest.fixture
def lagging(stack: Stack, tmp_path: Path) -> Iterator[tuple[Scenario, FaultProxy]]:
    """An extender whose watches lag `WATCH_LAG` behind the API server, called by a
    kube-scheduler of its own (default flush)."""
    scenario = Scenario(stack)
    proxy = FaultProxy(stack.cp.server_url, stack.cp.ca_path, tmp_path / "proxy-pki")
    proxy.start()
    extender = scheduler = None
    try:
        kubeconfig = proxy.kubeconfig(tmp_path / "lagging.kubeconfig", stack.extender_token)
        extender = ExtenderProcess(
            stack.cp, kubeconfig, name="extender-lagging", pki=stack.pki, scheduler_names=(LAGGY,)
        )
        extender.start(timeout=120)
        proxy.set_faults(Faults(watch_lag=WATCH_LAG))
        scheduler = stack.cp.start_scheduler(
            config=scheduler_config(
                scheduler_name=LAGGY,
                extender_url=extender.url,
                node_cache_capable=True,
                pki=stack.pki,
            ),
            extra_args=("--v=2",),
        )
        yield scenario, proxy
    finally:
        if scheduler is not None:
            scheduler.stop()
        if extender is not None:
            extender.process.stop()
        proxy.stop()
        scenario.cleanup()


@pytest.mark.compat
def test_a_deletion_kube_scheduler_acted_on_before_the_extender_wakes_the_pod(
    lagging: tuple[Scenario, FaultProxy],
) -> None:
    scenario, _ = lagging
    node = scenario.add_node("inf2.xlarge")
    scenario.create_pod("holder", {NEURON: 1}, scheduler=LAGGY)
    scenario.wait_bound("holder")
    scenario.create_pod("waiter", {NEURON: 1}, scheduler=LAGGY)
    refused(scenario, "waiter")
    time.sleep(WATCH_LAG + 1)  # kube-scheduler has settled on the refusal
    scenario.delete_pod("holder")
    deleted = time.time()
    # kube-scheduler retries the waiter on the deletion at once; our filter, a watch lag behind,
    # still sees the device taken and refuses it again. Nothing else happens in the cluster.
    pod = scenario.wait_bound("waiter", BOUND_WITHIN + WATCH_LAG)
    assert pod["spec"]["nodeName"] == node
    assert "pod deleted" in wake_of(scenario, "waiter"), pod["metadata"]["annotations"]
    print(
        f"\nbound {time.time() - deleted:.1f}s after the deletion ({WATCH_LAG:.0f}s watch lag); "
        f"wake: {wake_of(scenario, 'waiter')!r}"
    )
