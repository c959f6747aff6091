"""Issue 33: fragmentation never strands a pod. Consolidation on the real kube-scheduler, with
kube-controller-manager running Deployments (evicted pods come back) and PodDisruptionBudgets.

The worlds: a node whose free devices are scattered one by one between pods of a Deployment, so
a pending pod fits by count but finds no block. Positions are made exact with bare placeholder
pods: they fill the node, the ones where the Deployment's pods should go are deleted, the
Deployment fills those, then the remaining placeholders leave the scattered holes.

Each test runs its own extender (consolidation on or dry-run, pods waiting 3 s before a plan)
behind a kube-scheduler profile of its own, `consolidating`; the session's extender ignores those
pods.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from neuron_scheduler.core.ids import format_ids
from neuron_scheduler.core.planrecord import PLAN_ANNOTATION, decode
from neuron_scheduler.core.resources import NEURON
from tests.e2e.harness import Scenario, bound, command_json, dump, ids, wait_for
from tests.testbed import ExtenderProcess, KubeError, Stack, free_ports
from tests.testbed.controlplane import ControllerManager
from tests.testbed.stack import BUDGET_LEASE, start_profile

pytestmark = pytest.mark.e2e

SCHEDULER = "consolidating"
PENDING_SECONDS = 3
BOUND_WITHIN = 90.0  # a bound on the wait, not a speed target: the machine is shared
LOW, HIGH = 10, 1000


class World:
    """The module's kube-controller-manager and `consolidating` kube-scheduler, and each test's
    extender (started by `extender(mode)`) and scenario."""

    def __init__(self, stack: Stack, port: int) -> None:
        self.stack = stack
        self.port = port
        self.process: ExtenderProcess | None = None
        self.scenario = Scenario(stack)

    def extender(self, mode: str, *extra: str) -> ExtenderProcess:
        """(Re)starts the test's extender in this mode on the scheduler's port."""
        if self.process is not None:
            self.process.process.stop()
        self.process = ExtenderProcess(
            self.stack.cp,
            self.stack.extender_kubeconfig,
            self.port,
            name="extender-consolidation",
            pki=self.stack.pki,
            scheduler_names=(SCHEDULER,),
            extra_args=[
                f"--consolidation={mode}",
                f"--consolidation-pending-seconds={PENDING_SECONDS}",
                "--consolidation-node-cooldown=0",
                *extra,
            ],
        )
        # A failed test's report prints it with the stack's own logs (a restart appends to it).
        self.stack.extra_logs["extender-consolidation"] = self.process.process.log_path
        self.process.start(timeout=120)
        return self.process

    def stop(self) -> None:
        if self.process is not None:
            self.process.process.stop()
        self.stack.extra_logs.pop("extender-consolidation", None)
        delete_deployments(self.scenario)
        self.scenario.cleanup()


@pytest.fixture(scope="module")
def controllers(stack: Stack) -> Iterator[tuple[ControllerManager, int]]:
    manager = stack.cp.start_controller_manager()
    (port,) = free_ports(1)
    scheduler = start_profile(stack, SCHEDULER, port)
    try:
        yield manager, port
    finally:
        scheduler.stop()
        manager.stop()


@pytest.fixture
def world(stack: Stack, controllers: tuple[ControllerManager, int]) -> Iterator[World]:
    with contextlib.suppress(KubeError):  # each test starts with the whole budget
        stack.cp.request(
            "DELETE", f"/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/{BUDGET_LEASE}"
        )
    made = World(stack, controllers[1])
    try:
        yield made
    finally:
        made.stop()


# --- building the worlds --------------------------------------------------------------------


def deployment(
    scenario: Scenario, name: str, replicas: int, priority_class: str = ""
) -> dict[str, Any]:
    pod = scenario.pod_body("template", {NEURON: 1}, scheduler=SCHEDULER)
    template = {"metadata": {"labels": {"app": name}}, "spec": pod["spec"]}
    template["spec"]["terminationGracePeriodSeconds"] = 5
    if priority_class:
        template["spec"]["priorityClassName"] = priority_class
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": scenario.namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": template,
        },
    }
    created: dict[str, Any] = scenario.cp.request(
        "POST", f"/apis/apps/v1/namespaces/{scenario.namespace}/deployments", body
    )
    return created


def delete_deployments(scenario: Scenario) -> None:
    """Deployments and their ReplicaSets go first (orphaning the pods), so the scenario's
    cleanup deletes pods nothing recreates."""
    apps = f"/apis/apps/v1/namespaces/{scenario.namespace}"
    orphan = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Orphan"}
    for kind in ("deployments", "replicasets"):
        with contextlib.suppress(KubeError):
            for item in scenario.cp.request("GET", f"{apps}/{kind}")["items"]:
                with contextlib.suppress(KubeError):
                    scenario.cp.request(
                        "DELETE", f"{apps}/{kind}/{item['metadata']['name']}", orphan
                    )


def scatter(
    scenario: Scenario,
    instance_type: str,
    devices: int,
    holes: list[int],
    priority_class: str = "",
) -> str:
    """A node whose `holes` are free and whose other devices hold pods of Deployment `web`."""
    node = scenario.add_node(instance_type)
    for i in range(devices):
        scenario.create_pod(
            f"placeholder-{i}", {NEURON: 1}, scheduler=SCHEDULER, priority_class=priority_class
        )
    placed = wait_for(
        lambda: b if len(b := bound(scenario, "placeholder-")) == devices else None,
        "the placeholders bound",
        120,
    )
    for device, name in placed.items():
        if device not in holes:
            scenario.delete_pod(name)
    wait_for(
        lambda: (
            len(bound(scenario, "placeholder-")) == len(holes)
            and len(scenario.pods()) == len(holes)
        ),
        "the placeholders gone",
    )
    deployment(scenario, "web", devices - len(holes), priority_class)
    wait_for(
        lambda: len(bound(scenario, "web-")) == devices - len(holes),
        "the Deployment's pods bound",
        120,
    )
    for name in bound(scenario, "placeholder-").values():
        scenario.delete_pod(name)
    wait_for(lambda: not bound(scenario, "placeholder-"), "the holes free")
    assert sorted(set(range(devices)) - set(bound(scenario, "web-"))) == holes
    return node


def web_uids(scenario: Scenario) -> set[str]:
    return {
        p["metadata"]["uid"]
        for p in scenario.pods()
        if p["metadata"]["name"].startswith("web-") and not p["metadata"].get("deletionTimestamp")
    }


def big(scenario: Scenario, devices: int = 4, priority_class: str = "") -> float:
    scenario.create_pod(
        "big", {NEURON: devices}, scheduler=SCHEDULER, priority_class=priority_class
    )
    return time.monotonic()


def plan_of(scenario: Scenario, name: str = "big") -> Any:
    text = scenario.pod(name)["metadata"].get("annotations", {}).get(PLAN_ANNOTATION)
    return decode(text) if text else None


def settled(scenario: Scenario, web: int) -> Callable[[], bool]:
    """The Deployment's pods all bound and running again, none leaving."""

    def check() -> bool:
        pods = [p for p in scenario.pods() if p["metadata"]["name"].startswith("web-")]
        return len(pods) == web and all(
            p["spec"].get("nodeName") and p.get("status", {}).get("phase") == "Running"
            for p in pods
        )

    return check


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.compat
def test_a_ring_fragmented_by_a_deployment_frees_a_run_for_a_pod_of_equal_priority(
    world: World,
) -> None:
    """inf2.48xlarge (a ring of 12): Deployment pods on 8 devices, holes at 2, 5, 8, 11; a
    4-device pod of the same priority. Every run of four holds two pods and one hole at each
    end (2-5 holds 3 and 4): consolidation evicts the two pods of one run, their replacements
    take the two other holes, and the pod is bound on the run."""
    scenario = world.scenario
    stand_in = scenario.kubelet_stand_in()
    extender = world.extender("on")
    node = scatter(scenario, "inf2.48xlarge", 12, [2, 5, 8, 11])
    before = web_uids(scenario)
    created = big(scenario)
    pod = scenario.wait_bound("big", BOUND_WITHIN)
    waited = time.monotonic() - created
    placed = ids(pod)
    assert pod["spec"]["nodeName"] == node and len(placed) == 4
    # The stand-in records a pod it removed once its DELETE has answered, which on a busy machine
    # can come after the pod bound on the room that removal freed (a compatibility run on 1.36).
    wait_for(
        lambda: len([n for n in stand_in.finished if n.startswith("web-")]) >= 2,
        f"the stand-in to have removed two evicted pods ({stand_in.finished})",
        30,
    )
    evicted = [n for n in stand_in.finished if n.startswith("web-")]
    assert len(evicted) == 2, stand_in.finished
    wait_for(settled(scenario, 8), "the evicted pods running again", 120)
    after = web_uids(scenario)
    assert len(before - after) == 2 and len(after - before) == 2
    # Each moved pod's replacement got one of the other holes.
    holes_now = sorted(set(range(12)) - set(bound(scenario, "web-")) - set(placed))
    assert holes_now == []
    assert extender.metric("neuron_scheduler_consolidation_evicted_in_vain_total") == 0
    assert extender.metric('neuron_scheduler_consolidation_evictions_total{result="evicted"}') == 2
    wait_for(lambda: plan_of(scenario) is None, "the ended plan removed from the pod")
    assert extender.metric('neuron_scheduler_consolidation_plans_total{outcome="done"}') == 1
    assert extender.metric("neuron_scheduler_consolidation_plans_in_flight") == 0
    scenario.wait_event("big", "NeuronBlockHeld", f"devices {format_ids(placed)} ")
    scenario.wait_event("big", "NeuronConsolidation", "evicting ")
    print(f"\nbound {waited:.1f}s after it was created ({PENDING_SECONDS}s pending first)")


