"""Issue 41: the cluster's autoscaler adds a node when fragmentation strands a pod and nothing can
move. Real Karpenter v1.15.0 (its kwok cloud provider) and kwok v0.8.0 (tools/autoscaler, via
tests/testbed/autoscaler.py) on the session's control plane, with a kube-scheduler profile of its
own (`autoscaled`) calling each test's extender.

The world: an inf2.48xlarge ring not managed by Karpenter whose devices hold bare pods (nothing
may move them) but 2, 5, 8 and 11; a pending 4-device pod fits it by count and has no block on
it. Each test makes a NodePool of inf2.48xlarge whose Nodes carry the test's label (its pods'
nodeSelector), with Karpenter's default consolidation after 10 s (quick, so the test sees it).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from neuron_scheduler.core.capacity import PLACEHOLDER_LABEL
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON
from neuron_scheduler.extender.state.protection import KARPENTER_DO_NOT_DISRUPT
from tests.e2e.harness import ROOT, Scenario, bound, wait_for
from tests.testbed import ExtenderProcess, KubeError, Stack, free_ports
from tests.testbed.autoscaler import Karpenter, find_autoscaler_bin
from tests.testbed.stack import start_profile

pytestmark = pytest.mark.e2e

SCHEDULER = "autoscaled"
TYPE = "inf2.48xlarge"
HOLES = [2, 5, 8, 11]
# Bounds on waits, not speed targets: the machine is shared.
PATIENCE = 120.0
# Rounds of Karpenter's consolidation (one every 10 s) a protected node must outlive.
ROUNDS = 4


class World:
    """One test's scenario, NodePool and extender (started by `extender(...)`)."""

    def __init__(self, stack: Stack, karpenter: Karpenter, port: int) -> None:
        self.stack = stack
        self.karpenter = karpenter
        self.port = port
        self.scenario = Scenario(stack)
        self.owner = f"test-{self.scenario.id}"
        self.pool = f"neuron-{self.scenario.id}"
        self.process: ExtenderProcess | None = None

    def extender(self, *extra: str) -> ExtenderProcess:
        self.process = ExtenderProcess(
            self.stack.cp,
            self.stack.extender_kubeconfig,
            self.port,
            name=f"extender-{self.owner}",
            pki=self.stack.pki,
            scheduler_names=(SCHEDULER,),
            extra_args=[
                "--consolidation=on",
                "--consolidation-pending-seconds=1",
                "--capacity-pending-seconds=3",
                f"--capacity-owner={self.owner}",
                *extra,
            ],
        )
        # A failed test's report prints it (registered first: a start that fails is reported too).
        self.stack.extra_logs["extender-autoscaling"] = self.process.process.log_path
        self.process.start(timeout=120)
        return self.process

    def node_pool(self) -> None:
        self.karpenter.node_pool(self.pool, [TYPE], labels={"neuron-test": self.scenario.id})

    def placeholders(self) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/kube-system/pods?labelSelector={PLACEHOLDER_LABEL}={self.owner}"
        return list(self.stack.cp.request("GET", path)["items"])

    def node_events(self, node: str) -> list[dict[str, Any]]:
        path = f"/api/v1/namespaces/default/events?fieldSelector=involvedObject.name={node}"
        return list(self.stack.cp.request("GET", path)["items"])

    def node_exists(self, node: str) -> bool:
        try:
            self.stack.cp.request("GET", f"/api/v1/nodes/{node}")
        except KubeError as error:
            if error.status == 404:
                return False
            raise
        return True

    def stop(self) -> None:
        if self.process is not None:
            self.process.process.stop()
        self.stack.extra_logs.pop("extender-autoscaling", None)
        self.scenario.cleanup()
        for placeholder in self.placeholders():
            with contextlib.suppress(KubeError):
                name = placeholder["metadata"]["name"]
                self.stack.cp.request("DELETE", f"/api/v1/namespaces/kube-system/pods/{name}")
        # Karpenter terminates the pool's nodes itself (its finalizers): wait, so no Node is left
        # behind for later tests.
        self.karpenter.delete_node_pool(self.pool)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not self.karpenter.node_claims(self.pool), "the pool's nodes gone")


