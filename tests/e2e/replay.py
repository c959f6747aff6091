"""One workload replayed through the real kube-scheduler + extender and through the simulator
(issue 16 §2), shared by tests/e2e/test_replay.py (small) and bench/replay.py (40 nodes, 1,000
pods).

The workload goes in rounds: the pods due to leave are deleted together, the cluster settles;
the round's new pods are created in order, the cluster settles. The simulator gets the same
rounds as events at one instant each (sim/simulation.py releases pods deleted together before
retrying the waiting ones). Settled: kube-scheduler's active and backoff queues are empty, every
pod is bound or marked Unschedulable, and its attempt count has not moved for a while (with
podInitialBackoffSeconds 1, a retried pod shows up in that count within about a second).
"""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.sim.contenders import NEURON_SCHEDULER
from neuron_scheduler.sim.simulation import NodeSpec, PodEvent, SimResult
from neuron_scheduler.sim.workloads import DEFAULT_MIX, PodMix
from tests.e2e.harness import Scenario

# A quiet spell this long after the last attempt means kube-scheduler has nothing left to try
# (its backoff is 1 s in the testbed).
QUIET_SECONDS = 2.0


@dataclass(frozen=True, slots=True)
class Round:
    leaving: tuple[str, ...]
    arriving: tuple[tuple[str, NeuronRequest], ...]


@dataclass(frozen=True, slots=True)
class Replay:
    fleet: tuple[tuple[str, int], ...]
    rounds: tuple[Round, ...]

    @property
    def pods(self) -> int:
        return sum(len(r.arriving) for r in self.rounds)

    def requests(self) -> dict[str, NeuronRequest]:
        return {pod: request for r in self.rounds for pod, request in r.arriving}

    def events(self) -> list[PodEvent]:
        """The rounds as the simulator's events: departures at 2r, arrivals at 2r + 1 (pod
        names sort in creation order)."""
        events = []
        for index, current in enumerate(self.rounds):
            events += [PodEvent(2 * index, pod, None) for pod in current.leaving]
            events += [PodEvent(2 * index + 1, pod, req) for pod, req in current.arriving]
        return events