def test_dry_run_evicts_nothing_and_says_what_it_would(world: World) -> None:
    scenario = world.scenario
    scenario.kubelet_stand_in()
    world.extender("dry-run")
    node = scatter(scenario, "inf2.48xlarge", 12, [2, 5, 8, 11])
    before = web_uids(scenario)
    big(scenario)
    event = scenario.wait_event("big", "NeuronConsolidation", "would evict ", 120)
    message = event["message"]
    assert f" from node {node} to free devices " in message, message
    victims = message.removeprefix("would evict ").split(" from node ")[0].split(", ")
    assert len(victims) == 2 and all(v.startswith(f"{scenario.namespace}/web-") for v in victims)
    time.sleep(2 * PENDING_SECONDS)  # a few more rounds of planning
    assert web_uids(scenario) == before
    assert not scenario.pod("big")["spec"].get("nodeName")
    assert plan_of(scenario) is None
    print(f"\n{message}")


def test_a_budget_that_allows_no_disruption_stops_it_and_says_why(world: World) -> None:
    scenario = world.scenario
    scenario.kubelet_stand_in()
    extender = world.extender("on")
    scatter(scenario, "inf2.48xlarge", 12, [2, 5, 8, 11])
    scenario.cp.request(
        "POST",
        f"/apis/policy/v1/namespaces/{scenario.namespace}/poddisruptionbudgets",
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "web"},
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"app": "web"}}},
        },
    )
    wait_for(
        lambda: (
            scenario.cp.request(
                "GET", f"/apis/policy/v1/namespaces/{scenario.namespace}/poddisruptionbudgets/web"
            )
            .get("status", {})
            .get("expectedPods")
            == 8
        ),
        "the disruption controller to count the budget's pods",
    )
    before = web_uids(scenario)
    big(scenario)
    event = scenario.wait_event("big", "NeuronConsolidationBlocked", "PodDisruptionBudget", 120)
    assert "allows no disruption" in event["message"], event["message"]
    time.sleep(2 * PENDING_SECONDS)
    assert web_uids(scenario) == before
    assert extender.metric("neuron_scheduler_consolidation_evictions_total") == 0
    assert not scenario.pod("big")["spec"].get("nodeName")
    print(f"\n{event['message']}")