@pytest.fixture(scope="module")
def karpenter(stack: Stack) -> Iterator[tuple[Karpenter, int]]:
    running = Karpenter(stack.cp, find_autoscaler_bin(ROOT), [TYPE], Catalog.builtin())
    started = time.monotonic()
    running.start()
    print(f"\nKarpenter and kwok healthy after {time.monotonic() - started:.1f}s")
    stack.extra_logs.update(running.logs())
    (port,) = free_ports(1)
    scheduler = start_profile(stack, SCHEDULER, port)
    try:
        yield running, port
    finally:
        scheduler.stop()
        running.stop()
        for name in running.logs():
            stack.extra_logs.pop(name, None)


@pytest.fixture
def world(stack: Stack, karpenter: tuple[Karpenter, int]) -> Iterator[World]:
    made = World(stack, *karpenter)
    try:
        yield made
    finally:
        made.stop()


def fragment(scenario: Scenario) -> str:
    """An inf2.48xlarge (not Karpenter's) whose devices hold bare pods but HOLES."""
    node = scenario.add_node(TYPE)
    for i in range(12):
        scenario.create_pod(f"fill-{i}", {NEURON: 1}, scheduler=SCHEDULER)
    placed = wait_for(
        lambda: b if len(b := bound(scenario, "fill-")) == 12 else None, "the fill pods bound", 120
    )
    for device in HOLES:
        scenario.delete_pod(placed[device])
    wait_for(lambda: len(scenario.pods()) == 12 - len(HOLES), "the holes free")
    assert sorted(set(range(12)) - set(bound(scenario, "fill-"))) == HOLES
    return node


