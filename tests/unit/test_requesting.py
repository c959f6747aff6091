"""Capacity requests (extender/loops/requesting) on views fed as the watches feed them and a fake
API: when a node is asked for, what the placeholder says, what happens when a node comes or does
not, and what a restart or a new leader cleans up."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry

from neuron_scheduler.core import capacity, planrecord
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NEURON, NeuronRequest
from neuron_scheduler.extender.loops import requesting
from neuron_scheduler.extender.loops.consolidating import Concluded, Consolidator, Limits, Mode
from neuron_scheduler.extender.loops.evictionbudget import EvictionBudget
from neuron_scheduler.extender.loops.requesting import (
    HOLD_SECONDS,
    CapacityLimits,
    CapacityMode,
    CapacityRequester,
)
from neuron_scheduler.extender.state.budgets import DisruptionBudgets
from neuron_scheduler.extender.state.ledger import Claimant, Ledger
from neuron_scheduler.extender.state.movability import Movability
from neuron_scheduler.extender.state.pending import PendingPods
from neuron_scheduler.extender.state.placeholders import Placeholders, PodRouter, is_placeholder
from neuron_scheduler.extender.state.plans import Plans
from neuron_scheduler.kube.objects import ObjectRef, Pod
from neuron_scheduler.kube.reading import KUEUE_ADMISSION_GATE
from tests.builders import node, pod_json
from tests.unit import test_consolidating as consolidating
from tests.unit.test_consolidating import FakeAPI as ConsolidationAPI

CATALOG = Catalog.builtin()
NOW = 1_800_000_000.0
CREATED = "2027-01-15T08:00:00Z"  # NOW is 2027-01-15T08:00:00Z
NAMESPACE = "neuron-system"


class Clock:
    def __init__(self) -> None:
        self.now = NOW + 180

    def __call__(self) -> float:
        return self.now


class FakeAPI(ConsolidationAPI):
    """Records what the requester writes; `created` holds the placeholders it made."""

    def __init__(self) -> None:
        super().__init__()
        self.created: dict[str, dict[str, Any]] = {}
        self.names = itertools.count()
        self.refuse_create = False

    async def create_pod(self, namespace: str, body: dict[str, Any]) -> Pod:
        await asyncio.sleep(0)
        if self.refuse_create:
            from neuron_scheduler.kube.errors import api_error

            raise api_error("POST", "pods", 403, b'{"message": "forbidden"}')
        number = next(self.names)
        body = msgspec.json.decode(msgspec.json.encode(body))
        body["metadata"].update(name=f"capacity-request-{number}", uid=f"ph-{number}")
        self.created[body["metadata"]["name"]] = body
        self.calls.append(("create", namespace, body["metadata"]["name"]))
        return msgspec.convert(body, Pod)

    async def delete_pod(self, namespace: str, name: str, uid: str) -> None:
        await asyncio.sleep(0)
        self.calls.append(("delete", namespace, name))

    async def patch_pod_condition(
        self, namespace: str, name: str, uid: str, condition: dict[str, str]
    ) -> None:
        self.calls.append(("condition", name, condition["reason"]))

    async def patch_annotations(
        self,
        namespace: str,
        name: str,
        uid: str,
        values: dict[str, str | None],
        *,
        resource_version: str | None = None,
    ) -> str:
        for key, value in values.items():
            self.calls.append(("annotate", name, key, value or ""))
        return "1"


def on_device(name: str, node_name: str, device: int) -> Pod:
    """A bare one-device pod on the device (inf2 and trn1 both have 2 cores a device)."""
    return consolidating.on_device(pod_json(name, {NEURON: 1}, uid=name), node_name, device)


def stuck(name: str = "big", devices: int = 4, **extra: Any) -> Pod:
    body = pod_json(name, {NEURON: devices}, uid=name)
    body["metadata"]["creationTimestamp"] = CREATED
    body["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    ]
    body["spec"].update(extra)
    body["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "2", "memory": "8Gi"}
    return msgspec.convert(body, Pod)


class World:
    """One inf2.48xlarge ring, `r1`, whose devices hold bare pods but 2, 5, 8 and 11 (no two
    free devices in a row: nothing may move); a 4-device pod has waited two minutes."""

    def __init__(self, mode: CapacityMode = CapacityMode.ON, **limits: Any) -> None:
        self.clock = Clock()
        self.api = FakeAPI()
        self.events: list[tuple[str, str, str]] = []
        self.ledger = Ledger(CATALOG, report=self._report, wall_clock=self.clock)
        self.movability = Movability()
        self.plans = Plans(self.ledger, self.movability, self.clock)
        self.pending = PendingPods(["my-scheduler"])
        consolidation = Limits(limits.pop("consolidation", Mode.DRY_RUN))
        budget = EvictionBudget(self.api, "kube-system", "budget", 30, 0, 2, self.clock)  # type: ignore[arg-type]
        self.consolidator = Consolidator(
            self.ledger,
            self.movability,
            self.plans,
            DisruptionBudgets(),
            self.api,  # type: ignore[arg-type]
            budget,
            self.pending,
            CollectorRegistry(),
            limits=consolidation,
            report=self._report,
            wall_clock=self.clock,
        )
        self.placeholders = Placeholders(NAMESPACE)
        self.limits = CapacityLimits(mode, namespace=NAMESPACE, owner="ours", **limits)
        self.requester = CapacityRequester(
            self.ledger,
            CATALOG,
            self.placeholders,
            self.plans,
            self.pending,
            self.consolidator,
            self.api,
            CollectorRegistry(),
            limits=self.limits,
            report=self._report,
            wall_clock=self.clock,
        )
        self.router = PodRouter(
            (self.ledger, self.movability, self.plans, self.pending, self.consolidator),
            self.placeholders,
        )
        self.ledger.replace_nodes([node("r1", "inf2.48xlarge")])
        self.pods: dict[str, Pod] = {}
        for device in range(12):
            if device % 3 != 2:
                self.pods[f"x{device}"] = on_device(f"x{device}", "r1", device)
        self.pods["big"] = stuck()
        self.router.replace_pods(list(self.pods.values()))

    def _report(
        self, ref: ObjectRef, reason: str, message: str, warning: bool, name: str = ""
    ) -> None:
        self.events.append((ref.name, reason, message))

    def apply(self, pod: Pod) -> None:
        self.pods[pod.metadata.name] = pod
        self.router.apply_pod(pod)

    def watch_created(self) -> None:
        """The watch shows the placeholders created (and, with a status, unschedulable)."""
        for body in self.api.created.values():
            self.apply(msgspec.convert(body, Pod))

    def step(self) -> None:
        asyncio.run(self.requester.step())

    def created(self) -> list[str]:
        return [c[2] for c in self.api.calls if c[0] == "create"]

    def deleted(self) -> list[str]:
        return [c[2] for c in self.api.calls if c[0] == "delete"]

    def add_node(
        self, name: str, instance_type: str = "inf2.48xlarge", taints: list[Any] | None = None
    ) -> None:
        added = node(name, instance_type)
        if taints:
            added = msgspec.convert(
                {**msgspec.to_builtins(added), "spec": {"taints": taints}}, type(added)
            )
        self.ledger.replace_nodes([node("r1", "inf2.48xlarge"), added])


def test_off_asks_for_nothing_and_removes_its_own_placeholders_only() -> None:
    world = World(CapacityMode.OFF)
    world.step()
    assert world.api.calls == []
    on = World()
    on.step()
    body = on.api.created["capacity-request-0"]
    ours = msgspec.convert(body, Pod)
    theirs = msgspec.convert(
        {
            **body,
            "metadata": {
                **body["metadata"],
                "uid": "t",
                "name": "t",
                "labels": {capacity.PLACEHOLDER_LABEL: "other"},
            },
        },
        Pod,
    )
    world.apply(ours)
    world.apply(theirs)
    world.step()
    assert world.deleted() == ["capacity-request-0"]


def test_a_stranded_pod_nothing_may_move_for_gets_one_placeholder_for_a_whole_node() -> None:
    world = World()
    world.step()
    assert world.created() == ["capacity-request-0"]
    body = world.api.created["capacity-request-0"]
    meta, spec = body["metadata"], body["spec"]
    assert meta["namespace"] == NAMESPACE
    assert meta["labels"] == {capacity.PLACEHOLDER_LABEL: "ours"}
    asked = capacity.decode(meta["annotations"][capacity.RECORD_ANNOTATION])
    assert (asked.pod, asked.uid, asked.instance_type) == ("default/big", "big", "inf2.48xlarge")
    assert asked.until == world.clock.now + world.limits.timeout
    assert spec["schedulerName"] == capacity.PLACEHOLDER_SCHEDULER
    assert spec["priorityClassName"] == capacity.PRIORITY_CLASS
    assert spec["nodeSelector"]["node.kubernetes.io/instance-type"] == "inf2.48xlarge"
    (container,) = spec["containers"]
    # The whole node (no node with anything on it fits by count), and the pod's cpu and memory.
    assert container["resources"]["limits"] == {NEURON: "12"}
    assert container["resources"]["requests"] == {NEURON: "12", "cpu": "2", "memory": "8Gi"}
    assert ("condition", "capacity-request-0", "Unschedulable") in world.api.calls
    (event,) = [e for e in world.events if e[1] == "NeuronCapacityRequested"]
    assert "inf2.48xlarge" in event[2] and "free by count on r1" in event[2]
    world.watch_created()
    world.step()
    assert world.created() == ["capacity-request-0"]  # one per pod
    # The placeholder is no pod in any view but its own.
    assert is_placeholder(msgspec.convert(body, Pod))
    assert world.pending.get("ph-0") is None and "ph-0" not in world.movability.pods
    assert world.ledger.demand.version == World().ledger.demand.version


def test_a_gated_pod_gets_no_placeholder_until_its_gates_are_gone() -> None:
    """Issue 48: Kueue's gate holds the pod back until its workload is admitted; no node is asked
    for it meanwhile (nor is it counted among the stranded pods no node was asked for)."""
    world = World(max_in_flight=0)
    world.apply(stuck(schedulingGates=[{"name": KUEUE_ADMISSION_GATE}]))
    world.step()
    assert world.created() == []
    assert world.requester.metrics.blocked.labels("max_in_flight")._value.get() == 0
    world = World()
    world.apply(stuck(schedulingGates=[{"name": KUEUE_ADMISSION_GATE}]))
    world.step()
    assert world.created() == [] and world.events == []
    world.apply(stuck())  # admitted: the gate is gone
    world.step()
    assert world.created() == ["capacity-request-0"]


def test_a_young_pod_or_one_consolidation_may_still_help_is_not_asked_for() -> None:
    world = World(pending_seconds=600)
    world.step()
    assert world.created() == []
    world = World(consolidation=Mode.ON)
    world.consolidator.remove_pod("big")
    world.step()
    assert world.created() == []  # consolidation has not looked at it yet
    asyncio.run(world.consolidator.step())  # bare pods only: no move
    assert world.consolidator.concluded("big") is Concluded.NO_MOVE
    world.step()
    assert world.created() == ["capacity-request-0"]


def test_at_most_max_in_flight_at_once() -> None:
    world = World(max_in_flight=1)
    world.apply(stuck("big2"))
    world.step()
    assert len(world.created()) == 1
    assert world.requester.metrics.blocked.labels("max_in_flight")._value.get() == 1


def test_the_smallest_allowed_type_that_holds_the_block_and_the_pod_admits() -> None:
    world = World(instance_types=("inf2.24xlarge", "inf2.48xlarge", "inf2.xlarge"))
    world.step()
    body = world.api.created["capacity-request-0"]
    assert body["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] == "inf2.24xlarge"
    assert body["spec"]["containers"][0]["resources"]["limits"] == {NEURON: "6"}
    world = World(instance_types=("inf2.24xlarge", "inf2.48xlarge"))
    pinned = stuck(nodeSelector={"node.kubernetes.io/instance-type": "inf2.48xlarge"})
    world.apply(pinned)
    world.step()
    body = world.api.created["capacity-request-0"]
    assert body["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] == "inf2.48xlarge"
    world = World(instance_types=("inf2.xlarge",))
    world.step()
    assert world.created() == []
    assert any(e[1] == "NeuronCapacityRequestImpossible" for e in world.events)


def test_when_the_node_comes_the_block_is_held_then_the_placeholder_goes() -> None:
    world = World()
    world.step()
    world.watch_created()
    # Not registered yet: Karpenter's taint keeps the pod off.
    taint = [{"key": "karpenter.sh/unregistered", "effect": "NoExecute"}]
    world.add_node("new", taints=taint)
    world.step()
    assert world.deleted() == []
    world.add_node("new")
    world.step()
    kinds = [c[0] for c in world.api.calls]
    assert kinds[-3:] == ["annotate", "delete", "nominate"], world.api.calls
    annotate = world.api.calls[-3]
    record = planrecord.decode(annotate[3])
    assert record.kind is planrecord.PlanKind.CAPACITY and record.node == "new"
    assert record.until == world.clock.now + HOLD_SECONDS
    assert world.api.calls[-1] == ("nominate", "big", "new")
    # Held against any other pod of equal priority, on every replica (the annotation).
    small = stuck("small", 12)
    claimant = Claimant.of(small, NeuronRequest(NEURON, 12))
    assert not world.ledger.fill_verdicts(
        ["new"], NeuronRequest(NEURON, 12), claimant=claimant, policy=world.requester.policy
    ).fitting()
    assert any(e[1] == "NeuronCapacityArrived" for e in world.events)
    assert world.requester.metrics.requests.labels("fulfilled")._value.get() == 1
    # The pod is bound there: the hold ends, done.
    body = msgspec.to_builtins(world.pods["big"])
    body["metadata"].setdefault("annotations", {})[planrecord.PLAN_ANNOTATION] = annotate[3]
    body["spec"]["nodeName"] = "new"
    world.apply(msgspec.convert(body, Pod))
    assert world.plans.plans["big"].ended == "done"
    assert world.requester.metrics.holds.labels("done")._value.get() == 1
    assert world.consolidator.metrics.plans.labels("done")._value.get() == 0


def test_no_node_in_time_removes_the_placeholder_says_so_and_waits_before_asking_again() -> None:
    world = World(timeout=600)
    world.step()
    world.watch_created()
    world.clock.now += 601
    world.step()
    assert world.deleted() == ["capacity-request-0"]
    (event,) = [e for e in world.events if e[1] == "NeuronCapacityRequestTimedOut"]
    assert "within 600s" in event[2]
    world.router.remove_pod("ph-0")
    world.step()
    assert world.created() == ["capacity-request-0"]  # not again yet
    world.clock.now += 601
    world.step()
    assert world.created() == ["capacity-request-0", "capacity-request-1"]


def test_a_new_leader_removes_placeholders_whose_pod_went_fits_or_has_a_hold() -> None:
    world = World()
    world.step()
    world.watch_created()
    restarted = World()
    restarted.apply(msgspec.convert(world.api.created["capacity-request-0"], Pod))
    restarted.pods.pop("big")
    restarted.router.remove_pod("big")
    restarted.step()
    assert restarted.deleted() == ["capacity-request-0"]
    # An unreadable record goes too.
    broken = World()
    body = dict(world.api.created["capacity-request-0"])
    body["metadata"] = {**body["metadata"], "annotations": {capacity.RECORD_ANNOTATION: "{"}}
    broken.apply(msgspec.convert(body, Pod))
    broken.step()
    assert "capacity-request-0" in broken.deleted()


def test_a_bound_pod_is_never_a_placeholder() -> None:
    world = World()
    world.step()
    body = dict(world.api.created["capacity-request-0"])
    body["spec"] = {**body["spec"], "nodeName": "r1"}
    bound = msgspec.convert(body, Pod)
    assert not is_placeholder(bound)
    world.apply(bound)
    assert "ph-0" not in world.placeholders.pods
    assert world.ledger.holding("ph-0") is not None  # it holds its size, as any pod


def test_a_refused_create_is_told_on_the_pod() -> None:
    world = World()
    world.api.refuse_create = True
    world.step()
    (event,) = [e for e in world.events if e[1] == "NeuronCapacityRequestFailed"]
    assert "Role needs create on pods" in event[2]


def test_a_pod_bound_on_the_node_that_came_before_its_block_was_held_ends_the_request() -> None:
    """kube-scheduler may bind the pod on the new node as soon as it registers, before a step
    here holds the block: the placeholder goes at once (the watch of the bound pod wakes the
    loop) and the request counts as fulfilled."""
    world = World()
    world.step()
    world.watch_created()
    world.add_node("new")
    bound = msgspec.to_builtins(world.pods["big"])
    bound["spec"]["nodeName"] = "new"
    bound["metadata"]["annotations"] = {
        "AWS_NEURON_IDS": "0,1,2,3",
        "NEURON_RESOURCE_TYPE": NEURON,
        "NEURON_CORES": "0-7",
        "NEURON_DEVS": "0,1,2,3",
        "NEURON_NODE": "new",
    }
    world.requester._signal.clear()
    world.apply(msgspec.convert(bound, Pod))
    world.requester.apply_pod(msgspec.convert(bound, Pod))
    assert world.requester._signal.is_set()
    world.step()
    assert world.deleted() == ["capacity-request-0"]
    assert world.requester.metrics.requests.labels("fulfilled")._value.get() == 1
    assert any(e[1] == "NeuronCapacityArrived" and "bound there" in e[2] for e in world.events)


def foreign_placeholder(number: int) -> Pod:
    """A pod anyone may create in their own namespace that looks like a placeholder: our label
    and scheduler name, no node."""
    body = pod_json(f"fake-{number}", {NEURON: 1}, uid=f"fake-{number}")
    body["metadata"]["namespace"] = "user"
    body["metadata"]["labels"] = {capacity.PLACEHOLDER_LABEL: "ours"}
    body["spec"]["schedulerName"] = capacity.PLACEHOLDER_SCHEDULER
    return msgspec.convert(body, Pod)


def test_pods_like_placeholders_in_other_namespaces_never_lift_the_in_flight_bound() -> None:
    """Placeholders the view keeps are bounded; pods users create with the placeholder's label
    and scheduler name in their own namespaces must not fill that bound, or the leader no longer
    sees its own: `max_in_flight` no longer holds and none is ever deleted."""
    world = World(max_in_flight=1)
    world.placeholders.limit = 3
    for number in range(3):
        world.apply(foreign_placeholder(number))
    world.step()
    world.watch_created()
    world.step()
    world.step()
    assert world.created() == ["capacity-request-0"]
    assert [p.name for p in world.requester.mine()] == ["capacity-request-0"]
    # Still none of them counts as a pod in any view.
    assert world.pending.get("fake-0") is None


def test_consolidation_evicts_nothing_for_a_pod_whose_node_is_already_asked_for() -> None:
    """A node asked for is coming (an autoscaler does not call back a launch): a plan that
    becomes possible meanwhile would evict pods for a pod that gets a node anyway, and the node
    would come for nothing."""
    world = World(consolidation=Mode.ON)
    asyncio.run(world.consolidator.step())
    assert world.consolidator.concluded("big") is Concluded.NO_MOVE
    world.step()
    world.watch_created()
    assert world.created() == ["capacity-request-0"]
    # Devices 3 and 4 now hold replicas, which may move to devices 8 and 11: a plan exists.
    for device in (3, 4):
        world.router.remove_pod(f"x{device}")
        world.apply(consolidating.on_device(consolidating.owned(f"w{device}"), "r1", device))
    world.clock.now += 60
    asyncio.run(world.consolidator.step())
    assert [c for c in world.api.calls if c[0] == "evict"] == []
    assert "big" not in world.plans.plans
    world.step()
    assert world.deleted() == []  # the placeholder still waits for its node


def test_a_placeholder_whose_condition_could_not_be_written_gets_it_on_the_next_step() -> None:
    """Autoscalers look only at pods whose PodScheduled condition says Unschedulable, and nothing
    else writes a placeholder's status: one left without it (an API error) asks for nothing
    until it times out."""
    world = World()
    failures = [api_error_500()]

    async def condition(namespace: str, name: str, uid: str, value: dict[str, str]) -> None:
        if failures:
            raise failures.pop()
        world.api.calls.append(("condition", name, value["reason"]))

    world.api.patch_pod_condition = condition  # type: ignore[method-assign]
    world.step()
    assert not [c for c in world.api.calls if c[0] == "condition"]
    world.watch_created()  # as created: no condition
    world.step()
    assert ("condition", "capacity-request-0", "Unschedulable") in world.api.calls
    # Once the watch shows it, it is not written again.
    body = world.api.created["capacity-request-0"]
    body["status"] = {
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    }
    world.watch_created()
    writes = len(world.api.calls)
    world.step()
    assert [c for c in world.api.calls[writes:] if c[0] == "condition"] == []


def api_error_500() -> Exception:
    from neuron_scheduler.kube.errors import api_error

    return api_error("PATCH", "pods/status", 500, b'{"message": "etcd timeout"}')


def behind(ahead: list[Pod]) -> World:
    """The world with its stranded 4-device pod created after `ahead`."""
    world = World()
    world.pods.pop("big")
    world.router.remove_pod("big")
    for pod in ahead:
        world.apply(pod)
    world.apply(stuck("big"))
    return world


def test_each_step_judges_a_few_pods_and_one_not_stranded_only_again_later() -> None:
    """Each judgement reads every node: 40 pending pods that fit nowhere by count (no node has 13
    devices) are judged 8 a step, and not again for a while, so the stranded pod behind them is
    reached within a few steps."""
    world = behind([stuck(f"huge-{n:02d}", devices=13, priority=10) for n in range(40)])
    judged: list[str] = []
    real = requesting.stranded

    def counting(ledger: Any, pod: Pod, *args: Any) -> Any:
        judged.append(pod.metadata.name)
        return real(ledger, pod, *args)

    requesting.stranded = counting  # type: ignore[assignment]
    try:
        for _ in range(6):  # 40 / 8 steps, then big's
            world.step()
            assert len(judged) <= requesting.JUDGED_PER_STEP
            if world.created():
                break
            judged.clear()
    finally:
        requesting.stranded = real
    assert world.created() == ["capacity-request-0"]
    meta = world.api.created["capacity-request-0"]["metadata"]
    assert capacity.decode(meta["annotations"][capacity.RECORD_ANNOTATION]).pod == "default/big"
    # The pods judged not stranded are judged again only later, not at every step.
    judged.clear()
    requesting.stranded = counting  # type: ignore[assignment]
    try:
        world.step()
    finally:
        requesting.stranded = real
    assert judged == []


def judging_until_asked(world: World, steps: int) -> list[str]:
    """Steps 2 s apart until a placeholder is created, at most `steps`."""
    for _ in range(steps):
        world.step()
        if world.created():
            break
        world.clock.now += requesting.STEP_SECONDS
    return world.created()


def test_a_stranded_pod_behind_many_pods_that_stay_pending_is_reached() -> None:
    """More pending pods ranked above it (priority, age) than are judged in one
    JUDGE_AGAIN_SECONDS, none stranded (no node has 13 devices): they come back every 30 s,
    and the stranded pod behind them must still be judged, not wait for them to go."""
    world = behind([stuck(f"huge-{n:03d}", devices=13, priority=10) for n in range(200)])
    assert judging_until_asked(world, 100) == ["capacity-request-0"]
    meta = world.api.created["capacity-request-0"]["metadata"]
    assert capacity.decode(meta["annotations"][capacity.RECORD_ANNOTATION]).pod == "default/big"


def test_pods_no_instance_type_holds_do_not_keep_the_others_waiting() -> None:
    """JUDGED_PER_STEP stranded pods of higher priority that no instance type the pod may go
    to holds (they name their node: a new one never has that name) are judged, told, and must
    not take every step's judgements from the pod behind them."""
    named = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["r1"]}]}
                ]
            }
        }
    }
    world = behind(
        [
            stuck(f"named-{n}", priority=10, affinity=named)
            for n in range(requesting.JUDGED_PER_STEP)
        ]
    )
    assert judging_until_asked(world, 20) == ["capacity-request-0"]
    assert sum(e[1] == "NeuronCapacityRequestImpossible" for e in world.events) == 8