def test_a_higher_priority_pod_on_a_fragmented_torus_gets_a_row(world: World) -> None:
    """trn1.32xlarge: low-priority Deployment pods on 12 devices, one free device per row (3, 7,
    11, 15); a high-priority 4-device pod. kube-scheduler's dry run finds no victims (it fits by
    count) and never asks the preempt verb; consolidation evicts the three pods of one row."""
    scenario = world.scenario
    low = scenario.priority_class("low", LOW)
    high = scenario.priority_class("high", HIGH)
    stand_in = scenario.kubelet_stand_in()
    extender = world.extender("on")
    node = scatter(scenario, "trn1.32xlarge", 16, [3, 7, 11, 15], low)
    owners = bound(scenario, "web-")
    big(scenario, 4, high)
    pod = scenario.wait_bound("big", BOUND_WITHIN)
    placed = ids(pod)
    assert pod["spec"]["nodeName"] == node
    assert placed[0] % 4 == 0 and placed == list(range(placed[0], placed[0] + 4)), placed
    evicted = sorted(d for d, name in owners.items() if name in stand_in.finished)
    assert evicted and all(d // 4 == placed[0] // 4 for d in evicted), (evicted, placed)
    assert extender.metric("neuron_scheduler_consolidation_evicted_in_vain_total") == 0
    wait_for(settled(scenario, 12), "the evicted pods running again", 120)


@pytest.mark.parametrize("killed", ["after_evictions", "at_the_plan"])
def test_a_restart_in_the_middle_of_a_plan_leaves_no_hold_and_evicts_nothing_twice(
    world: World, killed: str
) -> None:
    """The victims stay Terminating (the stand-in holds them) while the extender is killed and
    started again, once all are evicted or as soon as the plan is written (between its
    evictions, or before the first): the restarted one rebuilds the plan's holds from the pod's
    annotation, evicts only what was not evicted, and once the victims go the plan finishes and
    lets go of everything."""
    scenario = world.scenario
    stand_in = scenario.kubelet_stand_in()
    stand_in.finishing.clear()
    extender = world.extender("on")
    node = scatter(scenario, "inf2.48xlarge", 12, [2, 5, 8, 11])
    big(scenario)
    plan = wait_for(lambda: plan_of(scenario), "the plan written on the pod", 120)
    assert extender.process.pid is not None
    if killed == "at_the_plan":
        os.kill(extender.process.pid, signal.SIGSTOP)  # (its next request never leaves)

    def terminating() -> set[str]:
        return {
            p["metadata"]["name"] for p in scenario.pods() if p["metadata"].get("deletionTimestamp")
        }

    victims = {v.pod.split("/")[1] for v in plan.victims}
    if killed == "after_evictions":
        wait_for(lambda: terminating() == victims, "the plan's pods evicted", 60)
    os.kill(extender.process.pid, signal.SIGKILL)
    extender.process.stop(kill=True)
    time.sleep(1)  # an eviction the API server was still serving has landed
    evicted_before = len(terminating())
    restarted = world.extender("on")
    wait_for(lambda: terminating() == victims, "the plan's pods evicted", 60)

    def replacements_placed() -> bool:
        return all(
            p["spec"].get("nodeName")
            for p in scenario.pods()
            if p["metadata"]["name"].startswith("web-")
        )

    # The victims' replacements take their held places outside the plan's block while the
    # victims terminate. In full suites one was left pending (the restarted leader nominated the
    # pod again, and kube-scheduler counted it on the node) and `small` took a place let go early
    # (pods of the Deployment created seconds before the plan counted as replacements).
    wait_for(replacements_placed, "the victims' replacements placed outside the block", 120)
    # The block is still held for the pod: a small pod of the same priority is refused there
    # for it, with the plan named.
    small = scenario.create_pod("small", {NEURON: 1}, scheduler="nobody")
    status, answer = restarted.call("filter", {"Pod": small, "NodeNames": [node]})
    if status != 200 or answer["NodeNames"] != []:
        # What the pods and a fresh read of the cluster (`why`, the same rebuild from a list)
        # say, for the next one to look at.
        pods = {
            p["metadata"]["name"]: (
                p["spec"].get("nodeName"),
                ids(p),
                bool(p["metadata"].get("deletionTimestamp")),
                p["status"].get("nominatedNodeName"),
            )
            for p in scenario.pods()
        }
        seen = command_json(scenario.cp, "why", "small", "-n", scenario.namespace)
        raise AssertionError(f"{answer}\npods: {pods}\nwhy small: {dump(seen['nodes'])}")
    assert "by a consolidation plan" in str(answer["FailedNodes"][node]), answer
    time.sleep(2 * PENDING_SECONDS)  # rounds of the restarted leader: nothing more to evict
    assert terminating() == victims
    evicted_after = len(victims) - evicted_before
    assert restarted.metric("neuron_scheduler_consolidation_evictions_total") == evicted_after
    stand_in.finishing.set()
    pod = scenario.wait_bound("big", BOUND_WITHIN)
    assert sorted(ids(pod)) == sorted(plan.devices)
    wait_for(settled(scenario, 8), "the evicted pods running again", 120)
    wait_for(lambda: plan_of(scenario) is None, "the ended plan removed from the pod")
    assert restarted.metric("neuron_scheduler_consolidation_plans_in_flight") == 0
    scenario.delete_pod("small")
    small = scenario.create_pod("small-2", {NEURON: 1}, scheduler="nobody")
    status, answer = restarted.call("filter", {"Pod": small, "NodeNames": [node]})
    assert "consolidation" not in str(answer.get("FailedNodes", {})), answer
    assert len([n for n in stand_in.finished if n.startswith("web-")]) == len(victims)