def plan(
    fleet: tuple[tuple[str, int], ...],
    pods: int,
    per_round: int,
    mean_rounds: float,
    seed: int,
    mix: tuple[PodMix, ...] = DEFAULT_MIX,
) -> Replay:
    """A seeded replay: `per_round` pods arrive each round; each is deleted after a number of
    rounds drawn from a geometric distribution of mean `mean_rounds` (whether it was placed or
    not: its owner gives up), or stays to the end."""
    rng = random.Random(seed)
    weights = [m.weight for m in mix]
    count = -(-pods // per_round)
    arriving: list[list[tuple[str, NeuronRequest]]] = [[] for _ in range(count)]
    leaving: list[list[str]] = [[] for _ in range(count)]
    for i in range(pods):
        kind = rng.choices(mix, weights)[0]
        request = NeuronRequest(kind.resource, rng.choice(kind.sizes))
        born = i // per_round
        name = f"r-{i:05d}"
        arriving[born].append((name, request))
        lifetime = 1 + int(rng.expovariate(1.0 / max(mean_rounds - 1, 1e-9)))
        if born + lifetime < count:
            leaving[born + lifetime].append(name)
    rounds = tuple(
        Round(tuple(sorted(gone)), tuple(new)) for gone, new in zip(leaving, arriving, strict=True)
    )
    return Replay(fleet, rounds)


@dataclass(slots=True)
class Outcome:
    """What a run ended with: pods ever placed, pods bound at the end, and what those ask for
    per instance type ("trn1.32xlarge neuron": devices, "... neuroncore": cores)."""

    placed: int = 0
    bound_at_end: int = 0
    pending_at_end: int = 0
    requested_by_type: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    def add(self, instance_type: str, request: NeuronRequest) -> None:
        self.requested_by_type[f"{instance_type} {request.resource.split('/')[-1]}"] += (
            request.count
        )


def simulate(replay: Replay, catalog: Catalog, seed: int = 0) -> tuple[Outcome, SimResult]:
    fleet = [NodeSpec(f"{kind}-{i}", kind) for kind, count in replay.fleet for i in range(count)]
    start = time.perf_counter()
    result = NEURON_SCHEDULER.run(fleet, catalog, replay.events(), seed)
    outcome = Outcome(placed=result.placed, seconds=time.perf_counter() - start)
    requests = replay.requests()
    for node in result.nodes:
        outcome.bound_at_end += len(node.pods)
        for pod in node.pods:
            outcome.add(node.spec.instance_type, requests[pod])
    outcome.pending_at_end = len(result.pending)
    return outcome, result


def run_real(
    scenario: Scenario, replay: Replay, settle_seconds: float = 120.0, isolated: bool = False
) -> Outcome:
    """Replay through the testbed's my-scheduler and extender (the scenario's nodes only).
    `isolated`: a nodeSelector on every pod (for the scenario's nodes, so all of them)."""
    node_types = {}
    for kind, count in replay.fleet:
        for _ in range(count):
            node_types[scenario.add_node(kind)] = kind
    # No nodeSelector on the pods: a pod that NodeAffinity refuses on some node is requeued
    # only by node events, not by deletions (kube-scheduler's queueing hints), which the
    # simulator does not model; so the cluster must hold the scenario's nodes and no others.
    others = {n["metadata"]["name"] for n in scenario.cp.request("GET", "/api/v1/nodes")["items"]}
    others -= set(node_types)
    assert not others, f"the replay needs a cluster of its own nodes; also found {sorted(others)}"
    settler = _Settler(scenario, settle_seconds)
    placed: set[str] = set()
    start = time.perf_counter()
    for current in replay.rounds:
        if current.leaving:
            for pod in current.leaving:
                scenario.delete_pod(pod)
            placed |= settler.settle()
        for pod, request in current.arriving:
            scenario.create_pod(pod, {request.resource: request.count}, isolated=isolated)
        placed |= settler.settle()
    outcome = Outcome(placed=len(placed), seconds=time.perf_counter() - start)
    requests = replay.requests()
    for pod in scenario.pods():
        node = pod["spec"].get("nodeName")
        if node:
            outcome.bound_at_end += 1
            outcome.add(node_types[node], requests[pod["metadata"]["name"]])
        else:
            outcome.pending_at_end += 1
    return outcome


_SAMPLE = re.compile(r"^(\w+)(\{[^}]*\})? ([0-9.e+-]+)$")


class _Settler:
    def __init__(self, scenario: Scenario, seconds: float) -> None:
        self.scenario = scenario
        self.seconds = seconds
        scheduler = scenario.stack.scheduler
        assert scheduler is not None, "the stack runs my-scheduler"
        self.scheduler = scheduler
        self.token = scenario.cp.admin_token

    def _metrics(self) -> tuple[float, float, float]:
        """Pods in the active and backoff queues, and scheduling attempts so far."""
        active = backoff = attempts = 0.0
        for line in self.scheduler.metrics(self.token).splitlines():
            match = _SAMPLE.match(line)
            if not match:
                continue
            name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
            if name == "scheduler_pending_pods" and 'queue="active"' in labels:
                active = value
            elif name == "scheduler_pending_pods" and 'queue="backoff"' in labels:
                backoff = value
            elif name == "scheduler_schedule_attempts_total":
                attempts += value
        return active, backoff, attempts

    def settle(self) -> set[str]:
        """Wait until kube-scheduler has nothing left to try; the names of the pods bound then."""
        deadline = time.monotonic() + self.seconds
        quiet_since: float | None = None
        last = -1.0
        while True:
            active, backoff, attempts = self._metrics()
            pods = self.scenario.pods()
            undecided = [p for p in pods if not p["spec"].get("nodeName") and not _refused(p)]
            now = time.monotonic()
            if active or backoff or undecided or attempts != last:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= QUIET_SECONDS:
                return {p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")}
            last = attempts
            if now > deadline:
                raise AssertionError(
                    f"kube-scheduler did not settle in {self.seconds:.0f}s: active {active}, "
                    f"backoff {backoff}, {len(undecided)} pods undecided"
                )
            time.sleep(0.25)


def _refused(pod: dict[str, Any]) -> bool:
    for condition in pod.get("status", {}).get("conditions", []):
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return True
    return False


def compare(real: Outcome, sim: Outcome) -> dict[str, float]:
    """How far the simulator is from the real run: relative differences (0.01 = 1%)."""
    kinds = set(real.requested_by_type) | set(sim.requested_by_type)
    total = sum(real.requested_by_type.values()) or 1
    moved = sum(abs(real.requested_by_type[k] - sim.requested_by_type[k]) for k in kinds)
    return {
        "placed": abs(real.placed - sim.placed) / max(real.placed, 1),
        "bound_at_end": abs(real.bound_at_end - sim.bound_at_end) / max(real.bound_at_end, 1),
        # Share of the real run's requested units that sit on another instance type in the
        # simulator (each unit counted once on each side, so up to 2).
        "requested_by_type": moved / total,
    }
