"""How soon a pod waiting for room gets it, for every way room frees (issue 31).

The real kube-scheduler v1.36.3 (tools/kube) as the chart configures it, with its own defaults for
backoff (1 s doubling to 10 s) and for the flush of unschedulable pods (5 minutes), calls our
extender. Every pod has a nodeSelector, and a node it excludes is in the cluster. Each kind of
freeing is staged `--rounds` times, one round at a time in an otherwise quiet cluster, with a
waiting pod that the extender refused (the room is free by count, not as a block):

- deleted: a 2-device pod on an inf2.48xlarge ring whose free devices are all single; the pod
  next to a hole is deleted;
- completed: the same, but the pod next to the hole completes (phase Succeeded);
- batch: many deletions at once under load: 12 rings (`--rings`) full of 1-device pods and
  2-device pods waiting; half the 1-device pods are deleted in one go (each waiting pod that fits
  right after counts, until none fits);
- failed-bind: the ids a bind wrote on a pod that stays pending (its Binding never came) hold a
  pair until `ANNOUNCED_SECONDS` after they were written; nothing in the cluster marks the end;
- preemption: a pair held for a higher-priority pod nominated to the ring; that pod is deleted;
- claim: an UltraServer unit the extender reserved for a training job whose member no
  scheduler places; another job's member waits until that claim ends (the extender runs with
  --ultraserver-claim-seconds 15).

For each: seconds from the freeing event (the API call, or the hold's end) to the bind, p50 / p99
/ max, the most wake writes one pod got in one round, and the rounds in which the extender woke a
pod (with writes off: would have woken one, as it logs). A round not bound within `--cap`
counts as the cap. `--wake-rate 0` is the extender before issue 31 (it only logs whom it would
wake).

Run: uv run python bench/requeue.py [--rounds 20] [--cap 60] [--wake-rate 20] [--kinds ...]
     [--batch-rounds 5] [--rings 12]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from fleet import NEURON, ROOT
from neuron_scheduler.core import handoff
from neuron_scheduler.core.allocation import NodeState, Placement, allocate
from neuron_scheduler.core.catalog import Catalog
from neuron_scheduler.core.ids import ids_mask
from neuron_scheduler.core.resources import NeuronRequest
from neuron_scheduler.extender.state.ledger import ANNOUNCED_SECONDS
from tests.builders import neuron_capacity, node_json
from tests.e2e.harness import Scenario, ids, wait_for
from tests.testbed import ControlPlane, Stack, find_kubebin, scheduler_config

RING = "inf2.48xlarge"
CLAIM_SECONDS = 15.0
HOLD_LEFT = 10.0  # seconds a staged hold has left once its waiting pod is created
SETTLE = 3.0  # seconds after a pod's first refusal: kube-scheduler's retry of it is done
ULTRASERVER = {
    "neuron.amazonaws.com/ultraserver-mode": "1_2_4",
    "neuron.amazonaws.com/ultraserver-server-id-4": "b0b0b0b0b0b0b0b0",
}


class Bench:
    """One stage's nodes and pods (a scenario of its own: its pods select its nodes only)."""

    def __init__(self, stack: Stack, cap: float) -> None:
        self.stack = stack
        self.cp = stack.cp
        self.cap = cap
        self.scenario = Scenario(stack)
        self.rounds = 0

    def name(self, what: str) -> str:
        self.rounds += 1
        return f"{what}-{self.rounds}"

    # --- staging -----------------------------------------------------------------------------

    def node(self, instance_type: str = RING, labels: dict[str, str] | None = None) -> str:
        name = self.scenario.add_node(instance_type)
        if labels:
            self.cp.request(
                "PATCH",
                f"/api/v1/nodes/{name}",
                {"metadata": {"labels": labels}},
                content_type="application/merge-patch+json",
            )
        return name

    def bind_directly(self, pod: str, devices: int, node: str, **kwargs: Any) -> dict[str, Any]:
        """A pod of no scheduler, bound by calling the extender's bind (deterministic ids)."""
        created = self.scenario.create_pod(pod, {NEURON: devices}, scheduler="nobody", **kwargs)
        error = self.stack.extender.bind(created, node)
        assert not error, error
        return self.scenario.pod(pod)

    def holed_ring(
        self, node: str, prefix: str, free_pairs: int = 0, held: int = 0
    ) -> dict[int, str]:
        """The ring filled with 1-device pods (`held` devices are held already), then every
        other one deleted (free devices all single), except that `free_pairs` pairs (0,1; 2,3
        ...) are left whole. Device -> pod."""
        pods = {}
        for i in range(12 - held):
            pod = self.bind_directly(f"{prefix}-{i}", 1, node)
            pods[ids(pod)[0]] = pod["metadata"]["name"]
        for device in range(12):
            if device in pods and (device < 2 * free_pairs or device % 2 == 1):
                self.scenario.delete_pod(pods.pop(device))
        return pods

    def refused(self, pod: str) -> None:
        def unschedulable() -> bool:
            for condition in self.scenario.pod(pod).get("status", {}).get("conditions", []):
                if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
                    return True
            return False

        wait_for(unschedulable, f"{pod} to be refused", 60)
        time.sleep(SETTLE)
        assert not self.scenario.pod(pod)["spec"].get("nodeName"), f"{pod} was not refused"

    def bound_after(self, pod: str, since: float) -> float:
        """Seconds from `since` (wall clock) to the pod's bind; the cap if it is not bound."""
        deadline = since + self.cap
        while time.time() < deadline:
            if self.scenario.pod(pod)["spec"].get("nodeName"):
                return max(0.0, time.time() - since)
            time.sleep(0.05)
        return self.cap

    def clear(self) -> None:
        for pod in self.scenario.pods():
            self.scenario.delete_pod(pod["metadata"]["name"])
        wait_for(lambda: not self.scenario.pods(), "the round's pods to go", 60)
        time.sleep(1.0)

    # --- the kinds ---------------------------------------------------------------------------

    def deleted(self, node: str, complete: bool = False) -> list[float]:
        holders = self.holed_ring(node, self.name("holder"))
        waiter = self.name("waiter")
        self.scenario.create_pod(waiter, {NEURON: 2})
        self.refused(waiter)
        neighbour = holders[0]  # device 1 is a hole: 0,1 frees
        start = time.time()
        if complete:
            self.cp.request(
                "PATCH",
                f"/api/v1/namespaces/{self.scenario.namespace}/pods/{neighbour}/status",
                {"status": {"phase": "Succeeded"}},
                content_type="application/merge-patch+json",
            )
        else:
            self.scenario.delete_pod(neighbour)
        return [self.bound_after(waiter, start)]

    def failed_bind(self, node: str) -> list[float]:
        written = time.time_ns() - int((ANNOUNCED_SECONDS - HOLD_LEFT - SETTLE - 2) * 1e9)
        topology = Catalog.builtin().resolve(RING, *neuron_capacity(RING)).topology
        request = NeuronRequest(NEURON, 2)
        pair = allocate(topology, NodeState(0), request)
        assert isinstance(pair, Placement) and pair.devices == (0, 1), pair
        self.scenario.create_pod(
            self.name("failed-bind"),
            {NEURON: 2},
            scheduler="nobody",
            annotations=handoff.encode(node, request, pair, ["c0"], written),
        )
        time.sleep(0.5)  # the extender's watch has it
        holders = self.holed_ring(node, self.name("holder"), held=2)
        assert 0 not in holders and 1 not in holders, holders
        waiter = self.name("waiter")
        self.scenario.create_pod(waiter, {NEURON: 2})
        self.refused(waiter)
        ends = written / 1e9 + ANNOUNCED_SECONDS
        assert time.time() < ends, "the hold ended before the waiting pod was refused"
        return [self.bound_after(waiter, ends)]

    def preemption(self, node: str) -> list[float]:
        high = self.scenario.priority_class(self.name("high"), 1000)
        holders = self.holed_ring(node, self.name("holder"), free_pairs=1)
        assert 0 not in holders and 1 not in holders, holders
        # By count the ring keeps room for both pods (the pair 0,1 and five single holes), so
        # only the extender refuses the waiting pod: the pair is held for the nominated one.
        nominated = self.name("nominated")
        body = self.scenario.pod_body(nominated, {NEURON: 2}, priority_class=high)
        # Too much CPU for any node: it stays pending, nominated, as after a preemption whose
        # victims are still leaving.
        body["spec"]["containers"][0]["resources"]["requests"] = {"cpu": "10000"}
        self.cp.request("POST", f"/api/v1/namespaces/{self.scenario.namespace}/pods", body)
        self.cp.request(
            "PATCH",
            f"/api/v1/namespaces/{self.scenario.namespace}/pods/{nominated}/status",
            {"status": {"nominatedNodeName": node}},
            content_type="application/merge-patch+json",
        )
        self.scenario.wait_event(nominated, "NeuronBlockHeld", seconds=30)
        waiter = self.name("waiter")
        self.scenario.create_pod(waiter, {NEURON: 2})
        self.refused(waiter)
        start = time.time()
        self.scenario.delete_pod(nominated)
        return [self.bound_after(waiter, start)]

    def claim(self, nodes: list[str]) -> list[float]:
        """Job A's member is of no running scheduler: the extender reserves the UltraServer for
        it, and the claim ends when A has done nothing for CLAIM_SECONDS. Job B's member waits
        for the unit meanwhile."""

        def member(job: str, scheduler: str) -> str:
            body = self.scenario.pod_body(f"{job}-worker-0", {NEURON: 16}, scheduler=scheduler)
            body["metadata"]["labels"] = {
                "training.kubeflow.org/job-name": job,
                "training.kubeflow.org/job-role": "worker",
            }
            body["metadata"]["annotations"] = {"neuron-scheduler.io/gang-size": "1"}
            self.cp.request("POST", f"/api/v1/namespaces/{self.scenario.namespace}/pods", body)
            return str(body["metadata"]["name"])

        wait_for(lambda: not claims(self.cp), "the last round's claims to end", 120)
        first = self.name("job")
        member(first, "nobody")
        held = wait_for(lambda: claims(self.cp, first), f"job {first}'s claim", 60)
        ends = min(held)
        waiter = member(self.name("job"), "my-scheduler")
        self.refused(waiter)
        assert time.time() < ends, "the claim ended before the other job's member was refused"
        return [self.bound_after(waiter, ends)]

    def batch(self, nodes: list[str]) -> list[float]:
        """Rings full of 1-device pods, 2-device pods waiting; half the small pods go at once."""
        small = []
        for node in nodes:
            for _ in range(12):
                small.append(self.bind_directly(self.name("small"), 1, node)["metadata"]["name"])
        waiting = [self.name("waiter") for _ in range(3 * len(nodes))]
        for pod in waiting:
            self.scenario.create_pod(pod, {NEURON: 2})
        for pod in waiting:
            self.refused_quick(pod)
        time.sleep(SETTLE)
        start = time.time()
        for pod in random.Random(self.rounds).sample(small, len(small) // 2):
            self.scenario.delete_pod(pod)
        waits: dict[str, float] = {}
        deadline = start + self.cap
        while time.time() < deadline:
            pods = self.scenario.pods()
            for pod in pods:
                name = pod["metadata"]["name"]
                if name in waiting and pod["spec"].get("nodeName") and name not in waits:
                    waits[name] = time.time() - start
            if not fitting(pods, {n: RING for n in nodes}):
                break
            time.sleep(0.05)
        else:
            for name in fitting(self.scenario.pods(), {n: RING for n in nodes}):
                waits[name] = self.cap
        return list(waits.values())

    def refused_quick(self, pod: str) -> None:
        def decided() -> bool:
            found = self.scenario.pod(pod)
            if found["spec"].get("nodeName"):
                return True
            conditions = found.get("status", {}).get("conditions", [])
            return any(c.get("type") == "PodScheduled" for c in conditions)

        wait_for(decided, f"{pod} to be tried", 60)


def claims(cp: ControlPlane, job: str = "") -> list[float]:
    """When each UltraServer claim (of `job`, or any) ends (wall clock)."""
    listed = cp.request("GET", "/apis/neuron-scheduler.io/v1alpha1/ultraserverclaims")
    ends = []
    for claim in listed["items"]:
        if job and claim["spec"]["job"] != job:
            continue
        renewed = datetime.fromisoformat(claim["spec"]["renewTime"].replace("Z", "+00:00"))
        ends.append(renewed.timestamp() + claim["spec"]["seconds"])
    return ends


def fitting(pods: list[dict[str, Any]], nodes: dict[str, str]) -> list[str]:
    """Pending pods some node could take, by the annotations of the pods bound there."""
    catalog = Catalog.builtin()
    used: dict[str, int] = {}
    for pod in pods:
        node = pod["spec"].get("nodeName")
        if node and not pod["metadata"].get("deletionTimestamp"):
            used[node] = used.get(node, 0) | ids_mask(ids(pod, "NEURON_CORES"))
    found = []
    for pod in pods:
        if pod["spec"].get("nodeName"):
            continue
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        request = NeuronRequest(next(iter(limits)), int(next(iter(limits.values()))))
        for node, kind in nodes.items():
            topology = catalog.resolve(kind, *neuron_capacity(kind)).topology
            if isinstance(allocate(topology, NodeState(used.get(node, 0)), request), Placement):
                found.append(pod["metadata"]["name"])
                break
    return found


def wakes_per_pod(log: Path, since: int) -> tuple[int, Counter[str]]:
    """The extender log's wake lines after byte `since`: (its size now, wakes per pod), the
    wakes written, or with writes off those it would have written."""
    text = log.read_bytes()[since:].decode(errors="replace")
    found = re.findall(r"(?:woke pending pod|would wake pod) (\S+):", text)
    return since + len(text.encode()), Counter(found)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def main() -> None:
    kinds = ["deleted", "completed", "batch", "failed-bind", "preemption", "claim"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch-rounds", type=int, default=5, help="rounds of the batch kind")
    parser.add_argument("--rings", type=int, default=12, help="rings of the batch kind")
    parser.add_argument("--cap", type=float, default=60.0, help="seconds a round waits at most")
    parser.add_argument("--wake-rate", type=float, default=20.0, help="0: the extender before")
    parser.add_argument("--kinds", nargs="+", choices=kinds, default=kinds)
    args = parser.parse_args()
    if min(args.rounds, args.batch_rounds, args.rings) < 1 or args.cap <= 0:
        parser.error("--rounds, --batch-rounds, --rings and --cap must be positive")
    extender_args = [
        f"--wake-rate={args.wake_rate}",
        f"--ultraserver-claim-seconds={CLAIM_SECONDS}",
    ]
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs; Kubernetes v1.36.3, the chart's "
        f"profile, default backoff and flush; extender {' '.join(extender_args)}"
    )
    with ControlPlane(find_kubebin(ROOT)) as cp:
        stack = Stack(cp, extender_args=extender_args)
        config = scheduler_config(
            extender_url=stack.extender.url, node_cache_capable=True, pki=stack.pki
        )
        for testbed_only in ("podInitialBackoffSeconds", "podMaxBackoffSeconds"):
            del config[testbed_only]
        stack.scheduler = cp.start_scheduler(config=config)
        log = stack.extender.process.log_path
        # A node every pod's nodeSelector excludes: NodeAffinity refuses it on every attempt.
        cp.request("POST", "/api/v1/nodes", node_json("excluded", RING))
        one, many, ultra = Bench(stack, args.cap), Bench(stack, args.cap), Bench(stack, args.cap)
        ring = one.node()
        rings = [many.node() for _ in range(args.rings)]
        unit = [ultra.node("trn2u.48xlarge", ULTRASERVER) for _ in range(4)]
        stages: dict[str, tuple[Bench, int, Callable[[], list[float]]]] = {
            "deleted": (one, args.rounds, lambda: one.deleted(ring)),
            "completed": (one, args.rounds, lambda: one.deleted(ring, complete=True)),
            "batch": (many, args.batch_rounds, lambda: many.batch(rings)),
            "failed-bind": (one, args.rounds, lambda: one.failed_bind(ring)),
            "preemption": (one, args.rounds, lambda: one.preemption(ring)),
            "claim": (ultra, args.rounds, lambda: ultra.claim(unit)),
        }
        print(
            f"{'kind':12} {'rounds':>6} {'waits':>6} {'p50 s':>7} {'p99 s':>7} {'max s':>7} "
            f"{'capped':>6} {'wakes/pod':>9} {'rounds woken':>12}"
        )
        for kind in args.kinds:
            bench, rounds, stage = stages[kind]
            waits: list[float] = []
            most_wakes = woken = 0
            offset = log.stat().st_size
            for _ in range(rounds):
                waits += stage()
                offset, wakes = wakes_per_pod(log, offset)
                most_wakes = max([most_wakes, *wakes.values()])
                woken += bool(wakes)
                bench.clear()
            capped = sum(1 for w in waits if w >= args.cap)
            print(
                f"{kind:12} {rounds:6d} {len(waits):6d} {statistics.median(waits):7.2f} "
                f"{percentile(waits, 0.99):7.2f} {max(waits):7.2f} {capped:6d} {most_wakes:9d} "
                f"{woken:12d}",
                flush=True,
            )
        stack.scheduler.stop()
        stack.stop()


if __name__ == "__main__":
    main()