def why(world: World, pod: str) -> dict[str, Any]:
    """`neuron-scheduler why POD --json`, as a person would run it (admin kubeconfig)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "neuron_scheduler",
            "why",
            pod,
            "-n",
            world.scenario.namespace,
            "--json",
            "--kubeconfig",
            str(world.stack.cp.kubeconfig_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    answer: dict[str, Any] = json.loads(out.stdout)
    return answer


def test_a_stranded_pod_gets_exactly_one_node_binds_there_and_keeps_it(world: World) -> None:
    """Capacity requests on and the do-not-disrupt mark on: Karpenter adds one inf2.48xlarge for
    the placeholder, the pod binds there, the placeholder is gone, and Karpenter's consolidation
    (which by count would put the pod on the fragmented ring) is blocked by the mark: the node
    and the pod are still there after it has had its chance."""
    scenario = world.scenario
    scenario.kubelet_stand_in()
    extender = world.extender("--capacity-requests=on", "--autoscaler-do-not-disrupt")
    existing = fragment(scenario)
    world.node_pool()
    created = time.monotonic()
    scenario.create_pod("big", {NEURON: 4}, scheduler=SCHEDULER)
    pod = scenario.wait_bound("big", PATIENCE)
    bound_after = time.monotonic() - created
    node = pod["spec"]["nodeName"]
    assert node != existing
    labels = world.stack.cp.request("GET", f"/api/v1/nodes/{node}")["metadata"]["labels"]
    assert labels["karpenter.sh/nodepool"] == world.pool
    assert labels["node.kubernetes.io/instance-type"] == TYPE
    # The placeholder goes as the node registers (the pod may be bound there first: kube-scheduler
    # retries it on the Node's update as soon as the extender holds its block, or before).
    wait_for(lambda: world.placeholders() == [], "the placeholder removed")
    assert len(world.karpenter.node_claims(world.pool)) == 1
    scenario.wait_event("big", "NeuronCapacityRequested", f"a node of {TYPE}")
    scenario.wait_event("big", "NeuronCapacityArrived", f"node {node} ")
    assert extender.metric('neuron_scheduler_capacity_requests_total{outcome="requested"}') == 1
    assert extender.metric('neuron_scheduler_capacity_requests_total{outcome="fulfilled"}') == 1
    marked = wait_for(
        lambda: scenario.pod("big")["metadata"]["annotations"].get(KARPENTER_DO_NOT_DISRUPT),
        "the do-not-disrupt mark on the pod",
    )
    assert marked == "true"
    # Karpenter's consolidation has its chance: the node is Consolidatable (consolidateAfter
    # 10 s), and its disruption controller evaluates consolidation ROUNDS more times (every 10
    # s). Without the mark it evicted the pod 26 s after it was bound, 3 rounds later (the next
    # test): the choice, then its 15 s validation.
    wait_for(
        lambda: world.karpenter.consolidatable(world.pool), "the node Consolidatable", PATIENCE
    )
    rounds = world.karpenter.consolidation_rounds()
    wait_for(
        lambda: world.karpenter.consolidation_rounds() >= rounds + ROUNDS,
        f"{ROUNDS} rounds of Karpenter's consolidation",
        PATIENCE,
    )
    assert world.node_exists(node)
    assert scenario.pod("big")["spec"]["nodeName"] == node
    assert not scenario.pod("big")["metadata"].get("deletionTimestamp")
    assert scenario.pod("big").get("status", {}).get("phase") == "Running"
    assert len(world.karpenter.node_claims(world.pool)) == 1
    blocked = [e["message"] for e in world.node_events(node) if e["reason"] == "DisruptionBlocked"]
    print(f"\nbound {bound_after:.1f}s after it was created; Karpenter's events: {blocked}")


def test_without_the_mark_karpenters_consolidation_evicts_the_pod(world: World) -> None:
    """The loop the mark prevents, measured: the same, without --autoscaler-do-not-disrupt.
    Karpenter's count-based simulation puts the pod on the fragmented ring, evicts it and
    removes the node (a pod of a controller would come back, strand, and bring a node again)."""
    scenario = world.scenario
    scenario.kubelet_stand_in()
    world.extender("--capacity-requests=on")
    fragment(scenario)
    world.node_pool()
    scenario.create_pod("big", {NEURON: 4}, scheduler=SCHEDULER)
    node = scenario.wait_bound("big", PATIENCE)["spec"]["nodeName"]
    started = time.monotonic()

    def evicted() -> bool:
        try:
            pod = scenario.pod("big")
        except KubeError:
            return True
        return bool(pod["metadata"].get("deletionTimestamp"))

    rounds = world.karpenter.consolidation_rounds()
    wait_for(evicted, "Karpenter to evict the pod", PATIENCE)
    took = time.monotonic() - started
    rounds = world.karpenter.consolidation_rounds() - rounds
    wait_for(lambda: not world.node_exists(node), "Karpenter to remove the node", PATIENCE)
    reasons = {e["reason"]: e["message"] for e in world.node_events(node)}
    print(
        f"\nevicted {took:.1f}s after it was bound, {rounds} rounds of consolidation later; "
        f"node events: {reasons}"
    )


def test_with_capacity_requests_off_no_node_comes_and_why_says_what_would_be_asked(
    world: World,
) -> None:
    scenario = world.scenario
    scenario.kubelet_stand_in()
    extender = world.extender("--capacity-requests=off")
    existing = fragment(scenario)
    world.node_pool()
    scenario.create_pod("big", {NEURON: 4}, scheduler=SCHEDULER)
    # Karpenter has looked at the pod: by count it fits the fragmented ring, so it adds nothing.
    nominated = scenario.wait_event("big", "Nominated", existing, PATIENCE)
    answer = wait_for(
        lambda: a if (a := why(world, "big")).get("capacity") else None,
        "why to say what a capacity request would ask for",
    )
    assert answer["stranded_by_fragmentation"] == [existing]
    assert answer["consolidation"].startswith("no pods may be moved"), answer
    assert f"would ask the cluster's autoscaler for a node of {TYPE}" in answer["capacity"]
    time.sleep(5)  # more of Karpenter's provisioning rounds (every batch: 1-3 s)
    assert world.karpenter.node_claims(world.pool) == []
    assert not scenario.pod("big")["spec"].get("nodeName")
    assert world.placeholders() == []
    assert extender.metric("neuron_scheduler_capacity_requests_total") == 0
    print(f"\nKarpenter: {nominated['message']}; why: {answer['capacity']}")
